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

// The micro-batch count at `new_ranks` ranks of a run that took K = `accumulate` micro-batches per step at `ranks`,
// keeping the global batch B and each rank's micro-batch no larger: the smallest K' with N'*K' >= N*K that N'*K'
// divides B. That is K*N/N' whenever N'*(K*N/N') divides B (6 ranks x 2 -> 4 ranks x 3; each micro-batch the same
// size). 0 when N' does not divide B (no K' exists). docs/semantics.md, Note [Resuming at another world size].
int64_t accumulate_after_resize(int64_t accumulate, int ranks, int new_ranks, int64_t global_batch);

class TrainCheckpoints {
 public:
  // Nothing happens without --checkpoint-dir. Collective (rank 0 prepares the directory).
  TrainCheckpoints(const TrainConfig& config, Collectives* comm);

  // --resume from a checkpoint saved at another world size (or with a K derived from one) by a run started with this
  // run's --accumulate: the K for a schedule of `world_size` ranks (a local run's --replay-ranks),
  // accumulate_after_resize() of the K and ranks the run started with (recorded in every checkpoint since, so
  // resizes do not drift: 3 x 1 -> 2 x 3 -> 3 x 1 again). Otherwise --accumulate as given: a different value is the
  // user's choice for this size, and the new start.
  int64_t accumulate_for(int world_size);

  // --resume: loads the newest complete checkpoint and returns its position; step 0 when there is none yet (the
  // first attempt of a run under --max-restarts). A checkpoint of another configuration is a ConfigError naming
  // every differing flag with both values. Collective.
  Position resume(Engine& engine, torch::optim::Optimizer& optimizer);

  // After a step: saves when one is due -- every --checkpoint-every steps (default: at every epoch's end) and
  // after the run's last step. Collective.
  void after_step(const Position& next, int64_t total_steps, Engine& engine, const torch::optim::Optimizer& opt);

 private:
  const std::optional<CheckpointInfo>& latest();
  void say_resuming(const CheckpointInfo& latest, const Position& at) const;

  const TrainConfig& config_;
  std::optional<Checkpoints> checkpoints_;
  std::optional<std::optional<CheckpointInfo>> latest_;  // found once: the scan may move a damaged one aside
  int64_t accumulate_;  // this run's K (accumulate_for()), recorded in every checkpoint
  int64_t ranks_;       // the ranks of this run's data schedule (accumulate_for()), recorded too
  int64_t origin_accumulate_, origin_ranks_;  // K and ranks where the run started (or --accumulate last changed)
  int world_size_ = 1;
  int rank_ = 0;
};

}  // namespace gradsync::cli
