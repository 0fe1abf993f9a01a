// When FSDP's units are gathered, freed and reduced (see sharded_units.h; one unit's life is drawn in fsdp.h).
#include "shard/sharded_units.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>

#include "engine/grad_hook.h"
#include "gradsync/error.h"

namespace gradsync {
namespace {

constexpr const char* kWho = "FullyShardedDataParallel";
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

// Every unit collective starts here or in start_reduce(), so the order check and the join replay see them all, in
// the order every rank issues them.
void ShardedUnits::start_gather(size_t u, OrderCheck::Op op) {
  auto& flat = *flats[u];
  if (flat.gathered()) return;
  order->expect(comm(), op, u, flat.padded_numel());
  flat.start_gather(comm(), traffic);
  step_collectives.emplace_back(op, u);
  sample_memory();
}

void ShardedUnits::reduce(size_t u) {
  start_reduce(u);
  flats[u]->finish_reduce();
  sample_memory();
}

void ShardedUnits::start_reduce(size_t u) {
  auto& flat = *flats[u];
  order->expect(comm(), OrderCheck::Op::ReduceGrad, u, flat.padded_numel());
  flat.start_reduce(comm(), options.reduction(), traffic);
  step_collectives.emplace_back(OrderCheck::Op::ReduceGrad, u);
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
  if (options.strategy() != ShardingStrategy::FullShard || !options.prefetch()) return;
  if (gathered_units() >= kMaxGatheredUnits) return;
  for (auto it = forward_order.rbegin(); it != forward_order.rend(); ++it) {
    const auto& p = progress[*it];
    if (!p.needs_backward || p.post_backward_done || flats[*it]->gathered()) continue;
    start_gather(*it, OrderCheck::Op::BackwardGather);
    return;
  }
}

void ShardedUnits::begin_forward() {
  if (callback_queued) throw Error(fmt::format("{}: forward called while a backward is running", kWho));
  in_forward = true;
  step_collectives.clear();
  forward_order.clear();
  for (size_t u = 0; u < progress.size(); ++u) progress[u] = Progress{false, flats[u]->params().size(), false};
  buffers.before_forward(comm());
  if (root >= 0) {
    gather(static_cast<size_t>(root), OrderCheck::Op::ForwardGather);
    // The root's gradients arrive without an output hook announcing them: have the buffer ready.
    if (torch::GradMode::is_enabled()) flats[static_cast<size_t>(root)]->ensure_grad_buffer();
  }
  sample_memory();
}

torch::Tensor ShardedUnits::run_unit(size_t u, const std::function<torch::Tensor()>& fn, std::optional<size_t> next) {
  if (!in_forward) {
    throw Error(fmt::format("{}: unit('{}') called outside forward_with()", kWho, flats[u]->name()));
  }
  gather(u, OrderCheck::Op::ForwardGather);
  forward_order.push_back(u);
  if (next && options.prefetch()) {  // run_sequential knows the next unit: its gather overlaps this forward
    const bool keeps_all = options.strategy() == ShardingStrategy::ShardGradOp;  // holds every unit anyway
    if (keeps_all || gathered_units() < kMaxGatheredUnits) start_gather(*next, OrderCheck::Op::ForwardGather);
  }
  auto output = fn();
  if (torch::GradMode::is_enabled() && output.requires_grad()) {
    progress[u].needs_backward = true;
    // Fires when the gradient of the unit's output is known, before the unit's own backward runs.
    std::weak_ptr<ShardedUnits> weak = self;
    output.register_hook([weak, u](const torch::Tensor&) {
      if (auto units = weak.lock()) units->pre_backward(u);
    });
  }
  if (options.strategy() == ShardingStrategy::FullShard) flats[u]->free();
  return output;
}

// A torch::nn::Sequential child by child, each unit (a contiguous range of children) gathered around its children.
torch::Tensor ShardedUnits::run_sequential(const torch::Tensor& input) {
  auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module);
  if (!sequential) {
    throw ConfigError(fmt::format("{}: forward(x) drives a torch::nn::Sequential child by child; for another "
                                  "module call forward_with(body) and unit(name, fn) around each unit", kWho));
  }
  std::vector<int64_t> starts(sequential->size(), -1);  // which unit starts at which child (the root has none)
  for (size_t u = 0; u < plans.size(); ++u) {
    if (!plans[u].is_root) starts[plans[u].first_child] = static_cast<int64_t>(u);
  }
  auto x = input;
  const auto& precision = options.mixed_precision();
  if (precision.param_dtype && x.is_floating_point()) x = x.to(*precision.param_dtype);
  auto children = sequential->begin();
  for (size_t i = 0; i < sequential->size();) {
    if (starts[i] < 0) {
      x = children[static_cast<int64_t>(i)].forward(x);
      ++i;
      continue;
    }
    const auto& plan = plans[static_cast<size_t>(starts[i])];
    std::optional<size_t> next;  // the unit this forward reaches after this one
    for (size_t j = plan.last_child + 1; j < starts.size() && !next; ++j) {
      if (starts[j] >= 0) next = static_cast<size_t>(starts[j]);
    }
    x = run_unit(static_cast<size_t>(starts[i]), [&] {
      for (size_t j = plan.first_child; j <= plan.last_child; ++j) x = children[static_cast<int64_t>(j)].forward(x);
      return x;
    }, next);
    i = plan.last_child + 1;
  }
  return x;
}

void ShardedUnits::end_forward() {
  in_forward = false;
  const bool grad = torch::GradMode::is_enabled();
  // As DDP: whether the coming backward synchronises is decided now, and a forward that will not sync also skips
  // the buffer broadcast before the next forward.
  backward_sync = grad && require_backward_sync;
  buffers.after_forward(backward_sync);
  if (root >= 0 && grad) progress[static_cast<size_t>(root)].needs_backward = true;
  if (!grad) free_all();  // no backward will come to free them
  sample_memory();
}

void ShardedUnits::start_backward() {
  if (callback_queued) return;
  callback_queued = true;
  std::weak_ptr<ShardedUnits> weak = self;
  // Runs once the engine has finished this backward, before backward() returns.
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto units = weak.lock()) units->finalize_backward();
  });
}

