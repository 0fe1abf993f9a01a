// From --strategy to an engine (see engine_factory.h).
#include "train/engine_factory.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/ddp.h"
#include "gradsync/comm_hook.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/local.h"
#include "gradsync/zero.h"
#include "train/flag.h"
#include "train/train.h"

namespace gradsync::cli {
namespace {

ShardingStrategy sharding_of(Strategy strategy) {
  switch (strategy) {
    case Strategy::FsdpFull: return ShardingStrategy::FullShard;
    case Strategy::FsdpGradOp: return ShardingStrategy::ShardGradOp;
    case Strategy::Hsdp: return ShardingStrategy::HybridShard;
    case Strategy::HsdpGradOp: return ShardingStrategy::HybridShardGradOp;
    default: return ShardingStrategy::NoShard;
  }
}

FsdpOptions fsdp_options(const TrainConfig& c) {
  FsdpOptions o;
  o.strategy(sharding_of(c.strategy));
  o.reduction(parse_reduction(c.reduction));
  if (!c.wrap.empty()) o.wrap(parse_flag("--wrap", c.wrap, parse_wrap_policy));
  if (!c.param_dtype.empty()) o.mixed_precision().param_dtype = parse_flag("--param-dtype", c.param_dtype, parse_dtype);
  if (!c.reduce_dtype.empty()) {
    o.mixed_precision().reduce_dtype = parse_flag("--reduce-dtype", c.reduce_dtype, parse_dtype);
  }
  o.accumulation(c.accumulate_grads == "sharded" ? ShardedAccumulation::ReduceEveryMicroStep
                                                   : ShardedAccumulation::UnshardedGradients);
  o.prefetch(!c.no_prefetch);
  o.replicas(c.replicas).shard_across_hosts(c.shard_across_hosts);
  return o;
}

ZeroOptions zero_options(const TrainConfig& c) {
  auto o = ZeroOptions().reduction(parse_reduction(c.reduction));
  if (!c.wrap.empty()) o.wrap(parse_flag("--wrap", c.wrap, parse_wrap_policy));
  return o;
}

void check_fsdp_only_flags(const TrainConfig& c) {
  auto fsdp_only = [&](bool given, const std::string& flag) {
    if (given && !is_fsdp(c.strategy)) {
      throw ConfigError(fmt::format("{} applies to --strategy fsdp-full, fsdp-grad-op, fsdp-no-shard, hsdp or "
                                    "hsdp-grad-op, not {}", flag, to_string(c.strategy)));
    }
  };
  if (!c.wrap.empty() && !is_sharded(c.strategy)) {
    throw ConfigError(fmt::format("--wrap applies to --strategy fsdp-full, fsdp-grad-op, fsdp-no-shard, hsdp, "
                                  "hsdp-grad-op or zero1, not {}", to_string(c.strategy)));
  }
  fsdp_only(!c.param_dtype.empty(), "--param-dtype");
  fsdp_only(!c.reduce_dtype.empty(), "--reduce-dtype");
  fsdp_only(c.accumulate_grads != "full", "--accumulate-grads");
  for (const auto& [given, flag] : {std::pair{c.replicas != 0, "--replicas"},
                                    std::pair{c.shard_across_hosts, "--shard-across-hosts"}}) {
    if (given && !is_hybrid(c.strategy)) {
      throw ConfigError(fmt::format("{} applies to --strategy hsdp or hsdp-grad-op, not {}", flag,
                                    to_string(c.strategy)));
    }
  }
}

// One of comm_hook_names() but "none" (checked by CLI11 and validate_sharding_flags).
CommHook comm_hook_of(const std::string& name) {
  if (name == "fp16") return hooks::fp16_compress();
  if (name == "bf16") return hooks::bf16_compress();
  return hooks::allreduce();
}

}  // namespace

const std::vector<std::string>& comm_hook_names() {
  static const std::vector<std::string> names{"none", "allreduce", "fp16", "bf16"};
  return names;
}

void validate_sharding_flags(const TrainConfig& c, int world_size) {
  check_fsdp_only_flags(c);
  if (c.replicas > 0 && world_size > 0 && world_size % c.replicas != 0) {
    throw ConfigError(fmt::format("--replicas {} does not divide the world size {}: hybrid sharding needs N = R x S "
                                  "(rank = replica x S + shard index)", c.replicas, world_size));
  }
  if (c.comm_hook != "none" && c.strategy != Strategy::Ddp) {
    throw ConfigError(fmt::format("--comm-hook {} applies to --strategy ddp only (a hook reduces DDP's buckets), "
                                  "not {}", c.comm_hook, to_string(c.strategy)));
  }
  if ((c.bucket_cap_mb || c.first_bucket_mb) && c.strategy != Strategy::Ddp) {
    throw ConfigError(fmt::format("--bucket-cap-mb and --first-bucket-mb size DDP's buckets: they apply to "
                                  "--strategy ddp only, not {}", to_string(c.strategy)));
  }
  const auto& hooks = comm_hook_names();
  if (std::find(hooks.begin(), hooks.end(), c.comm_hook) == hooks.end()) {
    throw ConfigError(fmt::format("--comm-hook {} is not known; expected one of {}", c.comm_hook,
                                  fmt::join(hooks, ", ")));
  }
  if (is_fsdp(c.strategy)) fsdp_options(c);  // every flag's value parses
  if (c.strategy == Strategy::Zero1) zero_options(c);
  if (c.accumulate_grads != "full" && c.accumulate_grads != "sharded") {
    throw ConfigError(fmt::format("--accumulate-grads {} is not known; expected full (no_sync: full gradients sum "
                                  "locally, one reduce-scatter per step) or sharded (reduce-scatter every micro-step)",
                                  c.accumulate_grads));
  }
  if (c.verify_every > 0 && (!c.param_dtype.empty() || !c.reduce_dtype.empty())) {
    throw ConfigError(fmt::format("--verify-every recomputes the gradient in the model's dtype, so it cannot check "
                                  "a run with --{} {}", c.param_dtype.empty() ? "reduce-dtype" : "param-dtype",
                                  c.param_dtype.empty() ? c.reduce_dtype : c.param_dtype));
  }
  if (parse_reduction(c.reduction) == Reduction::GlobalMean && c.accumulate_grads == "sharded") {
    throw ConfigError("--reduction global-mean divides by the step's sample count, known only before the last "
                      "micro-step; it cannot reduce every micro-step (--accumulate-grads sharded)");
  }
}

std::unique_ptr<Engine> make_engine(const TrainConfig& c, const Model& model,
                                    const std::shared_ptr<World>& world) {
  const auto reduction = parse_reduction(c.reduction);
  switch (c.strategy) {
    case Strategy::Local: return std::make_unique<LocalEngine>(model);
    case Strategy::Ddp: {
      // Bucket views: train zeroes through the engine (never Optimizer::zero_grad()), so .grad can be the bucket,
      // which saves a pass over the gradient and Psi of memory; the values are the same bit for bit.
      auto options = DdpOptions().reduction(reduction).gradient_as_bucket_view(true);
      if (c.bucket_cap_mb) options.bucket_cap_mb(*c.bucket_cap_mb);
      if (c.first_bucket_mb) options.first_bucket_bytes(static_cast<size_t>(*c.first_bucket_mb * 1024 * 1024));
      auto ddp = std::make_unique<DistributedDataParallel>(model, world, options);
      if (c.comm_hook != "none") ddp->register_comm_hook(comm_hook_of(c.comm_hook));
      return ddp;
    }
    case Strategy::Zero1: return std::make_unique<Zero1DataParallel>(model, world, zero_options(c));
    default: return std::make_unique<FullyShardedDataParallel>(model, world, fsdp_options(c));
  }
}

int replicas_of(const TrainConfig& c, const std::shared_ptr<World>& world) {
  if (!is_hybrid(c.strategy) || !world) return 0;
  return c.replicas > 0 ? c.replicas : world->size() / std::max(world->local_size(), 1);
}

std::string describe_engine(const TrainConfig& c, Engine& engine) {
  if (auto* fsdp = dynamic_cast<FullyShardedDataParallel*>(&engine)) {
    std::vector<std::string> names;
    for (const auto& u : fsdp->units()) names.push_back(u.name);
    return fmt::format("{}: {} unit(s) ({}), largest unit with its gradient {}", to_string(c.strategy), names.size(),
                       fmt::join(names, ", "), format_bytes(fsdp->largest_unit_bytes()));
  }
  if (auto* zero = dynamic_cast<Zero1DataParallel*>(&engine)) {
    std::vector<std::string> names;
    for (const auto& u : zero->units()) names.push_back(u.name);
    return fmt::format("zero1: optimizer state sharded over {} flat parameter(s) ({})", names.size(),
                       fmt::join(names, ", "));
  }
  return to_string(c.strategy);
}

}  // namespace gradsync::cli
