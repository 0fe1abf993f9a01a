// defines: Zero1DataParallel, ZeRO stage 1: every rank keeps the full model and computes full local gradients, but
// owns the optimizer state of only 1/N of the (flattened, padded) parameters. The step:
//
//   backward            .grad of every parameter is a view of one flat local gradient buffer (sums micro-batches)
//   end of backward     x 1/N, reduce-scatter (SUM) -> this rank's slice of the mean gradient   (Psi moved)
//   optimizer.step()    the user's optimizer, built over parameters() (this rank's slice): elementwise, so equal to
//                       the unsharded update
//   next forward        all-gather of the updated slices into the full parameters            (Psi moved)
//
// That is the ZeRO paper's 2 Psi per step, the same as DDP's allreduce; DDP's allreduce followed by a broadcast of
// the updated shards (PyTorch's ZeroRedundancyOptimizer) would move 3 Psi. Reducing in backward's final callback
// and gathering lazily before the next forward (or state_dict(), or sync_parameters()) keeps the training loop
// exactly DDP's: no step(optimizer) of its own. The gradient is reduced at the end of backward, not bucket by
// bucket, so it does not overlap backward.
//
// Memory per rank: full parameters Psi + full gradient Psi + master shard Psi/N + shard gradient Psi/N +
// optimizer state K Psi/N (bytes of the model dtype; see stats.h).
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/engine.h"
#include "gradsync/fsdp.h"
#include "gradsync/runtime.h"

namespace gradsync {

// Chained like libtorch's options: gradsync::ZeroOptions().reduction(gradsync::Reduction::Sum).
struct ZeroOptions {
  // Of the gradient over ranks (Note [Where the division happens]); GlobalMean with accumulate_global_mean().
  TORCH_ARG(Reduction, reduction) = Reduction::Mean;
  TORCH_ARG(bool, broadcast_buffers) = true;          // as DDP: rank 0's buffers before a forward after a synced one
  // The flat parameters: one of every trainable parameter (unset, the default), or one per unit of FSDP's wrap
  // policy (fsdp.h), each sharded and reduce-scattered on its own.
  TORCH_ARG(std::optional<WrapPolicy>, wrap);
};

class Zero1Shard;  // the flat parameter, its slice and when it is reduced and gathered; private to the library

class Zero1DataParallel : public Engine {
 public:
  // Checks the model is the same on every rank, broadcasts rank 0's parameters and buffers, flattens the
  // trainable parameters (one floating dtype; frozen ones stay whole, as DDP) and keeps this rank's slice.
  Zero1DataParallel(const ModuleRef& module, std::shared_ptr<World> world, ZeroOptions options = {});
  ~Zero1DataParallel() override;

  using Engine::forward;
  bool require_sync() const override;
  void set_require_sync(bool sync) override;
  // This rank's slice (a leaf that requires grad): build the optimizer over it.
  std::vector<torch::Tensor> parameters() const override;
  // This rank's part of each original parameter (views of the slice), for optimizer parameter groups; see FSDP's.
  torch::OrderedDict<std::string, torch::Tensor> named_parameters() override;
  void set_global_item_count(int64_t items) override;  // Reduction::GlobalMean
  void zero_grad() override;
  // The norm of the whole mean gradient, as clip_grad_norm_ on unsharded gradients (one small allreduce).
  double clip_grad_norm(double max_norm, double norm_type = 2.0) override;
  void track_optimizer(const torch::optim::Optimizer* optimizer) override;
  StateDict state_dict(bool rank0_only = false) override;  // parameters are whole: no gather; buffers rank 0's
  void load_state_dict(const StateDict& state) override;
  StateDict full_gradients() override;  // collective: one all-gather of shard gradients per unit
  // Collective: one all-gather per unit and state tensor (src/engine/full_optim_state.h).
  c10::IValue full_optim_state_dict(const torch::optim::Optimizer& optimizer, bool rank0_only = true) override;
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state) override;
  MemoryStats memory() const override;
  CommStats traffic() const override;
  torch::nn::Module& module() override;
  Reduction reduction() const override;
  const char* name() const override { return "Zero1DataParallel"; }
  Collectives* comm() override;

  void begin_forward() override;  // all-gathers the slices after a reduction (see Zero1Shard); buffers as DDP
  void end_forward() override;
  void join_backward() override;  // reduce-scatters zeros

  // Collective: all-gathers the updated slices into the module's parameters now instead of before the next
  // forward (for reading module() right after optimizer.step()); the next training forward gathers again, so a
  // step taken after this call still reaches the parameters. A no-op when nothing was reduced since.
  void sync_parameters();
  std::vector<UnitInfo> units() const;  // its flat parameters (ZeroOptions::wrap)
  // Collective. This rank's slice and its optimizer state in DIR/shard-<rank>-of-<N>.pt (see FSDP's save_sharded).
  void save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer = nullptr);
  void load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer = nullptr);

 private:
  std::shared_ptr<Zero1Shard> shard_;  // autograd hooks hold weak references to it
};

}  // namespace gradsync