void ShardedUnits::pre_backward(size_t u) {
  start_backward();
  gather(u, OrderCheck::Op::BackwardGather);  // FULL_SHARD freed it after forward (or prefetched it)
  flats[u]->ensure_grad_buffer();
  sample_memory();
  prefetch_backward();
}

void ShardedUnits::grad_ready(size_t u) {
  start_backward();
  auto& p = progress[u];
  if (p.pending == 0 || p.post_backward_done) {
    throw DistributedError(fmt::format("{} on rank {}: unit '{}' received a gradient after all of its parameters "
                                       "had one in this backward; run forward again before another backward",
                                       kWho, world->rank(), flats[u]->name()));
  }
  if (--p.pending == 0) post_backward(u);
}

void ShardedUnits::post_backward(size_t u) {
  auto& flat = *flats[u];
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
  if (options.strategy() == ShardingStrategy::FullShard) flat.free();
  prefetch_backward();
}

void ShardedUnits::finalize_backward() {
  callback_queued = false;
  // Units whose forward ran but whose parameters got no gradient on this rank still take part in the reduction
  // (zeros), in unit order: every rank must issue the same collectives.
  for (size_t u = 0; u < flats.size(); ++u) {
    if (progress[u].needs_backward && !progress[u].post_backward_done) post_backward(u);
  }
  finish_reductions(0);
  end_synced_backward();
}

void ShardedUnits::end_synced_backward() {
  free_all();
  if (backward_sync) {
    order->end_of_synced_backward(comm());
    last_synced_step = step_collectives;
  }
  for (auto& p : progress) p.needs_backward = false;
  sample_memory();
}

// A rank without data issues what its last synchronised step issued after the forward's start (begin_forward()
// already did the root's gather), with zero gradients: the same collectives in the same order as the others.
void ShardedUnits::join_backward() {
  if (!backward_sync) {
    throw ConfigError(fmt::format("{} on rank {}: a step without data needs a synchronised forward (outside "
                                  "no_sync, with grad enabled)", kWho, world->rank()));
  }
  if (!last_synced_step) {
    throw ConfigError(fmt::format("{} on rank {}: a step without data can be joined only after this rank has run "
                                  "one synchronised step (its unit collectives are replayed)", kWho, world->rank()));
  }
  const auto replay_of = *last_synced_step;
  for (size_t i = step_collectives.size(); i < replay_of.size(); ++i) replay(replay_of[i]);
  end_synced_backward();
}

