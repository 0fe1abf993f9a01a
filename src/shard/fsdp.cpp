// FullyShardedDataParallel: when units are gathered, freed and reduced (see fsdp.h for one unit's life).
#include "gradsync/fsdp.h"

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/clip_grad.h"
#include "common/consistency.h"
#include "gradsync/error.h"
#include "shard/flat_param.h"
#include "shard/order_check.h"
#include "shard/wrap_policy.h"
#include "shard/sharded_checkpoint.h"

namespace gradsync {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::FullShard: return "full_shard";
    case ShardingStrategy::ShardGradOp: return "shard_grad_op";
    case ShardingStrategy::NoShard: return "no_shard";
  }
  return "?";
}

struct FullyShardedDataParallel::State {
  // What one unit has done in the current forward/backward.
  struct Progress {
    bool needs_backward = false;  // its forward ran with grad enabled
    size_t pending = 0;           // parameters whose gradient has not arrived in this backward
    bool post_backward_done = false;
  };

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  FsdpOptions options;
  std::weak_ptr<State> self;
  std::vector<UnitPlan> plans;
  std::vector<std::unique_ptr<FlatParam>> flats;
  std::vector<Progress> progress;
  std::map<std::string, size_t> unit_index;
  int64_t root = -1;  // index of the root unit, -1 when every parameter is in a unit
  std::vector<torch::Tensor> buffers;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // hooks live only while these do
  std::unique_ptr<OrderCheck> order;
  MemoryMeter meter;
  CommStats traffic;
  const torch::optim::Optimizer* optimizer = nullptr;

  bool require_backward_sync = true;
  bool require_forward_param_sync = true;  // as DDP: broadcast buffers before a forward following a synced one
  bool backward_sync = false;              // decided at forward time, used by the coming backward
  bool callback_queued = false;
  bool in_forward = false;

  Collectives& comm() { return world->comm(); }
  int size() const { return world->size(); }
  bool sharded() const { return options.strategy != ShardingStrategy::NoShard; }
  bool is_root(size_t u) const { return static_cast<int64_t>(u) == root; }

  void sample_memory();
  void gather(size_t u, OrderCheck::Op op);
  void begin_forward();
  void end_forward();
  torch::Tensor run_unit(size_t u, const std::function<torch::Tensor()>& fn);
  void start_backward();
  void pre_backward(size_t u);
  void grad_ready(size_t u);
  void post_backward(size_t u);
  void finalize_backward();
  void free_all();
  void build(const std::string& who);
};

namespace {

// Called by autograd after AccumulateGrad has added into a parameter's .grad (a view of its unit's buffer).
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<FullyShardedDataParallel::State> state, size_t unit)
      : state_(std::move(state)), unit_(unit) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto state = state_.lock()) state->grad_ready(unit_);
    return outputs;
  }

 private:
  std::weak_ptr<FullyShardedDataParallel::State> state_;  // the hook outlives the wrapper inside autograd's graph
  size_t unit_;
};

constexpr const char* kWho = "FullyShardedDataParallel";

}  // namespace

void FullyShardedDataParallel::State::sample_memory() {
  StorageBytes params, grads;
  for (const auto& f : flats) {
    f->count_params(params);
    f->count_grads(grads);
  }
  meter.sample({params.bytes(), grads.bytes(), optimizer ? optimizer_state_bytes(*optimizer) : 0});
}

void FullyShardedDataParallel::State::gather(size_t u, OrderCheck::Op op) {
  auto& flat = *flats[u];
  if (flat.gathered()) return;
  order->expect(comm(), op, u, flat.padded_numel());
  flat.gather(comm(), traffic);
  sample_memory();
}

