// The sharded strategies of `gradsync train` (see sharded_training.h).
#include "train/sharded_training.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/zero.h"
#include "train/train.h"
#include "train/train_step.h"

namespace gradsync::cli {
namespace {

ShardingStrategy fsdp_strategy(const std::string& name) {
  if (name == "fsdp-full") return ShardingStrategy::FullShard;
  if (name == "fsdp-grad-op") return ShardingStrategy::ShardGradOp;
  return ShardingStrategy::NoShard;
}

bool is_fsdp(const std::string& strategy) { return strategy.rfind("fsdp-", 0) == 0 && is_sharded_strategy(strategy); }

torch::Tensor as_float(const torch::Tensor& t) {
  return t.is_floating_point() && t.scalar_type() != torch::kFloat ? t.to(torch::kFloat) : t;
}

class FsdpTraining : public ShardedTraining {
 public:
  FsdpTraining(const TrainConfig& c, torch::nn::Sequential model, const std::shared_ptr<World>& world)
      : fsdp_(model, world, options(c)),
        mode_(c.accumulate_grads == "sharded" ? ShardedAccumulation::ReduceEveryMicroStep
                                              : ShardedAccumulation::UnshardedGradients),
        name_(c.strategy) {}

  torch::Tensor forward(const torch::Tensor& input) override { return as_float(fsdp_.forward(input)); }
  double accumulate(int64_t k, const std::function<torch::Tensor(int64_t)>& micro_loss) override {
    return gradsync::accumulate(fsdp_, k, micro_loss, mode_);
  }
  std::vector<torch::Tensor> parameters() override { return fsdp_.parameters(); }
  void track(const torch::optim::Optimizer& optimizer) override { fsdp_.track_optimizer(&optimizer); }
  void step(torch::optim::Optimizer& optimizer) override { optimizer.step(); }
  void zero_grad() override { fsdp_.zero_grad(); }
  StateDict full_state_dict() override { return fsdp_.full_state_dict(); }
  MemoryStats memory() override { return fsdp_.memory(); }
  std::string describe() override {
    std::vector<std::string> names;
    for (const auto& u : fsdp_.units()) names.push_back(u.name);
    return fmt::format("{}: {} unit(s) ({}), largest unit with its gradient {}", name_, names.size(),
                       fmt::join(names, ", "), format_bytes(fsdp_.largest_unit_bytes()));
  }

 private:
  static FsdpOptions options(const TrainConfig& c) {
    FsdpOptions o;
    o.strategy = fsdp_strategy(c.strategy);
    o.reduction = parse_reduction(c.reduction);
    if (!c.wrap.empty()) o.wrap = parse_wrap_policy(c.wrap);
    if (!c.param_dtype.empty()) o.mixed_precision.param_dtype = parse_dtype(c.param_dtype);
    if (!c.reduce_dtype.empty()) o.mixed_precision.reduce_dtype = parse_dtype(c.reduce_dtype);
    return o;
  }

  FullyShardedDataParallel fsdp_;
  ShardedAccumulation mode_;
  std::string name_;
};

class Zero1Training : public ShardedTraining {
 public:
  Zero1Training(const TrainConfig& c, torch::nn::Sequential model, const std::shared_ptr<World>& world)
      : zero_(std::move(model), world, ZeroOptions{parse_reduction(c.reduction), true}) {}

  torch::Tensor forward(const torch::Tensor& input) override { return zero_.forward(input); }
  double accumulate(int64_t k, const std::function<torch::Tensor(int64_t)>& micro_loss) override {
    return gradsync::accumulate(zero_, k, micro_loss);
  }
  std::vector<torch::Tensor> parameters() override { return zero_->parameters(); }
  void track(const torch::optim::Optimizer& optimizer) override { zero_->track_optimizer(&optimizer); }
  void step(torch::optim::Optimizer& optimizer) override { zero_->step(optimizer); }
  void zero_grad() override { zero_->zero_grad(); }
  StateDict full_state_dict() override { return zero_->full_state_dict(); }
  MemoryStats memory() override { return zero_->memory(); }
  std::string describe() override { return "zero1: optimizer state sharded over one flat parameter"; }

