// defines: StepLog, the --log file `gradsync train` writes while it trains (JSON lines, rewritten on --resume so it
// reads as one uninterrupted run; the progress line is train/progress.h).
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

}  // namespace gradsync::cli
