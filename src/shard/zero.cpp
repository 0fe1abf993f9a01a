// ZeRO stage 1 (see zero.h): the gradient is reduce-scattered at the end of backward, the updated slices are
// all-gathered before the next forward.
#include "gradsync/zero.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>

#include "common/clip_grad.h"
#include "common/consistency.h"
#include "engine/grad_hook.h"
#include "engine/replica.h"
#include "gradsync/error.h"
#include "shard/flat_param.h"
#include "engine/full_optim_state.h"
#include "shard/full_state.h"
#include "shard/sharded_checkpoint.h"
#include "shard/wrap_policy.h"

namespace gradsync {

class Zero1Shard {
 public:
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  ZeroOptions options;
  std::vector<std::unique_ptr<FlatParam>> owned;  // one per unit (ZeroOptions::wrap), sharded; full buffers stay
  std::vector<FlatParam*> flats;                  // gathered; the same, as the pointers the helpers take
  BufferSync buffers;
  std::vector<compat::GradAccumulator> accumulators;  // hooks live only while these do
  const torch::optim::Optimizer* optimizer = nullptr;
  mutable MemoryMeter meter;
  CommStats traffic;
  bool require_backward_sync = true;
  bool backward_sync = false;    // decided at forward time
  bool callback_queued = false;
  std::optional<int64_t> global_items;  // Reduction::GlobalMean: the step's items over all ranks
  // A reduction has happened and the training forward that follows it has not re-gathered yet: the user's
  // optimizer.step() (which gradsync cannot see: libtorch optimizers update p.data(), bumping no version counter)
  // may have changed the slice. Gathers for state_dict(), sync_parameters() or a no-grad forward keep it set, so a
  // step taken after them still reaches the parameters.
  bool pending_update = false;

  Collectives& comm() { return world->comm(); }
  void sample_memory() const { meter.sample(count_memory(flats, optimizer)); }
  std::vector<ShardSlot> slots() const { return shard_slots(flats); }