void FullyShardedDataParallel::State::begin_forward() {
  if (callback_queued) throw Error(fmt::format("{}: forward called while a backward is running", kWho));
  in_forward = true;
  for (size_t u = 0; u < progress.size(); ++u) progress[u] = Progress{false, flats[u]->params().size(), false};
  if (options.broadcast_buffers && require_forward_param_sync && size() > 1 && !buffers.empty()) {
    comm().broadcast_coalesced(buffers, /*root=*/0);
  }
  if (root >= 0) {
    gather(static_cast<size_t>(root), OrderCheck::Op::ForwardGather);
    // The root's gradients arrive without an output hook announcing them: have the buffer ready.
    if (torch::GradMode::is_enabled()) flats[static_cast<size_t>(root)]->ensure_grad_buffer();
  }
  sample_memory();
}

torch::Tensor FullyShardedDataParallel::State::run_unit(size_t u, const std::function<torch::Tensor()>& fn) {
  if (!in_forward) {
    throw Error(fmt::format("{}: unit('{}') called outside forward_with()", kWho, flats[u]->name()));
  }
  gather(u, OrderCheck::Op::ForwardGather);
  auto output = fn();
  if (torch::GradMode::is_enabled() && output.requires_grad()) {
    progress[u].needs_backward = true;
    // Fires when the gradient of the unit's output is known, before the unit's own backward runs.
    std::weak_ptr<State> weak = self;
    output.register_hook([weak, u](const torch::Tensor&) {
      if (auto state = weak.lock()) state->pre_backward(u);
    });
  }
  if (options.strategy == ShardingStrategy::FullShard) flats[u]->free();
  return output;
}

void FullyShardedDataParallel::State::end_forward() {
  in_forward = false;
  const bool grad = torch::GradMode::is_enabled();
  // As DDP: whether the coming backward synchronises is decided now, and a forward that will not sync also skips
  // the buffer broadcast before the next forward.
  backward_sync = grad && require_backward_sync;
  require_forward_param_sync = backward_sync;
  if (root >= 0 && grad) progress[static_cast<size_t>(root)].needs_backward = true;
  if (!grad) free_all();  // no backward will come to free them
  sample_memory();
}

void FullyShardedDataParallel::State::start_backward() {
  if (callback_queued) return;
  callback_queued = true;
  std::weak_ptr<State> weak = self;
  // Runs once the engine has finished this backward, before backward() returns.
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) state->finalize_backward();
  });
}

void FullyShardedDataParallel::State::pre_backward(size_t u) {
  start_backward();
  gather(u, OrderCheck::Op::BackwardGather);  // FULL_SHARD freed it after forward
  flats[u]->ensure_grad_buffer();
  sample_memory();
}

void FullyShardedDataParallel::State::grad_ready(size_t u) {
  start_backward();
  auto& p = progress[u];
  if (p.pending == 0 || p.post_backward_done) {
    throw DistributedError(fmt::format("{} on rank {}: unit '{}' received a gradient after all of its parameters "
                                       "had one in this backward; run forward again before another backward",
                                       kWho, world->rank(), flats[u]->name()));
  }
  if (--p.pending == 0) post_backward(u);
}

void FullyShardedDataParallel::State::post_backward(size_t u) {
  auto& flat = *flats[u];
  progress[u].post_backward_done = true;
  flat.ensure_grad_buffer();
  sample_memory();  // the unit's peak: gathered parameters and unsharded gradient together
  if (backward_sync) {
    order->expect(comm(), OrderCheck::Op::ReduceGrad, u, flat.padded_numel());
    flat.reduce_grads(comm(), options.reduction, traffic);
    sample_memory();
  }
  // FULL_SHARD reshards as soon as the unit's backward is done; the others keep parameters until the end.
  if (options.strategy == ShardingStrategy::FullShard) flat.free();
}

void FullyShardedDataParallel::State::finalize_backward() {
  callback_queued = false;
  // Units whose forward ran but whose parameters got no gradient on this rank still take part in the reduction
  // (zeros), in unit order: every rank must issue the same collectives.
  for (size_t u = 0; u < flats.size(); ++u) {
    if (progress[u].needs_backward && !progress[u].post_backward_done) post_backward(u);
  }
  free_all();
  if (backward_sync) order->end_of_synced_backward(comm());
  for (auto& p : progress) p.needs_backward = false;
  sample_memory();
}