 private:
  Zero1DataParallel<torch::nn::Sequential> zero_;
};

}  // namespace

bool is_sharded_strategy(const std::string& s) {
  return s == "fsdp-full" || s == "fsdp-grad-op" || s == "fsdp-no-shard" || s == "zero1";
}

void validate_sharding_flags(const TrainConfig& c) {
  const bool fsdp = is_fsdp(c.strategy);
  auto fsdp_only = [&](bool given, const std::string& flag) {
    if (given && !fsdp) {
      throw ConfigError(fmt::format("{} applies to --strategy fsdp-full, fsdp-grad-op or fsdp-no-shard, not {}", flag,
                                    c.strategy));
    }
  };
  fsdp_only(!c.wrap.empty(), "--wrap");
  fsdp_only(!c.param_dtype.empty(), "--param-dtype");
  fsdp_only(!c.reduce_dtype.empty(), "--reduce-dtype");
  fsdp_only(c.accumulate_grads != "full", "--accumulate-grads");
  if (!c.wrap.empty()) parse_wrap_policy(c.wrap);
  if (!c.param_dtype.empty()) parse_dtype(c.param_dtype);
  if (!c.reduce_dtype.empty()) parse_dtype(c.reduce_dtype);
  if (c.accumulate_grads != "full" && c.accumulate_grads != "sharded") {
    throw ConfigError(fmt::format("--accumulate-grads {} is not known; expected full (no_sync: full gradients sum "
                                  "locally, one reduce-scatter per step) or sharded (reduce-scatter every micro-step)",
                                  c.accumulate_grads));
  }
  if (is_sharded_strategy(c.strategy)) {
    if (c.no_pad || c.verify_every > 0) {
      throw ConfigError(fmt::format("--strategy {} does not support {} (DDP only: uneven ranks need join, "
                                    "verification needs whole gradients)", c.strategy,
                                    c.no_pad ? "--no-pad" : "--verify-every"));
    }
    const auto reduction = parse_reduction(c.reduction);
    if (reduction != Reduction::Mean && reduction != Reduction::Sum) {
      throw ConfigError(fmt::format("--reduction {} is not supported by --strategy {}; expected mean or sum",
                                    c.reduction, c.strategy));
    }
  }
}

std::unique_ptr<ShardedTraining> make_sharded_training(const TrainConfig& c, torch::nn::Sequential model,
                                                       const std::shared_ptr<World>& world) {
  if (c.strategy == "zero1") return std::make_unique<Zero1Training>(c, std::move(model), world);
  return std::make_unique<FsdpTraining>(c, std::move(model), world);
}

void run_sharded_step(const StepContext& ctx, const std::vector<torch::Tensor>& micro, StepRecord& record) {
  // The same rule as DDP: accumulate() divides each micro-batch loss by the group size, .grad sums.
  record.loss = ctx.sharded->accumulate(static_cast<int64_t>(micro.size()), [&](int64_t k) {
    return micro_batch_loss(ctx, micro[static_cast<size_t>(k)]);
  });
  int64_t samples = 0;
  for (const auto& m : micro) samples += m.numel();
  record.samples = samples;
  if (ctx.world->size() > 1) {  // mean loss over ranks, total samples (one 16-byte allreduce)
    auto t = torch::tensor({record.loss, static_cast<double>(record.samples)}, torch::kDouble);
    ctx.world->comm().allreduce(t, Reduction::Sum);
    record.loss = t[0].item<double>() / ctx.world->size();
    record.samples = static_cast<int64_t>(std::llround(t[1].item<double>()));
  }
}

int64_t parameter_bytes(const torch::nn::Module& module) {
  int64_t bytes = 0;
  for (const auto& p : module.parameters()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

double mean_sent_bytes(const std::vector<StepRecord>& records) {
  const size_t first = records.size() > 1 ? 1 : 0;
  double sum = 0;
  size_t count = 0;
  for (size_t i = first; i < records.size(); ++i) {
    if (records[i].sent_bytes < 0) continue;
    sum += static_cast<double>(records[i].sent_bytes);
    ++count;
  }
  return count ? sum / static_cast<double>(count) : 0;
}

void print_resource_report(const std::string& strategy, const MemoryStats& mine, double sent_per_step,
                           int64_t model_bytes, const std::shared_ptr<World>& world) {
  const int n = world ? world->size() : 1;
  auto local = torch::tensor({mine.at_peak.params, mine.at_peak.grads, mine.at_peak.optimizer,
                              static_cast<int64_t>(sent_per_step)}, torch::kLong);
  auto all = local;
  if (world && n > 1) {
    all = torch::empty({4 * n}, torch::kLong);
    world->comm().allgather_flat(local, all);
  }
  if (world && !world->is_main()) return;
  const auto* v = all.data_ptr<int64_t>();
  fmt::print("gradsync train: {} memory per rank (peak of parameters + gradients + optimizer state held in tensors):\n",
             strategy);
  for (int r = 0; r < n; ++r) {
    const int64_t total = v[4 * r] + v[4 * r + 1] + v[4 * r + 2];
    fmt::print("  rank {}: {} = params {} + grads {} + optimizer {}  ({:.3f} x parameter bytes)\n", r,
               format_bytes(total), format_bytes(v[4 * r]), format_bytes(v[4 * r + 1]), format_bytes(v[4 * r + 2]),
               static_cast<double>(total) / static_cast<double>(model_bytes));
  }
  if (n > 1) {
    const double psi_ring = static_cast<double>(model_bytes) * (n - 1) / n;
    fmt::print("gradsync train: {} sent per step per rank {} = {:.2f} x Psi(N-1)/N (Psi = {} of parameters)\n",
               strategy, format_bytes(v[3]), static_cast<double>(v[3]) / psi_ring, format_bytes(model_bytes));
  }
}

}  // namespace gradsync::cli
