// defines: `gradsync train --checkpoint-dir`: what a checkpoint records beyond the model and optimizer (the
// position in the data and the configuration it belongs to), when one is saved, and how a run resumes from it.
// The files and their commit protocol are the library's (gradsync/checkpoint.h).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "gradsync/checkpoint.h"
#include "train/train.h"

namespace gradsync::cli {

// Where training continues: optimizer steps taken, and the step within the epoch that comes next.
struct Position {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t step_in_epoch = 0;
};

// --checkpoint-dir is an existing writable directory or one rank 0 can make (mkdir -p); --resume,
// --max-restarts, --checkpoint-every and --keep need it. ConfigError naming the flag and the path otherwise.
void validate_checkpoint_flags(const TrainConfig& config);

// The flags a checkpoint must have been saved with to be resumed ("--lr" -> "0.01"): the model, the data and
// its order, the optimizer and the loss. Not among them: the world size, the strategy, the backend, --accumulate
// and --steps/--epochs (a checkpoint is whole, see docs/semantics.md, Note [Resuming]).
std::map<std::string, std::string> configuration_fingerprint(const TrainConfig& config);

class TrainCheckpoints {
 public:
  // Nothing happens without --checkpoint-dir. Collective (rank 0 prepares the directory).
  TrainCheckpoints(const TrainConfig& config, Collectives* comm);

  // --resume: loads the newest complete checkpoint and returns its position; step 0 when there is none yet (the
  // first attempt of a run under --max-restarts). A checkpoint of another configuration is a ConfigError naming
  // every differing flag with both values. Collective.
  Position resume(Engine& engine, torch::optim::Optimizer& optimizer);

  // After a step: saves when one is due -- every --checkpoint-every steps (default: at every epoch's end) and
  // after the run's last step. Collective.
  void after_step(const Position& next, int64_t total_steps, Engine& engine, const torch::optim::Optimizer& opt);

 private:
  const TrainConfig& config_;
  std::optional<Checkpoints> checkpoints_;
  int rank_ = 0;
};

}  // namespace gradsync::cli
