// defines: one optimizer step of `gradsync train` (its gradient, before optimizer.step()), written once against the
// engine interface, the one-process reference that replays several ranks' batches, and the --verify-every checks.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "data/data.h"
#include "data/models.h"
#include "gradsync/collectives.h"
#include "gradsync/engine.h"
#include "train/schedule.h"
#include "train/train.h"

namespace gradsync::cli {

struct StepContext {
  const TrainConfig& config;
  const Dataset& data;
  Model model;   // the unwrapped model (what --verify-every and the fault injection read)
  Engine* engine;                // null for a plain local model (the verification's reference)
  std::shared_ptr<World> world;  // null for --strategy local
  Reduction reduction;
};

// --log-samples: the dataset indices of step s of the epoch over every rank (padding duplicates included), rank by
// rank. Collective.
std::vector<int64_t> step_sample_ids(const StepContext& ctx, const BatchSchedule& schedule, int64_t s);

// The per-sample-mean (or summed, per --loss-reduction) loss of one micro-batch in float32, with its graph.
torch::Tensor micro_batch_loss(const StepContext& ctx, const torch::Tensor& indices);

// Logits [B, L, V] against targets [B, L]: the cross-entropy of the valid tokens (targets != -100), summed or
// averaged over them. The mean of none is 0/0: PyTorch returns NaN and the step would train on it; ConfigError instead.
torch::Tensor token_loss(const torch::Tensor& output, const torch::Tensor& target, bool mean);

// The items of the samples `indices` of `data`: their count, or for token data their valid targets (no forward).
int64_t items_in(const Dataset& data, const torch::Tensor& indices);

// The summed loss of one micro-batch's items and their count, for Reduction::GlobalMean: samples (the per-sample mean
// times their count) or, for token data, the cross-entropy summed over the valid tokens and their count.
ItemLoss micro_batch_items(const StepContext& ctx, const torch::Tensor& indices);

// A step's loss, samples and tokens summed over ranks, in flight (one 24-byte allreduce) while the optimizer steps:
// waiting for it right after backward added its round trip and the ranks' skew (0.25-1.6 ms a step on Gloo here).
class RecordTotals {
 public:
  RecordTotals() = default;  // nothing to reduce: the record already holds the figures over all ranks
  RecordTotals(Collectives& comm, const StepRecord& record);  // starts the allreduce
  // Waits, then writes the mean loss over ranks and the total samples and tokens into record.
  void finish(StepRecord& record);

 private:
  torch::Tensor totals_;  // {loss, samples, tokens} in float64
  PendingWork work_;
  int ranks_ = 1;
};

// This rank's micro-batches of step s -> .grad as the reduction defines it; fills record.loss and record.samples
// with figures over all ranks once the returned totals are finished (run_step does it after zero_grad()).
using StepFn =
    std::function<RecordTotals(const StepContext& ctx, const BatchSchedule& schedule, int64_t s, StepRecord&)>;

// Chosen once per run: the engine's step (accumulate(), or accumulate_global_mean() for Reduction::GlobalMean), or,
// for --strategy local with --replay-ranks or global-mean, the one-process statement of the reduction over every
// replayed rank's micro-batches.
StepFn choose_step(const TrainConfig& config, int rank);

// --inject-fault crash@STEP (a first attempt only: TORCHELASTIC_RESTART_COUNT unset or 0) or crash-always@STEP:
// the last rank SIGKILLs itself before the step. Tests only.
void inject_crash(const StepContext& ctx, int64_t step);

// --verify-every: rank 0 recomputes the step's gradient in one process from every rank's micro-batches (gathered:
// one allgather of their indices) and throws DistributedError if the synchronised gradient differs.
void verify_gradient(const StepContext& ctx, const std::vector<torch::Tensor>& micro, int64_t step);
// --verify-every: after the update, every rank's parameters must be bit-identical (one allgather of digests); for
// the strategies that hold whole replicas (holds_replicas() in strategy.h).
void verify_replicas(const StepContext& ctx, int64_t step);

}  // namespace gradsync::cli
