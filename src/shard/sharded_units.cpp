// When FSDP's units are gathered, freed and reduced (see sharded_units.h; one unit's life is drawn in fsdp.h).
#include "shard/sharded_units.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>

#include "engine/grad_hook.h"
#include "gradsync/error.h"

namespace gradsync {
namespace {

// limit_all_gathers: FULL_SHARD holds at most this many gathered units besides the root (the one computing and
// the one prefetched), and at most this many reductions in flight (each holds its unsharded gradient).
constexpr size_t kMaxGatheredUnits = 2;
constexpr size_t kMaxReductionsInFlight = 1;

}  // namespace

void ShardedUnits::sample_memory() const { meter.sample(count_memory(flat_views, optimizer)); }

void ShardedUnits::gather(size_t u, OrderCheck::Op op) {
  start_gather(u, op);
  flats[u]->wait_gathered();  // a prefetched unit: its all-gather ends here
}

// Every unit collective starts here or in start_reduce(), so the order check sees them all, in the order every rank
// issues them.
void ShardedUnits::start_gather(size_t u, OrderCheck::Op op) {
  auto& flat = *flats[u];
  if (flat.gathered()) return;
  order->expect(comm(), op, u, flat.padded_numel());
  TraceLabel label(comm().tracer(), trace_label(u));
  flat.start_gather(group(), traffic);
  sample_memory();
}

void ShardedUnits::start_reduce(size_t u) {
  auto& flat = *flats[u];
  order->expect(comm(), OrderCheck::Op::ReduceGrad, u, flat.padded_numel());
  TraceLabel label(comm().tracer(), trace_label(u), grad_factor());
  flat.start_reduce(group(), grad_factor(), traffic);
}

void ShardedUnits::finish_reductions(size_t keep_in_flight) {
  while (reductions_in_flight.size() > keep_in_flight) {
    flats[reductions_in_flight.front()]->finish_reduce();
    reductions_in_flight.pop_front();
    sample_memory();
  }
}

size_t ShardedUnits::gathered_units() const {
  size_t n = 0;
  for (size_t u = 0; u < flats.size(); ++u) n += !is_root(u) && !flats[u]->aliases_master() && flats[u]->gathered();
  return n;
}

// Backward runs the units in reverse forward order: the next one is the last unit of this forward still waiting for
// its gradient. Its all-gather starts now (FULL_SHARD freed it after forward), within kMaxGatheredUnits.
void ShardedUnits::prefetch_backward() {
  if (!frees_after_use(options.strategy()) || !options.prefetch()) return;
  if (gathered_units() >= kMaxGatheredUnits) return;
  for (auto it = forward_order.rbegin(); it != forward_order.rend(); ++it) {
    const auto& p = progress[*it];
    if (!p.needs_backward || p.post_backward_done || flats[*it]->gathered()) continue;
    start_gather(*it, OrderCheck::Op::BackwardGather);
    return;
  }
}

// Note [A forward without grad before a backward]
// An evaluation may run between a forward and its backward (a metric on the batch, under NoGradGuard). It builds no
// graph, so the backward that comes is the earlier forward's: that forward's units, events and sync decision stay,
// as PyTorch's reducer keeps them. It gathers what it runs as any forward does, and leaves the root gathered at its
// end, which no hook of the backward would gather again; the backward gathers each unit again as it reaches it.
// Its gathers are recorded after the forward's, so a shadow micro-step issues both.
void ShardedUnits::begin_forward() {
  if (callback_queued) throw Error(fmt::format("{}: forward called while a backward is running", kFsdpName));
  in_forward = true;
  const bool between = backward_pending && !torch::GradMode::is_enabled();
  if (!between) {
    backward_pending = false;
    events.clear();
    forward_order.clear();
    for (size_t u = 0; u < progress.size(); ++u) progress[u] = Progress{false, flats[u]->params().size(), false};
  }
  // Nothing is gathered here unless the last forward's backward has not come (its root, its kept unit): their
  // parameters may have changed since, so they are gathered again.
  free_all();
  buffers.before_forward(comm());
  if (root >= 0) {
    gather(static_cast<size_t>(root), OrderCheck::Op::ForwardGather);
    // The root's gradients arrive without an output hook announcing them: have the buffer ready.
    if (torch::GradMode::is_enabled()) flats[static_cast<size_t>(root)]->ensure_grad_buffer();
  }
  sample_memory();
}

void ShardedUnits::record(Event::Kind kind, size_t u, bool needs_backward) {
  if (!replaying) events.push_back({kind, u, needs_backward});
}

// The forward reaches unit u: gathered, and the unit after it in plan order (the order of a Sequential's elements)
// prefetched, within kMaxGatheredUnits unless SHARD_GRAD_OP holds every unit anyway.
void ShardedUnits::enter_unit(size_t u) {
  release_kept(/*except=*/u);  // not the last unit after all: freed before anything else is gathered
  trace_begin(u);
  gather(u, OrderCheck::Op::ForwardGather);
  forward_order.push_back(u);
  const size_t next = u + 1;
  if (!options.prefetch() || next >= flats.size() || is_root(next) || progress[next].needs_backward) return;
  const bool keeps_all = sharded() && !frees_after_use(options.strategy());  // SHARD_GRAD_OP, hybrid or not
  if (keeps_all || gathered_units() < kMaxGatheredUnits) start_gather(next, OrderCheck::Op::ForwardGather);
}

// Note [The last unit stays gathered]: FULL_SHARD frees a unit once its forward is done, except the unit that
// turns out to be the forward's last: the backward starts with it, and freeing it would only gather the same bytes
// again (one all-gather of that unit per step saved; PyTorch keeps its root unit the same way). Whether a unit was
// the last is known when the next one runs, so the unit just left is kept until then. Every rank runs the same
// units in the same order, so every rank skips the same all-gather.
void ShardedUnits::leave_unit(size_t u, bool needs_backward) {
  progress[u].needs_backward = progress[u].needs_backward || needs_backward;
  trace_end("forward", u);
  if (!frees_after_use(options.strategy())) return;
  if (needs_backward) {
    kept_gathered = u;
  } else {
    flats[u]->free();
  }
}

// Frees the unit kept gathered by leave_unit(), unless it is `except` (about to run again, or its backward starts).
void ShardedUnits::release_kept(std::optional<size_t> except) {
  if (!kept_gathered) return;
  if (*kept_gathered != except) flats[*kept_gathered]->free();
  kept_gathered.reset();
}

torch::Tensor ShardedUnits::run_unit(size_t u, const std::function<torch::Tensor()>& fn) {
  if (!in_forward) {
    throw Error(fmt::format("{}: unit '{}' ran outside the engine's forward; call the engine's forward(x) (or "
                            "forward_with(body) for unit(name, fn)), not the module's", kFsdpName, flats[u]->name()));
  }
  if (running_unit) {
    throw ConfigError(fmt::format("{}: unit '{}' ran inside unit '{}'; units cannot nest (their events would replay "
                                  "in another order)", kFsdpName, flats[u]->name(), flats[*running_unit]->name()));
  }
  enter_unit(u);
  running_unit = u;
  torch::Tensor output;
  try {
    output = fn();
  } catch (...) {
    running_unit.reset();
    throw;
  }
  running_unit.reset();
  const bool needs_backward = torch::GradMode::is_enabled() && output.requires_grad();
  if (needs_backward) {
    // Fires when the gradient of the unit's output is known, before the unit's own backward runs.
    std::weak_ptr<ShardedUnits> weak = self;
    output.register_hook([weak, u](const torch::Tensor&) {
      if (auto units = weak.lock()) units->pre_backward(u);
    });
  }
  record(Event::Kind::Run, u, needs_backward);
  leave_unit(u, needs_backward);
  return output;
}

std::vector<std::string> ShardedUnits::units_without_slot() const {
  std::vector<std::string> out;
  for (const auto& plan : plans) {
    if (!plan.is_root && !plan.has_slot()) out.push_back(plan.name);
  }
  return out;
}

void ShardedUnits::end_forward() {
  in_forward = false;
  const bool grad = torch::GradMode::is_enabled();
  // As DDP: whether the coming backward synchronises is decided now, and a forward that will not sync also skips
  // the buffer broadcast before the next forward.
  buffers.after_forward(grad && require_backward_sync);
  if (grad) {
    backward_sync = require_backward_sync;
    replica_sync = backward_sync && requires_all_reduce;
    backward_pending = true;
    if (root >= 0) progress[static_cast<size_t>(root)].needs_backward = true;
  } else {
    // No backward of this forward will come to free them; a pending one (this forward ran between) needs its root.
    free_all(/*keep_root=*/backward_pending);
  }
  sample_memory();
}

// Every rank checks before its backward issues a collective (a real one in its first hook, a shadow one first
// thing), so a missing count fails everywhere instead of leaving a shadow rank waiting.
void ShardedUnits::require_item_count() const {
  if (backward_sync) gradsync::require_item_count(kFsdpName, world->rank(), options.reduction(), global_items);
}

void ShardedUnits::start_backward() {
  if (callback_queued || replaying) return;  // a replay calls finalize_backward() itself
  require_item_count();
  callback_queued = true;
  std::weak_ptr<ShardedUnits> weak = self;
  // Runs once the engine has finished this backward, before backward() returns.
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto units = weak.lock()) units->finalize_backward();
  });
}

