// FullyShardedDataParallel: the engine interface over ShardedUnits (see fsdp.h for one unit's life).
#include "gradsync/fsdp.h"

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/clip_grad.h"
#include "common/consistency.h"
#include "gradsync/error.h"
#include "engine/replica.h"
#include "engine/full_optim_state.h"
#include "shard/full_state.h"
#include "shard/sharded_checkpoint.h"
#include "shard/sharded_units.h"

namespace gradsync {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::FullShard: return "full_shard";
    case ShardingStrategy::ShardGradOp: return "shard_grad_op";
    case ShardingStrategy::NoShard: return "no_shard";
    case ShardingStrategy::HybridShard: return "hybrid_shard";
    case ShardingStrategy::HybridShardGradOp: return "hybrid_shard_grad_op";
  }
  return "?";
}

bool is_hybrid(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::HybridShard || strategy == ShardingStrategy::HybridShardGradOp;
}

bool frees_after_use(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::FullShard || strategy == ShardingStrategy::HybridShard;
}

FullyShardedDataParallel::FullyShardedDataParallel(const ModuleRef& module, std::shared_ptr<World> world,
                                                   FsdpOptions options)
    : Engine(module), units_(std::make_shared<ShardedUnits>()) {
  auto& s = *units_;
  s.module = module.module;
  s.world = std::move(world);
  s.options = std::move(options);
  s.self = units_;
  if (s.options.reduction() == Reduction::GlobalMean &&
      s.options.accumulation() == ShardedAccumulation::ReduceEveryMicroStep) {
    throw ConfigError(fmt::format("{}: Reduction::GlobalMean divides by the step's item count, known only before the "
                                  "last micro-step; it needs ShardedAccumulation::UnshardedGradients", kFsdpName));
  }
  if (!is_hybrid(s.options.strategy()) && (s.options.replicas() != 0 || s.options.shard_across_hosts())) {
    throw ConfigError(fmt::format("{}: replicas ({}) and shard_across_hosts apply to the hybrid strategies "
                                  "(hybrid_shard, hybrid_shard_grad_op), not {}", kFsdpName, s.options.replicas(),
                                  to_string(s.options.strategy())));
  }
  s.build(kFsdpName);
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

torch::Tensor FullyShardedDataParallel::forward(const torch::Tensor& input) {
  if (const auto missing = units_->units_without_slot(); !missing.empty()) {
    throw ConfigError(fmt::format("{}: unit(s) {} are not elements of a torch::nn::Sequential, so forward(x) cannot "
                                  "run them; call forward_with(body) with unit(name, fn) around each, or choose units "
                                  "that are (--wrap type:NAME or list:NAME)", kFsdpName, fmt::join(missing, ", ")));
  }
  const auto& precision = units_->options.mixed_precision();
  const bool cast = precision.param_dtype && input.is_floating_point();
  return Engine::forward(cast ? input.to(*precision.param_dtype) : input);
}

torch::Tensor FullyShardedDataParallel::unit(const std::string& name, const std::function<torch::Tensor()>& fn) {
  auto& s = *units_;
  auto it = s.unit_index.find(name);
  if (it == s.unit_index.end() || s.is_root(it->second)) {
    std::vector<std::string> known;
    for (const auto& f : s.flats) known.push_back(f->name());
    throw ConfigError(fmt::format("{}: no unit named '{}'; units are {} (the root unit is implicit)", kFsdpName, name,
                                  fmt::join(known, ", ")));
  }
  return s.run_unit(it->second, fn);
}

bool FullyShardedDataParallel::require_sync() const { return units_->require_backward_sync; }
void FullyShardedDataParallel::set_require_sync(bool sync) { units_->require_backward_sync = sync; }
void FullyShardedDataParallel::begin_forward() { units_->begin_forward(); }
void FullyShardedDataParallel::end_forward() { units_->end_forward(); }
void FullyShardedDataParallel::abort_forward() { units_->abort_forward(); }
int64_t FullyShardedDataParallel::begin_step(int64_t micro_batches) {
  return units_->agree_micro_batches(micro_batches);
}
void FullyShardedDataParallel::join_forward() { units_->join_forward(); }
void FullyShardedDataParallel::join_backward() { units_->join_backward(); }
void FullyShardedDataParallel::set_global_item_count(int64_t items) {
  units_->global_items = items;  // used by a GlobalMean reduction only
}
void FullyShardedDataParallel::continue_accumulation() { units_->buffers.continue_accumulation(); }
void FullyShardedDataParallel::set_requires_all_reduce(bool all_reduce) { units_->requires_all_reduce = all_reduce; }

bool FullyShardedDataParallel::reduces_every_micro_step() const {
  return units_->options.accumulation() == ShardedAccumulation::ReduceEveryMicroStep;
}

std::vector<torch::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& f : units_->flats) out.push_back(f->shard());
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> FullyShardedDataParallel::named_parameters() {
  return named_pieces(units_->flat_views);
}

