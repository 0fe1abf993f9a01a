// defines: ShardedUnits, the machinery behind FullyShardedDataParallel (fsdp.h draws one unit's life): the units'
// flat parameters, when each is gathered, freed and reduced during forward and backward, the hooks that tell it,
// and the replay of a micro-step's unit events for a rank that takes part in one without data (Note [Shadow
// micro-steps] in docs/semantics.md).
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

#include "engine/grad_hook.h"
#include "engine/replica.h"
#include "gradsync/fsdp.h"
#include "gradsync/stats.h"
#include "runtime/mesh.h"
#include "shard/flat_param.h"
#include "shard/order_check.h"
#include "shard/unit_slots.h"
#include "shard/wrap_policy.h"

namespace gradsync {

// The FSDP engine's name (PyTorch's class name), first in the errors of fsdp.cpp and of its units.
inline constexpr const char* kFsdpName = "FullyShardedDataParallel";

class ShardedUnits {
 public:
  // What one unit has done in the current forward/backward.
  struct Progress {
    bool needs_backward = false;  // its forward ran with grad enabled
    size_t pending = 0;           // parameters whose gradient has not arrived in this backward
    bool post_backward_done = false;
    int64_t traced_from_ns = 0;   // tracing: when its forward or backward began (0: not traced)
  };
  // What a micro-step did, unit by unit: its forward ran the unit (and whether a backward will reach it), the
  // unit's backward started, its gradient was complete. Replaying these through the same functions issues the same
  // collectives in the same order, synchronised or not.
  struct Event {
    enum class Kind { Run, PreBackward, PostBackward } kind;
    size_t unit;
    bool needs_backward = false;  // Run only
  };

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  FsdpOptions options;
  Mesh mesh;  // hybrid strategies: the shard and replica groups; otherwise empty (units span the world)
  std::weak_ptr<ShardedUnits> self;
  std::vector<UnitPlan> plans;
  std::vector<std::unique_ptr<FlatParam>> flats;
  std::vector<FlatParam*> flat_views;  // the same, as the pointers count_memory() and full_state.h take
  std::vector<Progress> progress;
  std::map<std::string, size_t> unit_index;
  int64_t root = -1;  // index of the root unit, -1 when every parameter is in a unit
  BufferSync buffers;
  std::vector<compat::GradAccumulator> accumulators;  // hooks live only while these do
  std::unique_ptr<OrderCheck> order;
  std::unique_ptr<UnitSlots> slots;  // last member but the state below: restored before the units go
  mutable MemoryMeter meter;
  CommStats traffic;
  const torch::optim::Optimizer* optimizer = nullptr;

  bool require_backward_sync = true;
  bool backward_sync = false;  // decided at forward time, used by the coming backward
  bool requires_all_reduce = true;  // hybrid: FullyShardedDataParallel::set_requires_all_reduce
  bool replica_sync = false;   // hybrid: the coming backward all-reduces across replicas (decided at forward time)
  bool callback_queued = false;
  bool in_forward = false;
  // A forward with grad has run and its backward has not (Note [A forward without grad before a backward]).
  bool backward_pending = false;
  bool replaying = false;                           // a shadow micro-step: events are not recorded
  std::optional<size_t> running_unit;               // the unit whose forward is running (units do not nest)
  std::optional<int64_t> global_items;              // Reduction::GlobalMean: the step's items over all ranks
  std::vector<Event> events;                        // this micro-step's, in order
  std::optional<std::vector<Event>> last_events;    // the last completed micro-step's: what a shadow one replays
  std::vector<size_t> forward_order;                // units in the order this forward ran them
  // FULL_SHARD: the unit this forward ran last stays gathered until another unit runs or its own backward starts,
  // so the backward that begins with it does not gather what was just freed (Note [The last unit stays gathered]).
  std::optional<size_t> kept_gathered;
  std::deque<size_t> reductions_in_flight;          // started in backward, oldest first

  Collectives& comm() { return world->comm(); }
  // What a unit's parameters are sharded over and its all-gathers and reduce-scatters span: the shard group under
  // a hybrid strategy, the world otherwise.
  Collectives& group() { return mesh.shard ? *mesh.shard : comm(); }
  // Tracing (trace.h): "unit NAME" for the unit's collectives ("" without a tracer), and its compute span.
  std::string trace_label(size_t u) { return comm().tracer() ? "unit " + flats[u]->name() : std::string(); }
  void trace_begin(size_t u);
  void trace_end(const char* what, size_t u);
  int size() const { return world->size(); }
  bool sharded() const { return options.strategy() != ShardingStrategy::NoShard; }
  bool hybrid() const { return is_hybrid(options.strategy()); }
  bool is_root(size_t u) const { return static_cast<int64_t>(u) == root; }

  // Model and plan checked on every rank, rank 0's values everywhere, units flattened, hooks installed.
  void build(const std::string& who);
  void sample_memory() const;
  void begin_forward();
  void end_forward();
  // Gathers unit u, runs fn, and arms its pre-backward hook; the unit after it in plan order has its all-gather
  // started before fn runs (FsdpOptions::prefetch).
  torch::Tensor run_unit(size_t u, const std::function<torch::Tensor()>& fn);
  // Units without a slot (wrap_policy.h), which only forward_with() + unit() can run.
  std::vector<std::string> units_without_slot() const;
  void pre_backward(size_t u);
  void grad_ready(size_t u, size_t i);  // parameter i of unit u has its gradient
  // A shadow micro-step: the last completed micro-step's events replayed, forward part and backward part, with
  // zero gradients (or what no_sync micro-steps accumulated).
  void join_forward();
  void join_backward();
  void free_all(bool keep_root = false);
  void abort_forward();
  // The micro-steps every rank takes part in this step (the largest count); a rank with fewer runs shadow
  // micro-steps after its own. Every rank throws ConfigError, naming the ranks, where one has nothing to replay.
  int64_t agree_micro_batches(int64_t micro_batches);
  // What the gradient is multiplied by before the SUM (Note [Where the division happens]): 1/N, 1, or 1/T.
  double grad_factor() const;

 private:
  // Sets a flag for its scope, exceptions included.
  struct Replaying {
    explicit Replaying(bool& flag) : flag_(flag) { flag_ = true; }
    ~Replaying() { flag_ = false; }
    bool& flag_;
  };
  void require_item_count() const;
  void record(Event::Kind kind, size_t u, bool needs_backward = false);
  void enter_unit(size_t u);
  void release_kept(std::optional<size_t> except = std::nullopt);
  void leave_unit(size_t u, bool needs_backward);
  void gather(size_t u, OrderCheck::Op op);
  void start_gather(size_t u, OrderCheck::Op op);
  void start_reduce(size_t u);
  void finish_reductions(size_t keep_in_flight);
  size_t gathered_units() const;
  void prefetch_backward();
  void start_backward();
  void post_backward(size_t u);
  void finalize_backward();
  void reduce_across_replicas();
  void end_synced_backward();
  void make_flats();
  void install_hooks();
};

}  // namespace gradsync
