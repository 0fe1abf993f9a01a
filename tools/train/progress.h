// defines: Progress, what rank 0 of `gradsync train` reports while it trains: on a terminal one line rewritten in
// place after every step, otherwise a plain line every --log-every steps (by default about twenty in a run).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/runtime.h"
#include "train/train.h"

namespace gradsync::cli {

// Whether a person watches: stderr is a terminal, or the `train` that started this rank saw one (GRADSYNC_PROGRESS).
bool progress_on_terminal();

// The steps after which a plain line is printed: every `every` steps (0: about twenty in `total`), and the last.
int64_t progress_cadence(int64_t every, int64_t total);

// One line: step of total, epoch, the step's loss (mean over ranks), samples/s (tokens/s for token data) over this
// run, the step's time, the time left at this run's rate, and each rank's peak resident memory so far.
std::string progress_line(const StepRecord& r, int64_t total, double rate, bool tokens, double eta_seconds,
                          const std::vector<int64_t>& peak_bytes);

class Progress {
 public:
  struct Options {
    bool enabled = true;    // every rank: false under --quiet (the same on all ranks: the memory gather is collective)
    bool terminal = false;  // rank 0's stderr is a terminal (or the `train` that started the ranks saw one)
    int64_t every = 0;      // --log-every (0: about twenty lines a run)
    int64_t total = 0;      // the run's last step + 1
    bool tokens = false;    // token data: the rate counts valid tokens
  };
  Progress(Options options, std::shared_ptr<World> world);
  // Every rank, after every step: on the cadence's steps the ranks' peak memory is gathered (one allgather of one
  // int64 per rank), then rank 0 prints.
  void update(const StepRecord& r);
  // Ends the terminal line, so that what is printed next (the summary) starts on its own line.
  void finish();
  ~Progress() { finish(); }

 private:
  std::vector<int64_t> gather_peaks();

  Options options_;
  std::shared_ptr<World> world_;
  int64_t cadence_;
  bool printing_;  // rank 0
  bool open_line_ = false;
  double seconds_ = 0;
  int64_t items_ = 0;
  int64_t steps_ = 0;  // in this run (a resumed one starts past 0)
  std::vector<int64_t> peaks_;  // the last gathered, shown on the terminal line between gathers
};

}  // namespace gradsync::cli
