// defines: Join, PyTorch's torch.distributed.algorithms.join.Join for DistributedDataParallel: ranks hold
// different numbers of batches, and none needs to know the others' counts.
//
//   gradsync::Join join(ddp);                        // JoinOptions().divide_by_initial_world_size(false): see below
//   for (auto& batch : *loader) {                    // this rank's batches, however many
//     join.notify();                                 // once per step, before its synchronised forward
//     ddp.zero_grad();
//     loss_fn(ddp.forward(batch.data), batch.target).backward();
//     optimizer.step();
//   }
//   join.join();                                     // shadows the others' steps until every rank is done
//
// What a step computes: ranks out of data contribute zero gradients to the step's allreduces (they "shadow" them);
// the mean divides by the initial world size N (PyTorch's default, divide_by_initial_world_size=true), or by the
// ranks still training (false). Buffers are broadcast from the highest rank still training, not rank 0 (which may
// have joined). At the end every rank takes the parameters and buffers of the last rank to join (the highest of
// them): shadowing ranks do not step their optimizers, as in PyTorch. Costs one allreduce of N numbers per step.
#pragma once
#include <cstdint>

#include <torch/torch.h>

#include "gradsync/ddp.h"

namespace gradsync {

struct JoinOptions {
  TORCH_ARG(bool, divide_by_initial_world_size) = true;  // PyTorch's default
};

class Join {
 public:
  // ConfigError for a model with a SyncBatchNorm (a joined rank runs no forward to meet its collectives).
  explicit Join(DistributedDataParallel& ddp, JoinOptions options = {});
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // A rank that still has data, before the step's synchronised forward: every rank learns how many are still
  // training (returned) and which is the highest; the step divides and broadcasts buffers accordingly. Collective.
  int64_t notify();
  // notify(), then gradsync::accumulate(ddp, micro_batches, micro_loss).
  template <typename LossFn>
  double accumulate(int64_t micro_batches, LossFn&& micro_loss) {
    notify();
    return gradsync::accumulate(ddp_, micro_batches, std::forward<LossFn>(micro_loss));
  }
  // This rank is out of data: shadows the other ranks' steps until all have joined, then synchronises the final
  // parameters and buffers from the last rank to join. Returns how many steps this rank shadowed. Collective; call
  // it once, after this rank's last step.
  int64_t join();

 private:
  torch::Tensor exchange(bool training);  // one SUM allreduce of a one-hot vector: who is still training

  DistributedDataParallel& ddp_;
  JoinOptions options_;
  bool joined_ = false;
};

}  // namespace gradsync