void ShardedUnits::pre_backward(size_t u) {
  start_backward();
  record(Event::Kind::PreBackward, u);
  trace_begin(u);
  // The kept unit is u (still gathered from forward: its backward frees it) or, when the backward does not start
  // with the forward's last unit (its output unused), one that no longer needs holding.
  release_kept(/*except=*/u);
  gather(u, OrderCheck::Op::BackwardGather);  // FULL_SHARD freed it after forward (or prefetched it)
  flats[u]->ensure_grad_buffer();
  sample_memory();
  prefetch_backward();
}

void ShardedUnits::grad_ready(size_t u, size_t i) {
  flats[u]->take_grad(i);
  start_backward();
  auto& p = progress[u];
  if (p.pending == 0 || p.post_backward_done) {
    throw DistributedError(fmt::format("{} on rank {}: unit '{}' received a gradient after all of its parameters "
                                       "had one in this backward; run forward again before another backward",
                                       kFsdpName, world->rank(), flats[u]->name()));
  }
  if (--p.pending == 0) post_backward(u);
}

void ShardedUnits::post_backward(size_t u) {
  auto& flat = *flats[u];
  record(Event::Kind::PostBackward, u);
  progress[u].post_backward_done = true;
  flat.ensure_grad_buffer();
  sample_memory();  // the unit's peak: gathered parameters and unsharded gradient together
  if (backward_sync) {
    // The reduction runs while backward goes on with earlier units; finalize_backward() collects it.
    start_reduce(u);
    reductions_in_flight.push_back(u);
    finish_reductions(kMaxReductionsInFlight);
  }
  // FULL_SHARD reshards as soon as the unit's backward is done; the others keep parameters until the end.
  if (frees_after_use(options.strategy())) flat.free();
  trace_end("backward", u);
  prefetch_backward();
}