// One recorded collective again, with what the original did around it: a forced gather (the unit may still be
// gathered here), zeros reduced, and FULL_SHARD's frees, so the joiner holds no more than one unit at a time.
void ShardedUnits::replay(const Collective& collective) {
  const auto [op, u] = collective;
  const bool full_shard = options.strategy() == ShardingStrategy::FullShard;
  if (op == OrderCheck::Op::ReduceGrad) {
    flats[u]->ensure_grad_buffer();  // zeros
    reduce(u);
    if (full_shard) flats[u]->free();
    return;
  }
  flats[u]->free();
  gather(u, op);
  if (full_shard && op == OrderCheck::Op::ForwardGather && !is_root(u)) flats[u]->free();
}

void ShardedUnits::abort_forward() {
  in_forward = false;
  for (auto& p : progress) p.needs_backward = false;
  free_all();  // what the aborted forward gathered
  sample_memory();
}

void ShardedUnits::agree_micro_batches(int64_t micro_batches) {
  if (size() == 1) return;
  const auto mine = torch::tensor({micro_batches, static_cast<int64_t>(last_synced_step.has_value())}, torch::kLong);
  auto all = torch::empty({2 * size()}, torch::kLong);
  comm().allgather_flat(mine, all);
  const int64_t* v = all.data_ptr<int64_t>();  // rank r: v[2r] micro-batches, v[2r+1] has a step to replay
  bool equal = true, joinable = true;
  std::vector<std::string> ranks;
  for (int r = 0; r < size(); ++r) {
    const int64_t k = v[2 * r];
    const bool can_join = v[2 * r + 1] != 0;
    equal = equal && k == v[0];
    joinable = joinable && (k == 1 || (k == 0 && can_join));
    ranks.push_back(k == 0 && !can_join ? fmt::format("rank {}: 0 (no synchronised step of its own yet)", r)
                                        : fmt::format("rank {}: {}", r, k));
  }
  const bool all_join = equal && v[0] == 0;
  if ((equal && !all_join) || joinable) return;
  throw ConfigError(fmt::format(
      "{}: the ranks' micro-batch counts do not fit one step ({}); FSDP gathers parameters in every forward, so "
      "every rank must run the same number of micro-batches, and a rank without data can join only a step in "
      "which the others run one, after a synchronised step of its own", kWho, fmt::join(ranks, ", ")));
}

void ShardedUnits::free_all() {
  for (auto& f : flats) f->free();
}

void ShardedUnits::build(const std::string& who) {
  plans = plan_units(*module, options.wrap());
  // Model and plan must agree on every rank before any unit collective is issued; rank 0's values everywhere,
  // before the parameters are flattened.
  std::vector<std::string> lines{
      fmt::format("strategy {} wrap {}", to_string(options.strategy()), options.wrap().to_string())};
  for (const auto& plan : plans) {
    lines.push_back(fmt::format("unit {}: {}", plan.name, fmt::join(plan.param_names, ", ")));
  }
  buffers = BufferSync(set_up_replica(comm(), who, *module, lines), options.broadcast_buffers());
  std::vector<std::string> names;
  for (size_t u = 0; u < plans.size(); ++u) {
    flats.push_back(std::make_unique<FlatParam>(plans[u], world->rank(), size(), sharded(),
                                                options.mixed_precision()));
    flat_views.push_back(flats.back().get());
    if (plans[u].is_root) root = static_cast<int64_t>(u);
    unit_index[plans[u].name] = u;
    names.push_back(plans[u].name);
  }
  progress.resize(flats.size());
  order = std::make_unique<OrderCheck>(names, options.order_checking());
  install_hooks();
  free_all();  // parameters are gathered when a forward needs them
  sample_memory();
}

// After flattening: set_data with a new dtype replaces a parameter's gradient accumulator.
void ShardedUnits::install_hooks() {
  for (size_t u = 0; u < flats.size(); ++u) {
    for (const auto& p : flats[u]->params()) {
      accumulators.push_back(on_gradient_accumulated(p, [weak = self, u] {
        if (auto units = weak.lock()) units->grad_ready(u);
      }));
    }
  }
}

}  // namespace gradsync
