// defines: SyncBatchNorm, BatchNorm whose batch statistics span every rank of a group, and
// convert_sync_batchnorm(), which swaps it in for a model's BatchNorms.
//
//   auto model = build_my_model();                            // torch::nn::BatchNorm1d/2d/3d inside Sequentials
//   gradsync::convert_sync_batchnorm(*model, world);          // before the engine is built, as in PyTorch
//   gradsync::DistributedDataParallel engine(model, world);
//
// Training forward: each rank's count, mean and biased variance per channel, one all-gather of 2C + 1 numbers,
// combined weighted by count (in float64, in rank order, so every rank gets the same bits); the input is normalised
// with the global mean and variance, and the running statistics move towards the global mean and the unbiased
// global variance, identically on every rank. Backward: the two per-channel sums the input gradient needs (of dy
// and of dy * (x - mean)) are SUM-allreduced and divided by the global count, so the input gradients are those of
// one BatchNorm over the union of the ranks' batches. The weight and bias gradients stay local sums: the engine
// reduces them like any other parameter. docs/semantics.md, Note [SyncBatchNorm], says where each division happens.
//
// Every rank of the group must run the same forwards and backwards in training: a rank without data forwards an
// empty batch (zero rows) and backpropagates its loss times zero (`gradsync train` does this for a rank that runs
// out of data). Eval mode uses the running statistics and communicates nothing.
#pragma once
#include <cstdint>
#include <memory>
#include <ostream>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync {

class World;

// The ranks a SyncBatchNorm normalises over: the whole world (a handle that keeps the World alive).
std::shared_ptr<Collectives> world_group(const std::shared_ptr<World>& world);

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // Same options, parameters, buffers and state-dict keys as torch::nn::BatchNorm1d/2d/3d (weight 1, bias 0,
  // running mean 0, running variance 1); inputs of 2 or more dimensions, channels in dimension 1.
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, std::shared_ptr<Collectives> group);
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, const std::shared_ptr<World>& world);
  // Takes over a torch::nn::BatchNorm1d/2d/3d: its options, training mode and its very parameter and buffer
  // tensors (what convert_sync_batchnorm() does). ConfigError when `batch_norm` is not one of those.
  SyncBatchNormImpl(const torch::nn::Module& batch_norm, std::shared_ptr<Collectives> group);

  torch::Tensor forward(const torch::Tensor& input);
  void reset() override;               // registers the parameters and buffers
  void reset_running_stats();          // running mean 0, running variance 1, no batches tracked
  void pretty_print(std::ostream& stream) const override;
  Collectives& group() const { return *group_; }

  torch::nn::BatchNormOptions options;
  torch::Tensor weight;               // undefined without affine
  torch::Tensor bias;
  torch::Tensor running_mean;         // undefined without track_running_stats
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

 private:
  void check_input(const torch::Tensor& input) const;
  double average_factor();  // the running statistics' weight of this batch (momentum, or 1/batches)
  void check_channels_agree();

  std::shared_ptr<Collectives> group_;
  const torch::nn::Module* adopt_ = nullptr;  // the BatchNorm whose tensors reset() registers, while constructing
  bool channels_checked_ = false;  // the first training forward checks that every rank has the same channels
};
TORCH_MODULE(SyncBatchNorm);

// Replaces, in place, every torch::nn::BatchNorm1d/2d/3d that is an element of a torch::nn::Sequential anywhere in
// `module` by a SyncBatchNorm over `group` with the same options and training mode, holding the same parameter and
// buffer tensors (an optimizer built before keeps working; state-dict keys do not change). Returns how many it
// replaced. A BatchNorm held any other way (a member of your module, called by your forward) cannot be swapped from
// outside: ConfigError naming it, before anything changes. Declare gradsync::SyncBatchNorm there instead.
int64_t convert_sync_batchnorm(torch::nn::Module& module, std::shared_ptr<Collectives> group);
int64_t convert_sync_batchnorm(torch::nn::Module& module, const std::shared_ptr<World>& world);

}  // namespace gradsync