  // The full parameters again from every rank's slice (collective: every rank's slice is stepped alike).
  void regather() {
    for (auto* f : flats) f->refresh(comm(), traffic);
  }
  void regather_if_pending() {
    if (pending_update) regather();
  }
  // Reduce-scatters the local gradient into the slice's .grad (x 1/N for Mean, 1/T for GlobalMean: reduction.h).
  void reduce() {
    sample_memory();  // full local gradient and the state of the previous step: the usual peak
    for (auto* f : flats) f->start_reduce(comm(), grad_factor(), traffic);  // every unit's in flight at once
    for (auto* f : flats) f->finish_reduce();
    global_items.reset();
    pending_update = true;  // optimizer.step() comes next
    sample_memory();
  }
  double grad_factor() const {
    require_item_count("Zero1DataParallel", world->rank(), options.reduction(), global_items);
    return gradient_factor(options.reduction(), world->size(), global_items);
  }
  void on_gradient(const std::weak_ptr<Zero1Shard>& self) {
    if (!backward_sync || callback_queued) return;
    callback_queued = true;
    // Runs once the autograd engine has finished this backward, before backward() returns.
    torch::autograd::Engine::get_default_engine().queue_callback([self] {
      if (auto shard = self.lock()) {
        // Disarmed until the next synchronised forward, as DDP: another backward (a rank's own diagnostic pass)
        // accumulates locally instead of starting a reduction the other ranks do not run.
        shard->callback_queued = false;
        shard->backward_sync = false;
        shard->reduce();
      }
    });
  }
};

namespace {

constexpr const char* kWho = "Zero1DataParallel";

// One flat parameter of every trainable parameter (the default), or one per FSDP unit (ZeroOptions::wrap).
std::vector<UnitPlan> zero_units(const torch::nn::Module& module, const std::optional<WrapPolicy>& wrap) {
  std::vector<UnitPlan> plans;
  if (wrap) {
    plans = plan_units(module, *wrap);
  } else {
    UnitPlan all;
    all.name = "all";
    for (const auto& p : module.named_parameters(/*recurse=*/true)) {
      if (!p.value().requires_grad()) continue;  // frozen: whole on every rank, never communicated (as DDP)
      all.param_names.push_back(p.key());
      all.params.push_back(p.value());
    }
    if (!all.params.empty()) plans.push_back(std::move(all));
  }
  if (plans.empty()) throw ConfigError(fmt::format("{}: the module has no trainable parameters", kWho));
  return plans;
}

}  // namespace

Zero1DataParallel::Zero1DataParallel(const ModuleRef& module, std::shared_ptr<World> world, ZeroOptions options)
    : Engine(module), shard_(std::make_shared<Zero1Shard>()) {
  auto& s = *shard_;
  s.module = module.module;
  s.world = std::move(world);
  s.options = options;
  const auto plans = zero_units(*s.module, options.wrap());
  std::vector<std::string> lines{fmt::format("wrap {}", options.wrap() ? options.wrap()->to_string() : "all")};
  for (const auto& plan : plans) {
    lines.push_back(fmt::format("unit {}: {}", plan.name, fmt::join(plan.param_names, ", ")));
  }
  s.buffers = BufferSync(set_up_replica(s.comm(), kWho, *s.module, lines), options.broadcast_buffers());
  const std::weak_ptr<Zero1Shard> weak = shard_;  // the hooks outlive the engine inside autograd's graph
  for (const auto& plan : plans) {
    s.owned.push_back(std::make_unique<FlatParam>(plan, s.world->rank(), s.world->size(), /*sharded=*/true,
                                                  MixedPrecision{}));
    s.flats.push_back(s.owned.back().get());
    FlatParam* flat = s.flats.back();
    flat->ensure_grad_buffer();
    for (size_t i = 0; i < flat->params().size(); ++i) {
      s.accumulators.push_back(on_gradient_accumulated(flat->params()[i], [weak, flat, i] {
        if (auto shard = weak.lock()) {
          flat->take_grad(i);
          shard->on_gradient(weak);
        }
      }));
    }
  }
  s.sample_memory();
}

Zero1DataParallel::~Zero1DataParallel() = default;

void Zero1DataParallel::begin_forward() {
  auto& s = *shard_;
  s.callback_queued = false;  // a backward that threw never ran its callback; this forward starts afresh
  s.regather_if_pending();
  if (torch::GradMode::is_enabled()) s.pending_update = false;
  s.buffers.before_forward(s.comm());
  if (torch::GradMode::is_enabled()) {
    for (auto* f : s.flats) f->ensure_grad_buffer();
  }
}

void Zero1DataParallel::end_forward() {
  auto& s = *shard_;
  const bool grad = torch::GradMode::is_enabled();
  // A forward without grad builds no graph: the coming backward keeps its own forward's decision (as DDP).
  if (grad) s.backward_sync = s.require_backward_sync;
  s.buffers.after_forward(grad && s.require_backward_sync);
  s.sample_memory();
}

void Zero1DataParallel::join_backward() {
  auto& s = *shard_;
  if (!s.backward_sync) {
    throw ConfigError(fmt::format("{} on rank {}: a step without data needs a synchronised forward (outside "
                                  "no_sync, with grad enabled)", kWho, s.world->rank()));
  }
  for (auto* f : s.flats) f->ensure_grad_buffer();  // zeros unless micro-steps accumulated into them
  s.backward_sync = false;
  s.reduce();
}

bool Zero1DataParallel::require_sync() const { return shard_->require_backward_sync; }
void Zero1DataParallel::set_require_sync(bool sync) { shard_->require_backward_sync = sync; }
std::vector<torch::Tensor> Zero1DataParallel::parameters() const {
  std::vector<torch::Tensor> out;
  for (auto* f : shard_->flats) out.push_back(f->shard());
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> Zero1DataParallel::named_parameters() {
  return named_pieces(shard_->flats);
}

void Zero1DataParallel::set_global_item_count(int64_t items) { shard_->global_items = items; }

void Zero1DataParallel::zero_grad() {
  auto& s = *shard_;
  for (auto* f : s.flats) {
    f->clear_shard_grad();
    f->release_grad_buffer();
  }
  s.sample_memory();
}

double Zero1DataParallel::clip_grad_norm(double max_norm, double norm_type) {
  return gradsync::clip_grad_norm(parameters(), max_norm, norm_type, &shard_->comm());
}

void Zero1DataParallel::track_optimizer(const torch::optim::Optimizer* optimizer) {
  shard_->optimizer = optimizer;
  shard_->sample_memory();
}

StateDict Zero1DataParallel::state_dict(bool rank0_only) {
  auto& s = *shard_;
  s.regather_if_pending();
  return full_state_dict(s.comm(), s.comm(), *s.module, s.flats, s.buffers.buffers(), !rank0_only, /*gather=*/false);
}

StateDict Zero1DataParallel::full_gradients() {
  auto& s = *shard_;
  return full_gradient_dict(s.comm(), *s.module, s.flats);
}

c10::IValue Zero1DataParallel::full_optim_state_dict(const torch::optim::Optimizer& optimizer, bool rank0_only) {
  auto& s = *shard_;
  return sharded_optim_state_value(s.comm(), s.comm(), s.flats, optimizer, rank0_only);
}

void Zero1DataParallel::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state) {
  scatter_optim_states(shard_->flats, optimizer, optim_states_of(state));
}

void Zero1DataParallel::load_state_dict(const StateDict& state) {
  auto& s = *shard_;
  load_full_state_dict(s.comm(), kWho, *s.module, s.flats, state);
  s.regather();
  s.pending_update = false;
}

void Zero1DataParallel::sync_parameters() { shard_->regather_if_pending(); }

std::vector<UnitInfo> Zero1DataParallel::units() const {
  std::vector<UnitInfo> out;
  for (const auto* f : shard_->flats) {
    std::vector<std::string> names;
    for (const auto& e : f->entries()) names.push_back(e.name);
    out.push_back({f->name(), names, f->numel(), f->padded_numel(), f->shard_numel(), f->full_bytes()});
  }
  return out;
}

void Zero1DataParallel::save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer) {
  auto& s = *shard_;
  fail_together_on_throw(s.comm(), fmt::format("{}: save_sharded", kWho),
                         [&] {
                           require_optimizer_over_shards(fmt::format("{}: save_sharded", kWho), optimizer, s.flats);
                           save_shards(dir, "zero1", s.world->rank(), s.world->size(), s.slots(), optimizer);
                         });
}

void Zero1DataParallel::load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer) {
  auto& s = *shard_;
  fail_together_on_throw(s.comm(), fmt::format("{}: load_sharded", kWho),
                         [&] {
                           require_optimizer_over_shards(fmt::format("{}: load_sharded", kWho), optimizer, s.flats);
                           load_shards(dir, s.world->rank(), s.world->size(), s.slots(), optimizer);
                         });
  s.regather();
  s.pending_update = false;
}

MemoryStats Zero1DataParallel::memory() const {
  shard_->sample_memory();
  return shard_->meter.stats();
}

CommStats Zero1DataParallel::traffic() const { return shard_->traffic; }
torch::nn::Module& Zero1DataParallel::module() { return *shard_->module; }
Reduction Zero1DataParallel::reduction() const { return shard_->options.reduction(); }
Collectives* Zero1DataParallel::comm() { return &shard_->comm(); }

}  // namespace gradsync