void ShardedUnits::trace_begin(size_t u) {
  if (comm().tracer()) progress[u].traced_from_ns = Tracer::now_ns();
}

void ShardedUnits::trace_end(const char* what, size_t u) {
  auto* tracer = comm().tracer();
  if (!tracer || progress[u].traced_from_ns == 0) return;
  TraceEvent e;
  e.kind = TraceEvent::Kind::Compute;
  e.name = what;
  e.label = trace_label(u);
  e.begin_ns = std::exchange(progress[u].traced_from_ns, 0);
  e.end_ns = Tracer::now_ns();
  tracer->record(std::move(e));
}

void ShardedUnits::finalize_backward() {
  callback_queued = false;
  // Units whose forward ran but whose parameters got no gradient on this rank still take part in the reduction
  // (zeros), in unit order: every rank must issue the same collectives.
  for (size_t u = 0; u < flats.size(); ++u) {
    if (progress[u].needs_backward && !progress[u].post_backward_done) post_backward(u);
  }
  finish_reductions(0);
  if (hybrid() && replica_sync) reduce_across_replicas();  // replica_sync implies backward_sync
  end_synced_backward();
}

// Note [Hybrid sharding]: the shard gradients the reduce-scatters summed inside the shard group (over this step's
// micro-steps, when every one reduces) are SUM-all-reduced across the replicas, every unit's at once and in unit
// order, so the link between hosts carries one all-reduce of 1/S of the model per step. The 1/N was applied before
// the reduce-scatter.
void ShardedUnits::reduce_across_replicas() {
  std::vector<size_t> units;
  std::vector<PendingWork> works;
  for (size_t u = 0; u < flats.size(); ++u) {
    if (!flats[u]->has_pending()) continue;
    order->expect(comm(), OrderCheck::Op::ReduceGrad, u, flats[u]->shard_numel());
    units.push_back(u);
    TraceLabel label(comm().tracer(), trace_label(u));
    works.push_back(flats[u]->all_reduce_pending(*mesh.replica, traffic));
  }
  for (size_t i = 0; i < units.size(); ++i) {
    works[i].wait();
    flats[units[i]]->finish_pending();
  }
  sample_memory();
}