void FullyShardedDataParallel::State::free_all() {
  for (auto& f : flats) f->free();
}

void FullyShardedDataParallel::State::build(const std::string& who) {
  auto& c = comm();
  plans = plan_units(*module, options.wrap);
  // Model and plan must agree on every rank before any unit collective is issued.
  auto lines = describe_module(*module);
  lines.push_back(fmt::format("strategy {} wrap {}", to_string(options.strategy), options.wrap.to_string()));
  for (const auto& plan : plans) {
    lines.push_back(fmt::format("unit {}: {}", plan.name, fmt::join(plan.param_names, ", ")));
  }
  check_same_on_every_rank(c, who, lines);
  // Rank 0's values everywhere, as DDP, before the parameters are flattened.
  std::vector<torch::Tensor> everything;
  for (const auto& p : module->parameters()) everything.push_back(p);
  for (const auto& b : module->buffers()) buffers.push_back(b);
  everything.insert(everything.end(), buffers.begin(), buffers.end());
  c.broadcast_coalesced(everything, /*root=*/0);

  std::vector<std::string> names;
  for (size_t u = 0; u < plans.size(); ++u) {
    flats.push_back(std::make_unique<FlatParam>(plans[u], world->rank(), size(), sharded(),
                                                options.mixed_precision));
    if (plans[u].is_root) root = static_cast<int64_t>(u);
    unit_index[plans[u].name] = u;
    names.push_back(plans[u].name);
  }
  progress.resize(flats.size());
  order = std::make_unique<OrderCheck>(names, options.order_checking);
  // Hooks after flattening: set_data with a new dtype replaces a parameter's gradient accumulator.
  for (size_t u = 0; u < flats.size(); ++u) {
    for (const auto& p : flats[u]->params()) {
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      accumulator->add_post_hook(std::make_unique<GradReadyHook>(self, u));
      accumulators.push_back(std::move(accumulator));
    }
  }
  free_all();  // parameters are gathered when a forward needs them
  sample_memory();
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   std::shared_ptr<World> world, FsdpOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.module = std::move(module);
  s.world = std::move(world);
  s.options = std::move(options);
  s.self = state_;
  if (s.options.reduction != Reduction::Mean && s.options.reduction != Reduction::Sum) {
    throw ConfigError(fmt::format("{}: reduction {} is not supported; expected mean or sum", kWho,
                                  gradsync::to_string(s.options.reduction)));
  }
  s.build(kWho);
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

torch::Tensor FullyShardedDataParallel::forward_with(const std::function<torch::Tensor()>& body) {
  auto& s = *state_;
  s.begin_forward();
  torch::Tensor output;
  try {
    output = body();
  } catch (...) {
    s.in_forward = false;
    throw;
  }
  s.end_forward();
  return output;
}

torch::Tensor FullyShardedDataParallel::unit(const std::string& name, const std::function<torch::Tensor()>& fn) {
  auto& s = *state_;
  auto it = s.unit_index.find(name);
  if (it == s.unit_index.end() || s.is_root(it->second)) {
    std::vector<std::string> known;
    for (const auto& f : s.flats) known.push_back(f->name());
    throw ConfigError(fmt::format("{}: no unit named '{}'; units are {} (the root unit is implicit)", kWho, name,
                                  fmt::join(known, ", ")));
  }
  return s.run_unit(it->second, fn);
}

torch::Tensor FullyShardedDataParallel::forward(const torch::Tensor& input) {
  auto& s = *state_;
  auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s.module);
  if (!sequential) {
    throw ConfigError(fmt::format("{}: forward(x) drives a torch::nn::Sequential child by child; for another "
                                  "module call forward_with(body) and unit(name, fn) around each unit", kWho));
  }
  // Which unit starts at which child (units are contiguous child ranges; the root unit has none).
  std::vector<int64_t> starts(sequential->size(), -1);
  for (size_t u = 0; u < s.plans.size(); ++u) {
    if (!s.plans[u].is_root) starts[s.plans[u].first_child] = static_cast<int64_t>(u);
  }
  auto x = input;
  const auto& precision = s.options.mixed_precision;
  if (precision.param_dtype && x.is_floating_point()) x = x.to(*precision.param_dtype);
  return forward_with([&] {
    auto children = sequential->begin();
    for (size_t i = 0; i < sequential->size();) {
      if (starts[i] < 0) {
        x = children[static_cast<int64_t>(i)].forward(x);
        ++i;
        continue;
      }
      const auto& plan = s.plans[static_cast<size_t>(starts[i])];
      x = s.run_unit(static_cast<size_t>(starts[i]), [&] {
        for (size_t j = plan.first_child; j <= plan.last_child; ++j) x = children[static_cast<int64_t>(j)].forward(x);
        return x;
      });
      i = plan.last_child + 1;
    }
    return x;
  });
}