void FullyShardedDataParallel::zero_grad() {
  for (auto& f : units_->flats) {
    f->clear_shard_grad();
    f->release_grad_buffer();
    f->drop_pending();
  }
  units_->sample_memory();
}

void FullyShardedDataParallel::track_optimizer(const torch::optim::Optimizer* optimizer) {
  units_->optimizer = optimizer;
  units_->sample_memory();
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm, double norm_type) {
  auto& s = *units_;
  // Each shard counted once: over the shard group (the replicas hold the same shards).
  return gradsync::clip_grad_norm(parameters(), max_norm, norm_type, s.sharded() ? &s.group() : nullptr);
}

StateDict FullyShardedDataParallel::state_dict(bool rank0_only) {
  auto& s = *units_;
  return full_state_dict(s.comm(), s.group(), *s.module, s.flat_views, s.buffers.buffers(), !rank0_only,
                         /*gather=*/true);
}

StateDict FullyShardedDataParallel::full_gradients() {
  auto& s = *units_;
  return full_gradient_dict(s.group(), *s.module, s.flat_views);
}

c10::IValue FullyShardedDataParallel::full_optim_state_dict(const torch::optim::Optimizer& optimizer, bool rank0_only) {
  auto& s = *units_;
  return sharded_optim_state_value(s.comm(), s.group(), s.flat_views, optimizer, rank0_only);
}

void FullyShardedDataParallel::load_full_optim_state_dict(torch::optim::Optimizer& optimizer,
                                                          const c10::IValue& state) {
  scatter_optim_states(units_->flat_views, optimizer, optim_states_of(state));
}

void FullyShardedDataParallel::load_state_dict(const StateDict& state) {
  auto& s = *units_;
  load_full_state_dict(s.comm(), kFsdpName, *s.module, s.flat_views, state);
  s.sample_memory();
}

void FullyShardedDataParallel::save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer) {
  auto& s = *units_;
  fail_together_on_throw(s.comm(), fmt::format("{}: save_sharded", kFsdpName), [&] {
    require_optimizer_over_shards(fmt::format("{}: save_sharded", kFsdpName), optimizer, s.flat_views);
    save_shards(dir, fmt::format("fsdp:{}", to_string(s.options.strategy())), s.world->rank(), s.size(),
                shard_slots(s.flat_views), optimizer);
  });
}

void FullyShardedDataParallel::load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer) {
  auto& s = *units_;
  fail_together_on_throw(s.comm(), fmt::format("{}: load_sharded", kFsdpName),
                         [&] {
                           require_optimizer_over_shards(fmt::format("{}: load_sharded", kFsdpName), optimizer,
                                                         s.flat_views);
                           load_shards(dir, s.world->rank(), s.size(), shard_slots(s.flat_views), optimizer);
                         });
  s.free_all();  // the next forward gathers the loaded values
  s.sample_memory();
}

MemoryStats FullyShardedDataParallel::memory() const {
  units_->sample_memory();
  return units_->meter.stats();
}

void FullyShardedDataParallel::reset_peak_memory() { units_->meter.reset_peak(); }
CommStats FullyShardedDataParallel::traffic() const { return units_->traffic; }
torch::nn::Module& FullyShardedDataParallel::module() { return *units_->module; }
Reduction FullyShardedDataParallel::reduction() const { return units_->options.reduction(); }
Collectives* FullyShardedDataParallel::comm() { return &units_->comm(); }

std::vector<UnitInfo> FullyShardedDataParallel::units() const {
  std::vector<UnitInfo> out;
  for (size_t u = 0; u < units_->flats.size(); ++u) {
    const auto& f = *units_->flats[u];
    out.push_back({f.name(), units_->plans[u].param_names, f.numel(), f.padded_numel(), f.shard_numel(),
                   f.full_bytes()});
  }
  return out;
}

int64_t FullyShardedDataParallel::largest_unit_bytes() const {
  int64_t largest = 0;
  for (const auto& f : units_->flats) largest = std::max(largest, 2 * f->full_bytes());
  return largest;
}

const FsdpOptions& FullyShardedDataParallel::options() const { return units_->options; }

}  // namespace gradsync
