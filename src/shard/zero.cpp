// ZeRO stage 1 (see zero.h): the gradient is reduce-scattered at the end of backward, the updated slices are
// all-gathered before the next forward.
#include "gradsync/zero.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>

#include "common/clip_grad.h"
#include "common/consistency.h"
#include "engine/grad_hook.h"
#include "engine/replica.h"
#include "gradsync/error.h"
#include "shard/flat_param.h"
#include "shard/full_state.h"
#include "shard/sharded_checkpoint.h"

namespace gradsync {

class Zero1Shard {
 public:
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  ZeroOptions options;
  std::unique_ptr<FlatParam> flat;  // every parameter, sharded; the full buffer stays gathered
  BufferSync buffers;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // hooks live only while these do
  const torch::optim::Optimizer* optimizer = nullptr;
  mutable MemoryMeter meter;
  CommStats traffic;
  bool require_backward_sync = true;
  bool backward_sync = false;    // decided at forward time
  bool callback_queued = false;
  // A reduction has happened and the training forward that follows it has not re-gathered yet: the user's
  // optimizer.step() (which gradsync cannot see: libtorch optimizers update p.data(), bumping no version counter)
  // may have changed the slice. Gathers for state_dict(), sync_parameters() or a no-grad forward keep it set, so a
  // step taken after them still reaches the parameters.
  bool pending_update = false;

  Collectives& comm() { return world->comm(); }
  void sample_memory() const { meter.sample(count_memory({flat.get()}, optimizer)); }
  std::vector<ShardSlot> slots() const { return shard_slots({flat.get()}); }

  // The full parameters again from every rank's slice (collective: every rank's slice is stepped alike).
  void regather() { flat->refresh(comm(), traffic); }
  void regather_if_pending() {
    if (pending_update) regather();
  }
  // Reduce-scatters the local gradient into the slice's .grad (x 1/N for Mean, see reduction.h).
  void reduce() {
    sample_memory();  // full local gradient and the state of the previous step: the usual peak
    flat->reduce_grads(comm(), options.reduction(), traffic);
    pending_update = true;  // optimizer.step() comes next
    sample_memory();
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

}  // namespace

Zero1DataParallel::Zero1DataParallel(const ModuleRef& module, std::shared_ptr<World> world, ZeroOptions options)
    : Engine(module), shard_(std::make_shared<Zero1Shard>()) {
  auto& s = *shard_;
  s.module = module.module;
  s.world = std::move(world);
  s.options = options;
  require_mean_or_sum(kWho, options.reduction());
  s.buffers = BufferSync(set_up_replica(s.comm(), kWho, *s.module), options.broadcast_buffers());
  UnitPlan all;
  all.name = "all";
  for (const auto& p : s.module->named_parameters(/*recurse=*/true)) {
    all.param_names.push_back(p.key());
    all.params.push_back(p.value());
  }
  s.flat = std::make_unique<FlatParam>(all, s.world->rank(), s.world->size(), /*sharded=*/true, MixedPrecision{});
  s.flat->ensure_grad_buffer();
  const std::weak_ptr<Zero1Shard> weak = shard_;  // the hooks outlive the engine inside autograd's graph
  for (const auto& p : s.flat->params()) {
    s.accumulators.push_back(on_gradient_accumulated(p, [weak] {
      if (auto shard = weak.lock()) shard->on_gradient(weak);
    }));
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
  if (torch::GradMode::is_enabled()) s.flat->ensure_grad_buffer();
}

void Zero1DataParallel::end_forward() {
  auto& s = *shard_;
  s.backward_sync = torch::GradMode::is_enabled() && s.require_backward_sync;
  s.buffers.after_forward(s.backward_sync);
  s.sample_memory();
}

void Zero1DataParallel::join_backward() {
  auto& s = *shard_;
  if (!s.backward_sync) {
    throw ConfigError(fmt::format("{} on rank {}: a step without data needs a synchronised forward (outside "
                                  "no_sync, with grad enabled)", kWho, s.world->rank()));
  }
  s.flat->ensure_grad_buffer();  // zeros unless micro-steps accumulated into it
  s.backward_sync = false;
  s.reduce();
}

bool Zero1DataParallel::require_sync() const { return shard_->require_backward_sync; }
void Zero1DataParallel::set_require_sync(bool sync) { shard_->require_backward_sync = sync; }
std::vector<torch::Tensor> Zero1DataParallel::parameters() const { return {shard_->flat->shard()}; }

void Zero1DataParallel::zero_grad() {
  auto& s = *shard_;
  s.flat->shard().mutable_grad() = torch::Tensor();
  s.flat->release_grad_buffer();
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
  return full_state_dict(s.comm(), *s.module, {s.flat.get()}, s.buffers.buffers(), !rank0_only, /*gather=*/false);
}

void Zero1DataParallel::load_state_dict(const StateDict& state) {
  auto& s = *shard_;
  load_full_state_dict(s.comm(), kWho, *s.module, {s.flat.get()}, s.buffers.buffers(), state);
  s.regather();
  s.pending_update = false;
}

void Zero1DataParallel::sync_parameters() { shard_->regather_if_pending(); }

void Zero1DataParallel::save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer) {
  auto& s = *shard_;
  fail_together_on_throw(s.comm(), fmt::format("{}: save_sharded", kWho),
                         [&] { save_shards(dir, "zero1", s.world->rank(), s.world->size(), s.slots(), optimizer); });
}

void Zero1DataParallel::load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer) {
  auto& s = *shard_;
  fail_together_on_throw(s.comm(), fmt::format("{}: load_sharded", kWho),
                         [&] { load_shards(dir, s.world->rank(), s.world->size(), s.slots(), optimizer); });
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