bool FullyShardedDataParallel::require_sync() const { return state_->require_backward_sync; }
void FullyShardedDataParallel::set_require_sync(bool sync) { state_->require_backward_sync = sync; }
void FullyShardedDataParallel::continue_accumulation() { state_->require_forward_param_sync = false; }

std::vector<torch::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& f : state_->flats) out.push_back(f->shard());
  return out;
}

void FullyShardedDataParallel::zero_grad() {
  for (auto& f : state_->flats) {
    f->shard().mutable_grad() = torch::Tensor();
    f->release_grad_buffer();
  }
  state_->sample_memory();
}

void FullyShardedDataParallel::track_optimizer(const torch::optim::Optimizer* optimizer) {
  state_->optimizer = optimizer;
  state_->sample_memory();
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm, double norm_type) {
  auto& s = *state_;
  return gradsync::clip_grad_norm(parameters(), max_norm, norm_type, s.sharded() ? &s.comm() : nullptr);
}

StateDict FullyShardedDataParallel::full_state_dict(bool all_ranks) {
  auto& s = *state_;
  const bool receiver = all_ranks || s.world->rank() == 0;
  std::map<std::string, torch::Tensor> values;
  for (auto& flat : s.flats) {
    auto full = flat->full_master(s.comm());  // a collective: every rank takes part
    if (!receiver) continue;
    for (const auto& e : flat->entries()) values[e.name] = full.narrow(0, e.offset, e.numel).view(e.shape).clone();
  }
  std::vector<torch::Tensor> buffer_copies;
  for (const auto& b : s.buffers) buffer_copies.push_back(b.detach().clone());
  if (all_ranks) s.comm().broadcast_coalesced(buffer_copies, /*root=*/0);
  if (!receiver) return {};
  StateDict out;
  std::map<const void*, size_t> buffer_of;
  for (size_t i = 0; i < s.buffers.size(); ++i) buffer_of[s.buffers[i].unsafeGetTensorImpl()] = i;
  for (const auto& [name, tensor] : state_dict(*s.module)) {
    auto value = values.find(name);
    if (value != values.end()) {
      out.emplace_back(name, value->second);
    } else {
      auto b = buffer_of.find(tensor.unsafeGetTensorImpl());
      out.emplace_back(name, b != buffer_of.end() ? buffer_copies[b->second] : tensor.detach().clone());
    }
  }
  return out;
}

namespace {

// "" when `state` has exactly the module's keys with the same shapes; else what is wrong, all of it.
std::string state_dict_mismatch(const StateDict& state, const StateDict& expected) {
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  std::vector<std::string> missing, unexpected, shapes;
  std::map<std::string, bool> known;
  for (const auto& [name, tensor] : expected) {
    known[name] = true;
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
    } else if (!it->second.sizes().equals(tensor.sizes())) {
      shapes.push_back(fmt::format("{} (given [{}], model [{}])", name, fmt::join(it->second.sizes(), ", "),
                                   fmt::join(tensor.sizes(), ", ")));
    }
  }
  for (const auto& [name, tensor] : state) {
    if (!known.count(name)) unexpected.push_back(name);
  }
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back(fmt::format("missing keys: {}", fmt::join(missing, ", ")));
  if (!unexpected.empty()) parts.push_back(fmt::format("unexpected keys: {}", fmt::join(unexpected, ", ")));
  if (!shapes.empty()) parts.push_back(fmt::format("shape mismatches: {}", fmt::join(shapes, ", ")));
  return fmt::format("{}", fmt::join(parts, "; "));
}

}  // namespace