void ShardedUnits::end_synced_backward() {
  backward_pending = false;
  free_all();
  if (backward_sync) {
    order->end_of_synced_backward(comm());
    global_items.reset();
  }
  if (!replaying) last_events = events;
  for (auto& p : progress) p.needs_backward = false;
  sample_memory();
}

// A shadow micro-step replays the last completed one's events through the functions that issued its collectives,
// so it issues the same ones in the same order (begin_forward() already gathered the root).
void ShardedUnits::join_forward() {
  if (!last_events) {
    throw ConfigError(fmt::format("{} on rank {}: a micro-step without data needs a completed micro-step of this "
                                  "rank's own first (its unit events are replayed)", kFsdpName, world->rank()));
  }
  Replaying guard(replaying);
  for (const auto& e : *last_events) {
    if (e.kind != Event::Kind::Run) continue;
    enter_unit(e.unit);
    leave_unit(e.unit, e.needs_backward && torch::GradMode::is_enabled());
  }
}

void ShardedUnits::join_backward() {
  if (!last_events) join_forward();  // throws: nothing to replay
  require_item_count();
  Replaying guard(replaying);
  for (const auto& e : *last_events) {
    if (e.kind == Event::Kind::PreBackward && progress[e.unit].needs_backward) pre_backward(e.unit);
    if (e.kind == Event::Kind::PostBackward && progress[e.unit].needs_backward) post_backward(e.unit);
  }
  finalize_backward();
}

void ShardedUnits::abort_forward() {
  in_forward = false;
  backward_pending = false;
  for (auto& p : progress) p.needs_backward = false;
  free_all();  // what the aborted forward gathered
  sample_memory();
}

int64_t ShardedUnits::agree_micro_batches(int64_t micro_batches) {
  if (size() == 1) return std::max<int64_t>(micro_batches, 1);
  const auto mine = torch::tensor({micro_batches, static_cast<int64_t>(last_events.has_value())}, torch::kLong);
  auto all = torch::empty({2 * size()}, torch::kLong);
  comm().allgather_flat(mine, all);
  const int64_t* v = all.data_ptr<int64_t>();  // rank r: v[2r] micro-batches, v[2r+1] has a micro-step to replay
  int64_t most = 0;
  for (int r = 0; r < size(); ++r) most = std::max(most, v[2 * r]);
  std::vector<std::string> stuck, ranks;
  for (int r = 0; r < size(); ++r) {
    const bool replayable = v[2 * r] > 0 || v[2 * r + 1] != 0;
    if (!replayable) stuck.push_back(std::to_string(r));
    ranks.push_back(fmt::format("rank {}: {}", r, v[2 * r]));
  }
  if (most > 0 && stuck.empty()) return most;
  throw ConfigError(fmt::format(
      "{}: the ranks' micro-batch counts do not fit one step ({}); FSDP gathers parameters in every forward, so a "
      "rank with fewer micro-batches replays its last micro-step without data, which rank(s) {} cannot do before "
      "a micro-step of their own", kFsdpName, fmt::join(ranks, ", "),
      stuck.empty() ? std::string("none: no rank has a micro-batch") : fmt::format("{}", fmt::join(stuck, ", "))));
}

