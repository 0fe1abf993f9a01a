// defines: the sharded strategies of `gradsync train` (fsdp-full, fsdp-grad-op, fsdp-no-shard, zero1) behind the
// one interface the training loop calls where it would call DDP, and the memory/traffic report every strategy can
// print.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/stats.h"
#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"

namespace gradsync::cli {

struct TrainConfig;
struct StepContext;
struct StepRecord;

bool is_sharded_strategy(const std::string& strategy);
// Checks --wrap, --param-dtype, --reduce-dtype, --accumulate-grads against the strategy (ConfigError naming the
// flag). Called by validate() for every strategy.
void validate_sharding_flags(const TrainConfig& config);

class ShardedTraining {
 public:
  virtual ~ShardedTraining() = default;
  // The model's output for a micro-batch, in float32 whatever the compute dtype (the loss is computed in fp32).
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  // K micro-batches of micro_loss(k) / K; the same no_sync rule as DDP (see accumulate.h, fsdp.h, zero.h).
  virtual double accumulate(int64_t micro_batches, const std::function<torch::Tensor(int64_t)>& micro_loss) = 0;
  virtual std::vector<torch::Tensor> parameters() = 0;  // what the optimizer steps: this rank's shards
  virtual void track(const torch::optim::Optimizer& optimizer) = 0;
  virtual void step(torch::optim::Optimizer& optimizer) = 0;
  virtual void zero_grad() = 0;
  virtual StateDict full_state_dict() = 0;  // collective; the unwrapped model's state dict on rank 0
  virtual MemoryStats memory() = 0;
  virtual std::string describe() = 0;  // "fsdp-full, 3 units (0, 2, 4), largest 1.2 KiB" for the summary
};

std::unique_ptr<ShardedTraining> make_sharded_training(const TrainConfig& config, torch::nn::Sequential model,
                                                       const std::shared_ptr<World>& world);

// One optimizer step's gradient through ctx.sharded: K micro-batches, loss_k / K, then record.loss and
// record.samples over all ranks (as run_ddp_step).
void run_sharded_step(const StepContext& ctx, const std::vector<torch::Tensor>& micro, StepRecord& record);

// Bytes of a module's parameters (Psi in bytes).
int64_t parameter_bytes(const torch::nn::Module& module);
// Mean of the records' sent_bytes, leaving out the first step (first-step order checks, DDP's bucket rebuild)
// when there are others; 0 when nothing was measured.
double mean_sent_bytes(const std::vector<StepRecord>& records);

// Rank 0 prints every rank's peak memory (parameters, gradients, optimizer state) and the bytes each rank sent per
// step against Psi; a collective (every rank calls it).
void print_resource_report(const std::string& strategy, const MemoryStats& mine, double sent_per_step,
                           int64_t model_bytes, const std::shared_ptr<World>& world);

}  // namespace gradsync::cli
