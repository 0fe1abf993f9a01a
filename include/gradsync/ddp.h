// defines: DistributedDataParallel, data parallelism for any torch::nn module (torch::nn::Sequential,
// torch::nn::Linear, your own TORCH_MODULE), with PyTorch DDP's semantics and bucket layout. One gradient's path:
//
//   AccumulateGrad(param) writes .grad            (sums over micro-batches while no_sync is active)
//     -> hook: copy .grad into its bucket, x 1/N  (the division of Reduction::Mean, see reduction.h)
//        -> bucket complete: async SUM allreduce  (overlaps the rest of backward; MPI within one host: the buckets
//                                                  are shared memory, summed in place by the ranks)
//   final callback (still inside backward()): unused parameters -> zeros, wait for every bucket,
//     .grad = bucket contents                     (the mean over ranks, or the sum)
//
//   auto world = gradsync::init();
//   gradsync::DistributedDataParallel ddp(model, world);   // default Reduction::Mean, as PyTorch DDP
//   auto loss = loss_fn(ddp.forward(x), y);
//   loss.backward();                                       // gradients are the mean over ranks on return
//   optimizer.step();
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/comm_hook.h"
#include "gradsync/engine.h"
#include "gradsync/runtime.h"

namespace gradsync {

// PyTorch DDP's constructor arguments, set in libtorch's chained style:
//   gradsync::DdpOptions().bucket_cap_mb(25).find_unused_parameters(true)
struct DdpOptions {
  // bucket_cap_mb in bytes, as PyTorch computes it (int(bucket_cap_mb * 1024 * 1024)).
  size_t bucket_cap_bytes() const { return static_cast<size_t>(bucket_cap_mb_ * 1024 * 1024); }

  TORCH_ARG(Reduction, reduction) = Reduction::Mean;  // PyTorch DDP: mean
  TORCH_ARG(double, bucket_cap_mb) = 25;              // PyTorch's default; > 0
  TORCH_ARG(size_t, first_bucket_bytes) = 1u << 20;   // PyTorch's first bucket: small so communication starts early
  TORCH_ARG(bool, find_unused_parameters) = false;    // unused parameters then contribute zeros instead of failing
  TORCH_ARG(bool, broadcast_buffers) = true;          // rank 0's buffers before every forward that follows a synced one
  TORCH_ARG(bool, gradient_as_bucket_view) = false;   // .grad aliases the bucket: saves a copy; zero with zero_grad()
};

// When things happened in the last synchronised backward, in ms since its first gradient hook: shows that
// bucket allreduces start while backward is still computing earlier layers' gradients.
struct BackwardTimeline {
  std::vector<double> bucket_launch_ms;
  double last_hook_ms = 0;   // the last parameter's gradient was ready (backward compute ended)
  double finalize_ms = 0;    // the end-of-backward callback began waiting
};

class Reducer;  // the gradient engine behind it (buckets, hooks); private to the library

class DistributedDataParallel : public Engine {
 public:
  // Checks that every rank has the same parameters (count, names, shapes, dtypes) and buffers, failing on every
  // rank with the first difference; then broadcasts rank 0's parameters and buffers and installs the hooks.
  DistributedDataParallel(const ModuleRef& module, std::shared_ptr<World> world, DdpOptions options = {});
  ~DistributedDataParallel() override;

  using Engine::forward;
  bool require_sync() const override;
  void set_require_sync(bool sync) override;
  std::vector<torch::Tensor> parameters() const override;  // the parameters that require grad
  // Releases the gradients (.grad undefined until the next backward; works when .grad is a view of a bucket, where
  // Optimizer::zero_grad() throws). After that backward every .grad holds what zeroing in place would give.
  void zero_grad() override;
  double clip_grad_norm(double max_norm, double norm_type = 2.0) override;  // every rank holds the whole gradient
  void track_optimizer(const torch::optim::Optimizer* optimizer) override;
  StateDict state_dict(bool rank0_only = false) override;  // this rank's own module (replicas are equal)
  void load_state_dict(const StateDict& state) override;  // rank 0's state, then broadcast
  StateDict layout_state() const override;                // {"bucket_order": [indices]} once rebuilt, else {}
  // Collective (every rank, the same state): the rebuilt buckets, as if this run had built them.
  void load_layout_state(const StateDict& state) override;
  MemoryStats memory() const override;   // module parameters, .grad, optimizer state (buckets not counted)
  CommStats traffic() const override;    // bucket allreduces
  torch::nn::Module& module() override;
  Reduction reduction() const override;
  const char* name() const override { return "DistributedDataParallel"; }
  Collectives* comm() override;

  void begin_forward() override;  // rebuilds buckets once; broadcasts buffers when PyTorch would
  void end_forward() override;    // arms the hooks for the coming backward, unless syncing is off
  void join_backward() override;
  // Must be set before the synchronising backward (accumulate_global_mean() does it). Cleared after it.
  void set_global_item_count(int64_t items) override;

  // PyTorch's register_comm_hook: `hook` reduces every bucket from now on (comm_hook.h). Once, before the first
  // backward; a ConfigError otherwise.
  void register_comm_hook(CommHook hook);

  const DdpOptions& options() const;
  World& world();
  size_t bucket_count() const;
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  BackwardTimeline last_timeline() const;

 private:
  friend class Join;  // join.h: shadows this engine's collectives for ranks out of data
  std::shared_ptr<Reducer> reducer_;  // autograd hooks hold weak references to it
};

}  // namespace gradsync
