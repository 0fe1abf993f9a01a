// defines: ZeRO stage 1 (Zero1 engine, Zero1DataParallel<ModuleHolder> wrapper): every rank keeps the full model
// and computes full local gradients, but owns the optimizer state of only 1/N of the (flattened, padded)
// parameters. The step:
//
//   backward            .grad of every parameter is a view of one flat local gradient buffer (sums micro-batches)
//   step(optimizer)     x 1/N, reduce-scatter (SUM) -> this rank's slice of the mean gradient   (Psi moved)
//                       optimizer.step() on this rank's slice only (elementwise: equal to the unsharded update)
//                       all-gather the updated slices into the full parameters                 (Psi moved)
//
// That is the ZeRO paper's 2 Psi per step, the same as DDP's allreduce; DDP's allreduce followed by a broadcast of
// the updated shards (PyTorch's ZeroRedundancyOptimizer) would move 3 Psi. The gradient is reduced at step(), not
// during backward, so there is no overlap with backward, and accumulation needs no no_sync (no_sync() exists only
// to keep DDP's buffer-broadcast rule, which decides BatchNorm parity with PyTorch DDP).
//
// Memory per rank: full parameters Psi + full gradient Psi + master shard Psi/N + shard gradient Psi/N +
// optimizer state K Psi/N (bytes of the model dtype; see memory.h).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <fmt/format.h>

#include "gradsync/error.h"
#include "gradsync/stats.h"
#include "gradsync/reduction.h"
#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"

namespace gradsync {

struct ZeroOptions {
  Reduction reduction = Reduction::Mean;  // of the gradient over ranks (see Note [Where the division happens])
  bool broadcast_buffers = true;          // as DDP: rank 0's buffers before a forward that follows a synced one
};

class Zero1 {
 public:
  // Checks the model is the same on every rank, broadcasts rank 0's parameters and buffers, flattens the
  // parameters (one floating dtype, all requiring grad) and keeps this rank's slice.
  Zero1(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<World> world, ZeroOptions options = {});
  ~Zero1();
  Zero1(const Zero1&) = delete;
  Zero1& operator=(const Zero1&) = delete;

  void before_forward();
  void after_forward();
  bool require_sync() const;
  void set_require_sync(bool sync);

  // This rank's slice (a leaf that requires grad): build the optimizer over it.
  std::vector<torch::Tensor> parameters() const;
  // Reduce-scatters the local gradients into the slice's .grad (once per step; step() calls it).
  void reduce_gradients();
  // reduce_gradients(), optimizer.step() on the slice, all-gather of the updated parameters.
  void step(torch::optim::Optimizer& optimizer);
  void zero_grad();
  // Reduces first if needed; the norm of the whole mean gradient, as clip_grad_norm_ on unsharded gradients.
  double clip_grad_norm(double max_norm, double norm_type = 2.0);
  void track_optimizer(const torch::optim::Optimizer* optimizer);

  StateDict full_state_dict(bool all_ranks = false);   // see FullyShardedDataParallel::full_state_dict
  void load_full_state_dict(const StateDict& state);   // collective; rank 0's state
  void save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer = nullptr);
  void load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer = nullptr);

  MemoryStats memory() const;
  CommStats comm_stats() const;
  torch::nn::Module& module();

  struct State;

 private:
  std::unique_ptr<State> state_;
};

template <typename ModuleHolder>
class Zero1DataParallel {
 public:
  Zero1DataParallel(ModuleHolder module, std::shared_ptr<World> world, ZeroOptions options = {})
      : module_(std::move(module)), engine_(std::make_unique<Zero1>(module_.ptr(), std::move(world), options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    engine_->before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    engine_->after_forward();
    return output;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  ModuleHolder& module() { return module_; }
  Zero1& engine() { return *engine_; }
  Zero1* operator->() { return engine_.get(); }

 private:
  ModuleHolder module_;
  std::unique_ptr<Zero1> engine_;
};

// K micro-batches: local backward passes (the first K-1 marked no-sync for the buffer rule), loss_k / K each;
// the caller then runs engine().step(optimizer), which reduces once.
template <typename ModuleHolder, typename LossFn>
double accumulate(Zero1DataParallel<ModuleHolder>& zero, int64_t micro_batches, LossFn&& micro_loss) {
  if (micro_batches < 1) {
    throw ConfigError(fmt::format("accumulate: {} micro-batches requested; expected at least 1", micro_batches));
  }
  double total = 0;
  auto& engine = zero.engine();
  const bool previous = engine.require_sync();
  for (int64_t k = 0; k < micro_batches; ++k) {
    engine.set_require_sync(k + 1 == micro_batches && previous);
    auto scaled = micro_loss(k) / static_cast<double>(micro_batches);
    scaled.backward();
    total += scaled.template item<double>();
  }
  engine.set_require_sync(previous);
  return total;
}

}  // namespace gradsync
