// defines: ShardedUnits, the machinery behind FullyShardedDataParallel (fsdp.h draws one unit's life): the units'
// flat parameters, when each is gathered, freed and reduced during forward and backward, the hooks that tell it,
// and the replay of a step's unit collectives for a rank that joins without data.
#pragma once
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "engine/replica.h"
#include "gradsync/fsdp.h"
#include "gradsync/stats.h"
#include "shard/flat_param.h"
#include "shard/order_check.h"
#include "shard/wrap_policy.h"

namespace gradsync {

class ShardedUnits {
 public:
  // What one unit has done in the current forward/backward.
  struct Progress {
    bool needs_backward = false;  // its forward ran with grad enabled
    size_t pending = 0;           // parameters whose gradient has not arrived in this backward
    bool post_backward_done = false;
  };
  using Collective = std::pair<OrderCheck::Op, size_t>;  // what, and which unit

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  FsdpOptions options;
  std::weak_ptr<ShardedUnits> self;
  std::vector<UnitPlan> plans;
  std::vector<std::unique_ptr<FlatParam>> flats;
  std::vector<FlatParam*> flat_views;  // the same, as the pointers count_memory() and full_state.h take
  std::vector<Progress> progress;
  std::map<std::string, size_t> unit_index;
  int64_t root = -1;  // index of the root unit, -1 when every parameter is in a unit
  BufferSync buffers;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // hooks live only while these do
  std::unique_ptr<OrderCheck> order;
  mutable MemoryMeter meter;
  CommStats traffic;
  const torch::optim::Optimizer* optimizer = nullptr;

  bool require_backward_sync = true;
  bool backward_sync = false;  // decided at forward time, used by the coming backward
  bool callback_queued = false;
  bool in_forward = false;
  std::vector<Collective> step_collectives;                // this forward/backward's, in order
  std::vector<size_t> forward_order;                       // units in the order this forward ran them
  std::deque<size_t> reductions_in_flight;                 // started in backward, oldest first
  std::optional<std::vector<Collective>> last_synced_step;  // the last synchronised one's: what a joiner replays

  Collectives& comm() { return world->comm(); }
  int size() const { return world->size(); }
  bool sharded() const { return options.strategy() != ShardingStrategy::NoShard; }
  bool is_root(size_t u) const { return static_cast<int64_t>(u) == root; }

  // Model and plan checked on every rank, rank 0's values everywhere, units flattened, hooks installed.
  void build(const std::string& who);
  void sample_memory() const;
  void begin_forward();
  void end_forward();
  // Gathers unit u, runs fn, and arms its pre-backward hook; `next` (the unit the forward reaches after it, when
  // known) has its all-gather started before fn runs (FsdpOptions::prefetch).
  torch::Tensor run_unit(size_t u, const std::function<torch::Tensor()>& fn, std::optional<size_t> next = {});
  torch::Tensor run_sequential(const torch::Tensor& input);
  void pre_backward(size_t u);
  void grad_ready(size_t u);
  void join_backward();
  void free_all();
  void abort_forward();
  // The ranks' micro-batch counts for this step fit FSDP's collectives, or every rank throws ConfigError.
  void agree_micro_batches(int64_t micro_batches);

 private:
  void gather(size_t u, OrderCheck::Op op);
  void start_gather(size_t u, OrderCheck::Op op);
  void reduce(size_t u);
  void start_reduce(size_t u);
  void finish_reductions(size_t keep_in_flight);
  size_t gathered_units() const;
  void prefetch_backward();
  void start_backward();
  void post_backward(size_t u);
  void finalize_backward();
  void end_synced_backward();
  void install_hooks();
  void replay(const Collective& collective);
};

}  // namespace gradsync
