// defines: what `gradsync train` writes while it trains: StepLog (--log, JSON lines, rewritten on --resume so it
// reads as one uninterrupted run) and Progress (one line on a terminal).
#pragma once
#include <cstdint>
#include <fstream>
#include <string>

#include "train/train.h"

namespace gradsync::cli {

class StepLog {
 public:
  // resumed_at > 0: the run continues a checkpoint's; the lines of steps before it are kept, later ones (steps the
  // crashed run took after that checkpoint) dropped. Throws ConfigError when the file cannot be written.
  StepLog(const std::string& path, bool enabled, int64_t resumed_at);
  void write(const StepRecord& r);
  // --eval: {"epoch", "step" (the epoch's last), "test_accuracy"} after the epoch's step lines; for token data
  // also "test_loss" (nats per valid token; test_loss < 0: none).
  void write_accuracy(int64_t epoch, int64_t step, double percent, double test_loss = -1);

 private:
  void check();  // a failed write (a full disk) is an Error, not a silently shorter log

  std::string path_;
  std::ofstream file_;
};

// Progress on one line when a person is watching (stderr is a terminal, or the parent `train` saw one): the
// step, the loss, samples per second over this run and the time left at that rate.
class Progress {
 public:
  Progress(bool enabled, int64_t total) : enabled_(enabled), total_(total) {}
  void update(const StepRecord& r);
  ~Progress();

 private:
  bool enabled_;
  int64_t total_;
  double seconds_ = 0;
  int64_t samples_ = 0;
  int64_t steps_ = 0;  // in this run (a resumed one starts past 0)
};

}  // namespace gradsync::cli