void FullyShardedDataParallel::load_full_state_dict(const StateDict& state) {
  auto& s = *state_;
  const bool root_rank = s.world->rank() == 0;
  std::string problem = root_rank ? state_dict_mismatch(state, state_dict(*s.module)) : "";
  fail_together(s.comm(), fmt::format("{}: load_full_state_dict", kWho), problem);
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  torch::NoGradGuard no_grad;
  for (auto& flat : s.flats) {
    auto full = torch::zeros({flat->padded_numel()}, torch::TensorOptions().dtype(flat->master_dtype()));
    if (root_rank) {
      for (const auto& e : flat->entries()) full.narrow(0, e.offset, e.numel).copy_(given.at(e.name).reshape({-1}));
    }
    if (s.size() > 1) s.comm().broadcast(full, /*root=*/0);
    flat->load_full_master(full);
  }
  if (root_rank) {
    for (const auto& [name, tensor] : state_dict(*s.module)) {
      bool is_buffer = false;
      for (const auto& b : s.buffers) is_buffer = is_buffer || b.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl();
      if (is_buffer) tensor.detach().copy_(given.at(name));
    }
  }
  s.comm().broadcast_coalesced(s.buffers, /*root=*/0);
  s.sample_memory();
}

namespace {

std::vector<ShardSlot> slots_of(const std::vector<std::unique_ptr<FlatParam>>& flats) {
  std::vector<ShardSlot> slots;
  for (const auto& f : flats) {
    slots.push_back({f->name(), f->numel(), f->padded_numel(), f->shard_offset(), f->shard()});
  }
  return slots;
}

}  // namespace

void FullyShardedDataParallel::save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer) {
  auto& s = *state_;
  std::string problem;
  try {
    save_shards(dir, fmt::format("fsdp:{}", to_string(s.options.strategy)), s.world->rank(), s.size(),
                slots_of(s.flats), optimizer);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  fail_together(s.comm(), fmt::format("{}: save_sharded", kWho), problem);
}

void FullyShardedDataParallel::load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer) {
  auto& s = *state_;
  std::string problem;
  try {
    load_shards(dir, s.world->rank(), s.size(), slots_of(s.flats), optimizer);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  fail_together(s.comm(), fmt::format("{}: load_sharded", kWho), problem);
  s.free_all();  // the next forward gathers the loaded values
  s.sample_memory();
}

MemoryStats FullyShardedDataParallel::memory() const { return state_->meter.stats(); }
void FullyShardedDataParallel::reset_peak_memory() { state_->meter.reset_peak(); }
CommStats FullyShardedDataParallel::comm_stats() const { return state_->traffic; }

std::vector<UnitInfo> FullyShardedDataParallel::units() const {
  std::vector<UnitInfo> out;
  for (size_t u = 0; u < state_->flats.size(); ++u) {
    const auto& f = *state_->flats[u];
    out.push_back({f.name(), state_->plans[u].param_names, f.numel(), f.padded_numel(), f.shard_numel(),
                   f.full_bytes()});
  }
  return out;
}

int64_t FullyShardedDataParallel::largest_unit_bytes() const {
  int64_t largest = 0;
  for (const auto& f : state_->flats) largest = std::max(largest, 2 * f->full_bytes());
  return largest;
}

const FsdpOptions& FullyShardedDataParallel::options() const { return state_->options; }
torch::nn::Module& FullyShardedDataParallel::module() { return *state_->module; }

}  // namespace gradsync
