// defines: Reducer, the gradient synchronisation engine behind DistributedDataParallel (ddp.h, where one gradient's
// path is drawn): flat buckets laid out as PyTorch's (bucket.h), post-accumulate-grad hooks that launch bucket
// allreduces while backward runs, and the end-of-backward wait that writes the reduced gradients back.
#pragma once
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/bucket.h"
#include "engine/grad_hook.h"
#include "engine/replica.h"
#include "gradsync/comm_hook.h"
#include "gradsync/ddp.h"
#include "gradsync/stats.h"

namespace gradsync {

class Reducer {
 public:
  using Clock = std::chrono::steady_clock;
  struct Slot {
    size_t bucket = 0;
    torch::Tensor view;  // this parameter's region of its bucket, shaped like the parameter
    bool ready = false;  // its gradient has been copied into the bucket in this backward
    bool released = false;  // zero_grad() dropped a defined .grad since the last synchronised backward
    bool used_since_sync = false;  // received a gradient since the last synchronised backward (no_sync included)
  };
  struct Bucket {
    torch::Tensor flat;
    std::vector<size_t> params;
    size_t pending = 0;  // parameters whose gradient is not in the bucket yet
    PendingWork work;
  };

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  DdpOptions options;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  BufferSync buffers;
  std::vector<compat::GradAccumulator> accumulators;  // hooks live only while these do
  std::vector<Slot> slots;
  std::vector<Bucket> buckets;
  const torch::optim::Optimizer* optimizer = nullptr;
  mutable MemoryMeter meter;
  CommStats traffic;

  mutable std::mutex mutex;
  bool require_backward_sync = true;   // false inside no_sync()
  bool expect_hooks = false;           // a synced forward armed the coming backward
  bool callback_queued = false;
  size_t next_launch = 0;              // buckets launch strictly in index order on every rank
  bool rebuilt = false;                // the layout follows the observed gradient order (once)
  bool synced_once = false;            // a synchronised backward (or a join) has completed
  std::vector<size_t> ready_order;     // gradient order seen in the first synchronised backward
  std::vector<size_t> rebuilt_order;   // the agreed order the buckets were rebuilt in (empty: initial layout)
  bool rebuild_due = false;            // a loaded layout state: rebuild at the next forward from ready_order
  std::optional<int64_t> global_items; // Reduction::GlobalMean: items in this step over all ranks
  std::optional<int64_t> join_divisor; // Join without divide_by_initial_world_size: ranks in this step
  CommHook comm_hook;                  // empty: the default path (scale while copying, SUM allreduce)
  Clock::time_point backward_start;
  BackwardTimeline timeline;

  // Cross-rank model check, rank 0's values everywhere, initial buckets, hooks (self: the owning shared_ptr).
  void set_up(const std::shared_ptr<Reducer>& self);

  int rank() const { return world->rank(); }
  int size() const { return world->size(); }
  double ms_since_start() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - backward_start).count();
  }

  void before_forward();
  void after_forward();
  void join_backward();
  void mark_ready(size_t index, const std::weak_ptr<Reducer>& self);
  std::vector<std::string> bucket_names(size_t bucket) const;  // its parameters' names, in bucket order
  void sample_memory() const;
  void rebuild_buckets(const std::vector<size_t>& order);  // the layout of that gradient order, from now on
  void release_grads();  // DistributedDataParallel::zero_grad()

 private:
  void queue_finalize(const std::weak_ptr<Reducer>& self);
  void copy_into_bucket(size_t index);
  void launch_ready_buckets();
  void finalize(bool joined);
  double divisor() const;
  double bucket_scale() const;
  PendingWork run_comm_hook(size_t index);
  std::vector<size_t> zero_unused(bool joined);
  std::vector<bool> globally_used(const std::vector<size_t>& unused, bool joined);
  void write_back(const std::vector<bool>& used_anywhere);
  void reset();
  void build_buckets(const std::vector<BucketPlan>& layout);
  void maybe_rebuild_buckets();
};

}  // namespace gradsync
