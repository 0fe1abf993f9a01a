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
  return o;
}

void check_fsdp_only_flags(const TrainConfig& c) {
  auto fsdp_only = [&](bool given, const std::string& flag) {
    if (given && !is_fsdp(c.strategy)) {
      throw ConfigError(fmt::format("{} applies to --strategy fsdp-full, fsdp-grad-op or fsdp-no-shard, not {}", flag,
                                    to_string(c.strategy)));
    }
  };
  fsdp_only(!c.wrap.empty(), "--wrap");
  fsdp_only(!c.param_dtype.empty(), "--param-dtype");
  fsdp_only(!c.reduce_dtype.empty(), "--reduce-dtype");
  fsdp_only(c.accumulate_grads != "full", "--accumulate-grads");
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

void validate_sharding_flags(const TrainConfig& c) {
  check_fsdp_only_flags(c);
  if (c.comm_hook != "none" && c.strategy != Strategy::Ddp) {
    throw ConfigError(fmt::format("--comm-hook {} applies to --strategy ddp only (a hook reduces DDP's buckets), "
                                  "not {}", c.comm_hook, to_string(c.strategy)));
  }
  const auto& hooks = comm_hook_names();
  if (std::find(hooks.begin(), hooks.end(), c.comm_hook) == hooks.end()) {
    throw ConfigError(fmt::format("--comm-hook {} is not known; expected one of {}", c.comm_hook,
                                  fmt::join(hooks, ", ")));
  }
  if (is_fsdp(c.strategy)) fsdp_options(c);  // every flag's value parses
  if (c.accumulate_grads != "full" && c.accumulate_grads != "sharded") {
    throw ConfigError(fmt::format("--accumulate-grads {} is not known; expected full (no_sync: full gradients sum "
                                  "locally, one reduce-scatter per step) or sharded (reduce-scatter every micro-step)",
                                  c.accumulate_grads));
  }
  if (!is_sharded(c.strategy)) return;
  if (c.no_pad || c.verify_every > 0) {
    throw ConfigError(fmt::format("--strategy {} does not support {} (DDP only: uneven ranks need join, "
                                  "verification needs whole gradients)", to_string(c.strategy),
                                  c.no_pad ? "--no-pad" : "--verify-every"));
  }
  const auto reduction = parse_reduction(c.reduction);
  if (reduction != Reduction::Mean && reduction != Reduction::Sum) {
    throw ConfigError(fmt::format("--reduction {} is not supported by --strategy {}; expected mean or sum",
                                  c.reduction, to_string(c.strategy)));
  }
}

std::unique_ptr<Engine> make_engine(const TrainConfig& c, torch::nn::Sequential model,
                                    const std::shared_ptr<World>& world) {
  const auto reduction = parse_reduction(c.reduction);
  switch (c.strategy) {
    case Strategy::Local: return std::make_unique<LocalEngine>(model);
    case Strategy::Ddp: {
      auto ddp = std::make_unique<DistributedDataParallel>(model, world, DdpOptions().reduction(reduction));
      if (c.comm_hook != "none") ddp->register_comm_hook(comm_hook_of(c.comm_hook));
      return ddp;
    }
    case Strategy::Zero1: return std::make_unique<Zero1DataParallel>(model, world, ZeroOptions().reduction(reduction));
    default: return std::make_unique<FullyShardedDataParallel>(model, world, fsdp_options(c));
  }
}

std::string describe_engine(const TrainConfig& c, Engine& engine) {
  if (auto* fsdp = dynamic_cast<FullyShardedDataParallel*>(&engine)) {
    std::vector<std::string> names;
    for (const auto& u : fsdp->units()) names.push_back(u.name);
    return fmt::format("{}: {} unit(s) ({}), largest unit with its gradient {}", to_string(c.strategy), names.size(),
                       fmt::join(names, ", "), format_bytes(fsdp->largest_unit_bytes()));
  }
  if (c.strategy == Strategy::Zero1) return "zero1: optimizer state sharded over one flat parameter";
  return to_string(c.strategy);
}

}  // namespace gradsync::cli