double ShardedUnits::grad_factor() const { return gradient_factor(options.reduction(), size(), global_items); }

void ShardedUnits::free_all(bool keep_root) {
  for (size_t u = 0; u < flats.size(); ++u) {
    if (!(keep_root && is_root(u))) flats[u]->free();
  }
  kept_gathered.reset();
}

void ShardedUnits::build(const std::string& who) {
  if (options.mixed_precision().param_dtype) {
    for (const auto& p : module->named_parameters(/*recurse=*/true)) {
      if (p.value().requires_grad()) continue;
      throw ConfigError(fmt::format("{}: frozen parameter '{}' with a param dtype: frozen parameters stay whole in "
                                    "their own dtype, which the units' compute dtype would not match", who, p.key()));
    }
  }
  plans = plan_units(*module, options.wrap());
  if (hybrid()) mesh = make_mesh(*world, options.replicas(), options.shard_across_hosts(), who);
  // Model and plan must agree on every rank before any unit collective is issued; rank 0's values everywhere,
  // before the parameters are flattened.
  std::vector<std::string> lines{fmt::format("strategy {} wrap {} replicas {}", to_string(options.strategy()),
                                             options.wrap().to_string(), mesh.replicas)};
  for (const auto& plan : plans) {
    lines.push_back(fmt::format("unit {}: {}", plan.name, fmt::join(plan.param_names, ", ")));
  }
  buffers = BufferSync(set_up_replica(comm(), who, *module, lines), options.broadcast_buffers());
  make_flats();
  install_hooks();
  std::weak_ptr<ShardedUnits> weak = self;
  slots = std::make_unique<UnitSlots>(plans, [weak](size_t u, const std::function<torch::Tensor()>& body) {
    auto units = weak.lock();
    if (!units) throw Error(fmt::format("{}: a unit ran after its engine was destroyed", kFsdpName));
    return units->run_unit(u, body);
  });
  free_all();  // parameters are gathered when a forward needs them
  sample_memory();
}

// Each unit's flat parameter, sharded over the shard group (the world unless hybrid).
void ShardedUnits::make_flats() {
  std::vector<std::string> names;
  for (size_t u = 0; u < plans.size(); ++u) {
    flats.push_back(std::make_unique<FlatParam>(plans[u], group().rank(), group().size(), sharded(),
                                                options.mixed_precision()));
    if (hybrid()) flats.back()->defer_to_replicas();
    flat_views.push_back(flats.back().get());
    if (plans[u].is_root) root = static_cast<int64_t>(u);
    unit_index[plans[u].name] = u;
    names.push_back(plans[u].name);
  }
  progress.resize(flats.size());
  order = std::make_unique<OrderCheck>(names, options.order_checking());
}

// After flattening: set_data with a new dtype replaces a parameter's gradient accumulator.
void ShardedUnits::install_hooks() {
  for (size_t u = 0; u < flats.size(); ++u) {
    const auto& params = flats[u]->params();
    for (size_t i = 0; i < params.size(); ++i) {
      accumulators.push_back(on_gradient_accumulated(params[i], [weak = self, u, i] {
        if (auto units = weak.lock()) units->grad_ready(u, i);
      }));
    }
  }
}

}  // namespace gradsync
