// defines: one optimizer step of `gradsync train` (its gradient, before optimizer.step()) for each strategy and
// reduction, and the --verify-every checks of that gradient.
#pragma once
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "data/data.h"
#include "gradsync/ddp.h"
#include "train/sharded_training.h"
#include "train/train.h"

namespace gradsync::cli {

using Ddp = DistributedDataParallel<torch::nn::Sequential>;

struct StepContext {
  const TrainConfig& config;
  const Dataset& data;
  torch::nn::Sequential model;
  Ddp* ddp;                      // null for --strategy local
  std::shared_ptr<World> world;  // null for --strategy local
  Reduction reduction;
  ShardedTraining* sharded = nullptr;  // set for --strategy fsdp-* and zero1 (then ddp is null)
};

// The per-sample-mean (or summed, per --loss-reduction) loss of one micro-batch, with its graph.
torch::Tensor micro_batch_loss(const StepContext& ctx, const torch::Tensor& indices);

// This rank's micro-batches (possibly none) -> synchronised .grad; fills record.loss and record.samples with
// figures over all ranks.
void run_ddp_step(const StepContext& ctx, const std::vector<torch::Tensor>& micro, StepRecord& record);

// One process, the micro-batches of every replayed rank -> .grad as the reduction defines it.
void run_local_step(const StepContext& ctx, const std::vector<std::vector<torch::Tensor>>& per_rank,
                    StepRecord& record);

// --verify-every: rank 0 recomputes the step's gradient in one process from every rank's micro-batches (gathered:
// one allgather of their indices) and throws DistributedError if the synchronised gradient differs.
void verify_gradient(const StepContext& ctx, const std::vector<torch::Tensor>& micro, int64_t step);
// --verify-every: after the update, every rank's parameters must be bit-identical (one allgather of digests).
void verify_replicas(const StepContext& ctx, int64_t step);

}  // namespace gradsync::cli
