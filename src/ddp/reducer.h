// defines: Reducer, the gradient synchronisation engine behind DistributedDataParallel: cross-rank model check,
// rank-0 broadcast, flat buckets, post-accumulate-grad hooks that launch bucket allreduces while backward runs,
// and the end-of-backward wait that writes the reduced gradients back. One gradient's path:
//
//   AccumulateGrad(param) writes .grad            (sums over micro-batches while no_sync is active)
//     -> hook: copy .grad into its bucket, x 1/N  (the division of Reduction::Mean, see reduction.h)
//        -> bucket complete: async SUM allreduce  (overlaps the rest of backward)
//   final callback (still inside backward()): unused parameters -> zeros, wait for every bucket,
//     .grad = bucket contents                     (the mean over ranks, or the sum)
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/reduction.h"
#include "gradsync/runtime.h"

namespace gradsync {

struct DdpOptions {
  Reduction reduction = Reduction::Mean;     // PyTorch DDP: mean
  size_t bucket_cap_bytes = 25u << 20;       // PyTorch's bucket_cap_mb=25
  size_t first_bucket_bytes = 1u << 20;      // PyTorch's first bucket: small so communication starts early
  bool find_unused_parameters = false;       // unused parameters then contribute zeros instead of failing
  bool broadcast_buffers = true;             // rank 0's buffers before every forward that follows a synced one
  bool gradient_as_bucket_view = false;      // .grad aliases the bucket: saves a copy; zero with zero_grad()
};

// When things happened in the last synchronised backward, in ms since its first gradient hook: shows that
// bucket allreduces start while backward is still computing earlier layers' gradients.
struct BackwardTimeline {
  std::vector<double> bucket_launch_ms;
  double last_hook_ms = 0;   // the last parameter's gradient was ready (backward compute ended)
  double finalize_ms = 0;    // the end-of-backward callback began waiting
};

class Reducer {
 public:
  // Checks that every rank has the same parameters (count, names, shapes, dtypes) and buffers, failing on every
  // rank with the first difference; then broadcasts rank 0's parameters and buffers and installs the hooks.
  Reducer(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<World> world, DdpOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void before_forward();  // broadcasts buffers when PyTorch would
  void after_forward();   // arms the hooks for the coming backward, unless syncing is off

  // For a rank with no data in a step (uneven inputs): after before_forward() and after_forward() without a
  // real forward, takes part in the step's bucket allreduces with zero gradients, so the other ranks neither
  // wait nor see a different sequence of collectives. .grad then holds the reduced gradient like everywhere.
  void join_backward();
  // Reduction::GlobalMean: the number of items (samples, tokens) in this step over all ranks and micro-batches;
  // must be set before the synchronising backward (accumulate_global_mean() does it). Cleared after it.
  void set_global_item_count(int64_t items);
  World& world();

  bool require_sync() const;
  void set_require_sync(bool sync);
  // Zeroes gradients in place (works when .grad is a view of a bucket, where Optimizer::zero_grad() throws).
  void zero_grad();

  const DdpOptions& options() const;
  size_t bucket_count() const;
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  BackwardTimeline last_timeline() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Disables gradient synchronisation for the forward/backward passes in its scope (accumulation micro-steps);
// .grad then sums locally and the next synchronised backward reduces that sum.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(Reducer& reducer) : reducer_(reducer), previous_(reducer.require_sync()) {
    reducer_.set_require_sync(false);
  }
  ~NoSyncGuard() { reducer_.set_require_sync(previous_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  Reducer& reducer_;
  bool previous_;
};

}  // namespace gradsync
