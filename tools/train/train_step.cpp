// One training step against the engine interface, the replayed-ranks reference, and the gradient checks (see
// train_step.h).
#include "train/train_step.h"

#include <csignal>
#include <cstdlib>

#include <algorithm>

#include <sstream>

#include <fmt/format.h>

#include "gradsync/engine.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/state_dict.h"
#include "gradsync/verify.h"
#include "data/models.h"
#include "train/model_data.h"

namespace gradsync::cli {
namespace {

// --trace's tracer, or null (a local run has no engine).
Tracer* tracer_of(const StepContext& ctx) { return ctx.engine ? ctx.engine->tracer() : nullptr; }

// In --dtype whatever the engine computes in (FSDP's --param-dtype): the loss is computed in the model's dtype.
torch::Tensor forward(const StepContext& ctx, const torch::Tensor& indices) {
  auto inputs = [&] {
    TraceSpan span(tracer_of(ctx), "data", TraceEvent::Kind::Phase);
    return ctx.data.inputs.index_select(0, indices);
  }();
  auto output = ctx.engine ? ctx.engine->forward(inputs) : ctx.model.forward(inputs);
  const auto dtype = parse_dtype(ctx.config.dtype);
  return output.is_floating_point() && output.scalar_type() != dtype ? output.to(dtype) : output;
}

namespace F = torch::nn::functional;

torch::Tensor loss_of(const TrainConfig& c, const torch::Tensor& output, const torch::Tensor& target) {
  const bool mean = c.loss_reduction == "mean";
  if (target.dim() == 2 && target.scalar_type() == torch::kLong) return token_loss(output, target, mean);
  if (c.loss == "mse") {
    return mean ? F::mse_loss(output, target, F::MSELossFuncOptions(torch::kMean))
                : F::mse_loss(output, target, F::MSELossFuncOptions(torch::kSum));
  }
  return mean ? F::cross_entropy(output, target, F::CrossEntropyFuncOptions().reduction(torch::kMean))
              : F::cross_entropy(output, target, F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

int64_t count(const std::vector<torch::Tensor>& micro) {
  int64_t n = 0;
  for (const auto& m : micro) n += m.numel();
  return n;
}

// Token data: the valid tokens of the micro-batches (the progress line's rate); 0 otherwise.
int64_t tokens_in(const Dataset& data, const std::vector<torch::Tensor>& micro) {
  int64_t n = 0;
  if (!data.tokens()) return n;
  for (const auto& m : micro) n += m.numel() == 0 ? 0 : items_in(data, m);
  return n;
}

// Mean over ranks of the step loss, total samples and tokens, in float64 (one 24-byte allreduce per step).
RecordTotals reduce_record(const StepContext& ctx, const StepRecord& record) {
  if (!ctx.world || ctx.world->size() == 1) return {};
  return RecordTotals(ctx.world->comm(), record);
}

std::string encode(const std::vector<torch::Tensor>& micro) {
  std::string out;
  for (const auto& m : micro) {
    for (int64_t i = 0; i < m.numel(); ++i) out += std::to_string(m[i].item<int64_t>()) + ",";
    out += ";";
  }
  return out;
}

std::vector<torch::Tensor> decode(const std::string& text) {
  std::vector<torch::Tensor> out;
  std::istringstream batches(text);
  for (std::string batch; std::getline(batches, batch, ';');) {
    std::vector<int64_t> ids;
    std::istringstream items(batch);
    for (std::string id; std::getline(items, id, ',');) ids.push_back(std::stoll(id));
    out.push_back(torch::tensor(ids, torch::kLong));
  }
  return out;
}

// The weight of one micro-batch's (per-sample mean) loss in the step's gradient: Mean 1/(N*K'_r), Sum 1/K'_r. This is
// the single-process statement of each reduction; GlobalMean's is the summed item losses over the step's items.
double micro_weight(Reduction reduction, int ranks, size_t group) {
  const double k = static_cast<double>(group);
  return reduction == Reduction::Sum ? 1.0 / k : 1.0 / (static_cast<double>(ranks) * k);
}

int fault_step(const std::string& spec, const std::string& kind) {
  const auto at = spec.find('@');
  if (at == std::string::npos || spec.substr(0, at) != kind) return -1;
  return std::stoi(spec.substr(at + 1));
}

}  // namespace

RecordTotals::RecordTotals(Collectives& comm, const StepRecord& record)
    : totals_(torch::tensor({record.loss, static_cast<double>(record.samples), static_cast<double>(record.tokens)},
                            torch::kDouble)),
      ranks_(comm.size()) {
  TraceLabel label(comm.tracer(), "step loss");
  work_ = comm.allreduce_sum_async(totals_);
}

void RecordTotals::finish(StepRecord& record) {
  if (!work_.valid()) return;
  work_.wait();
  work_ = PendingWork();
  record.loss = totals_[0].item<double>() / ranks_;
  record.samples = static_cast<int64_t>(std::llround(totals_[1].item<double>()));
  record.tokens = static_cast<int64_t>(std::llround(totals_[2].item<double>()));
}

void inject_crash(const StepContext& ctx, int64_t step) {
  const int always = fault_step(ctx.config.inject_fault, "crash-always");
  const int first_attempt = fault_step(ctx.config.inject_fault, "crash");
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first = attempt == nullptr || std::string(attempt) == "0";
  const bool last_rank = !ctx.world || ctx.world->rank() == ctx.world->size() - 1;
  if (last_rank && (always == step || (first && first_attempt == step))) ::raise(SIGKILL);  // tests only
}

torch::Tensor token_loss(const torch::Tensor& output, const torch::Tensor& target, bool mean) {
  const auto logits = output.reshape({-1, output.size(-1)});
  const auto targets = target.reshape({-1});
  if (mean && !targets.ne(kIgnoreIndex).any().item<bool>()) {
    throw ConfigError(fmt::format(
        "a micro-batch of {} sequence(s) holds no valid token (every target is -100): its token mean is 0/0; use "
        "--loss-reduction sum, or --reduction global-mean, which divides by the step's valid tokens", target.size(0)));
  }
  auto options = F::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex);
  if (mean) {
    options.reduction(torch::kMean);
  } else {
    options.reduction(torch::kSum);
  }
  return F::cross_entropy(logits, targets, options);
}

int64_t items_in(const Dataset& data, const torch::Tensor& indices) {
  return data.tokens() ? data.targets.index_select(0, indices).ne(kIgnoreIndex).sum().item<int64_t>() : indices.numel();
}

std::vector<int64_t> step_sample_ids(const StepContext& ctx, const BatchSchedule& schedule, int64_t s) {
  const auto ids_of = [&](int rank) {
    std::string out;
    for (const auto& micro : schedule.step(rank, s)) {
      const auto ids = micro.contiguous();
      for (int64_t i = 0; i < ids.numel(); ++i) out += std::to_string(ids.data_ptr<int64_t>()[i]) + " ";
    }
    return out;
  };
  std::vector<std::string> ranks;
  if (ctx.world) {
    ranks = ctx.world->comm().allgather_strings(ids_of(ctx.world->rank()));
  } else {
    for (int r = 0; r < schedule.world_size(); ++r) ranks.push_back(ids_of(r));
  }
  std::vector<int64_t> all;
  for (const auto& text : ranks) {
    std::istringstream in(text);
    for (int64_t id = 0; in >> id;) all.push_back(id);
  }
  return all;
}

torch::Tensor micro_batch_loss(const StepContext& ctx, const torch::Tensor& indices) {
  auto output = forward(ctx, indices);
  TraceSpan span(tracer_of(ctx), "loss");
  return loss_of(ctx.config, output, ctx.data.targets.index_select(0, indices));
}

ItemLoss micro_batch_items(const StepContext& ctx, const torch::Tensor& indices) {
  if (!ctx.data.tokens()) {  // per-sample mean x sample count = summed per-sample loss
    return {micro_batch_loss(ctx, indices) * static_cast<double>(indices.numel()), indices.numel()};
  }
  auto output = forward(ctx, indices);
  TraceSpan span(tracer_of(ctx), "loss");
  return {token_loss(output, ctx.data.targets.index_select(0, indices), /*mean=*/false), items_in(ctx.data, indices)};
}

namespace {

// --sync-bn: SyncBatchNorm communicates in every forward and backward, so every rank runs the step's largest
// micro-batch count; a rank short of data adds empty micro-batches (zero rows) after its own.
std::vector<torch::Tensor> joined_micro_batches(const BatchSchedule& schedule, int64_t s, int rank) {
  auto micro = schedule.step(rank, s);
  size_t most = 0;
  for (int r = 0; r < schedule.world_size(); ++r) most = std::max(most, schedule.step(r, s).size());
  while (micro.size() < most) micro.push_back(torch::empty({0}, torch::kLong));
  return micro;
}

// An empty micro-batch's part in the step: its forward and backward join the ranks' SyncBatchNorm collectives with
// nothing, and its loss, times zero, adds nothing to any gradient.
torch::Tensor joining_loss(const StepContext& ctx, const torch::Tensor& empty) { return forward(ctx, empty).sum() * 0.0; }

// The engine's step: K' micro-batches of this rank (possibly none: it then joins with zeros), and after them, with
// --sync-bn, the empty ones that keep every rank's micro-step count equal (which must not change the 1/K' rule).
RecordTotals engine_step(const StepContext& ctx, const std::vector<torch::Tensor>& micro, StepRecord& record) {
  const auto group = static_cast<int64_t>(micro.size());
  const auto own = std::count_if(micro.begin(), micro.end(), [](const auto& m) { return m.numel() > 0; });
  RecordTotals totals;  // global-mean's totals are reduced before its last micro-step, the others' after backward
  if (ctx.reduction == Reduction::GlobalMean) {
    // The summed loss of the micro-batch's items (samples or valid tokens); the engine divides by the global count.
    auto result = accumulate_global_mean(*ctx.engine, group, [&](int64_t k) {
      const auto& idx = micro[static_cast<size_t>(k)];
      return idx.numel() == 0 ? ItemLoss{joining_loss(ctx, idx), 0} : micro_batch_items(ctx, idx);
    });
    record.loss = result.mean_loss;
    record.samples = result.total_items;
    record.tokens = ctx.data.tokens() ? result.total_items : 0;
  } else {
    // accumulate() divides each micro-batch loss by the group size: .grad sums (see engine.h).
    record.loss = accumulate(*ctx.engine, group, [&](int64_t k) {
      const auto& idx = micro[static_cast<size_t>(k)];
      if (idx.numel() == 0) return joining_loss(ctx, idx);
      auto loss = micro_batch_loss(ctx, idx);
      return own == group ? loss : loss * (static_cast<double>(group) / static_cast<double>(own));  // 1/K', not 1/K
    });
    record.samples = count(micro);
    record.tokens = tokens_in(ctx.data, micro);
    totals = reduce_record(ctx, record);
  }
  const int corrupt_at = fault_step(ctx.config.inject_fault, "grad");
  auto first = ctx.engine->parameters().front();  // a handle: .grad is the parameter's (or shard's) own
  if (corrupt_at == record.step && (!ctx.world || ctx.world->rank() == 0) && first.grad().defined()) {
    torch::NoGradGuard no_grad;
    first.mutable_grad().mul_(1.5);  // a deliberately wrong gradient (tests only)
  }
  return totals;
}

// One process, the micro-batches of every replayed rank -> .grad as the reduction defines it.
RecordTotals replay_step(const StepContext& ctx, const std::vector<std::vector<torch::Tensor>>& per_rank,
                         StepRecord& record) {
  if (ctx.reduction == Reduction::GlobalMean) {
    // The definition itself: the mean loss over the whole global batch, in one forward.
    std::vector<torch::Tensor> all;
    for (const auto& micro : per_rank) all.insert(all.end(), micro.begin(), micro.end());
    if (all.empty()) return {};
    auto loss = micro_batch_loss(ctx, torch::cat(all));
    loss.backward();
    record.loss = loss.item<double>();
    record.samples = items_in(ctx.data, torch::cat(all));
    record.tokens = ctx.data.tokens() ? record.samples : 0;
    return {};
  }
  const int ranks = static_cast<int>(per_rank.size());
  for (const auto& micro : per_rank) {
    for (const auto& idx : micro) {
      auto weighted = micro_batch_loss(ctx, idx) * micro_weight(ctx.reduction, ranks, micro.size());
      weighted.backward();
      record.loss += weighted.item<double>();
      record.samples += idx.numel();
      record.tokens += tokens_in(ctx.data, {idx});
    }
  }
  return {};
}

// --verify-every with --sync-bn: micro-step k's BatchNorm statistics span every rank's k-th micro-batch, so the
// reference forwards them together (plain BatchNorm on their union), then weighs each rank's rows as the reduction
// does. Rows of numbers only: --sync-bn is refused for the gpt models, which have no BatchNorm.
void sync_bn_reference_backward(const StepContext& local, const std::vector<std::vector<torch::Tensor>>& per_rank,
                                int64_t items) {
  size_t most = 0;
  for (const auto& m : per_rank) most = std::max(most, m.size());
  const int ranks = static_cast<int>(per_rank.size());
  for (size_t k = 0; k < most; ++k) {
    std::vector<torch::Tensor> parts;
    std::vector<double> weights;  // of each part's per-sample mean loss
    for (const auto& m : per_rank) {
      if (k >= m.size()) continue;
      parts.push_back(m[k]);
      weights.push_back(local.reduction == Reduction::GlobalMean
                            ? static_cast<double>(m[k].numel()) / static_cast<double>(items)
                            : micro_weight(local.reduction, ranks, m.size()));
    }
    const auto output = forward(local, torch::cat(parts));
    torch::Tensor loss;
    int64_t row = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      const auto n = parts[p].numel();
      auto part = loss_of(local.config, output.narrow(0, row, n), local.data.targets.index_select(0, parts[p]));
      loss = p == 0 ? part * weights[p] : loss + part * weights[p];
      row += n;
    }
    loss.backward();
  }
}

}  // namespace

StepFn choose_step(const TrainConfig& c, int rank) {
  const auto reduction = parse_reduction(c.reduction);
  const int replayed = std::max(c.replay_ranks, 1);
  if (c.strategy == Strategy::Local && (replayed > 1 || reduction == Reduction::GlobalMean)) {
    return [replayed](const StepContext& ctx, const BatchSchedule& schedule, int64_t s, StepRecord& record) {
      std::vector<std::vector<torch::Tensor>> all;
      for (int r = 0; r < replayed; ++r) all.push_back(schedule.step(r, s));
      return replay_step(ctx, all, record);
    };
  }
  if (c.sync_bn) {
    return [rank](const StepContext& ctx, const BatchSchedule& schedule, int64_t s, StepRecord& record) {
      return engine_step(ctx, joined_micro_batches(schedule, s, rank), record);
    };
  }
  return [rank](const StepContext& ctx, const BatchSchedule& schedule, int64_t s, StepRecord& record) {
    return engine_step(ctx, schedule.step(rank, s), record);
  };
}

void verify_gradient(const StepContext& ctx, const std::vector<torch::Tensor>& micro, int64_t step) {
  auto& comm = ctx.world->comm();
  auto everyone = comm.allgather_strings(encode(micro));
  // Collectives for the sharded engines: the pre-update parameters and the reduced gradient, whole.
  const auto parameters = ctx.engine->state_dict(/*rank0_only=*/true);
  const auto gradients = ctx.engine->full_gradients();
  if (comm.rank() != 0) return;
  std::vector<std::vector<torch::Tensor>> per_rank;
  // A fresh copy of the model at the pre-update parameters computes the gradient the reduction claims.
  auto reference = build_model(ctx.config);
  load_into(*reference, parameters);
  reference->train();
  StepContext local{ctx.config, ctx.data, reference, nullptr, nullptr, ctx.reduction};
  int64_t total = 0, items = 0;
  for (const auto& text : everyone) {
    per_rank.push_back(decode(text));
    total += count(per_rank.back());
    for (const auto& idx : per_rank.back()) items += items_in(ctx.data, idx);
  }
  if (ctx.config.sync_bn) {
    sync_bn_reference_backward(local, per_rank, items);
  } else {
    for (const auto& rank_micro : per_rank) {
      for (const auto& idx : rank_micro) {
        if (ctx.reduction == Reduction::GlobalMean) {  // summed item losses / the step's items (samples or tokens)
          (micro_batch_items(local, idx).summed_loss / static_cast<double>(items)).backward();
          continue;
        }
        (micro_batch_loss(local, idx) * micro_weight(ctx.reduction, comm.size(), rank_micro.size())).backward();
      }
    }
  }
  std::vector<std::string> names;
  std::vector<torch::Tensor> got, expected;
  const auto theirs = reference->named_parameters();
  for (const auto& [name, gradient] : gradients) {  // the trainable parameters
    const auto& param = theirs[name];
    names.push_back(name);
    got.push_back(gradient);
    expected.push_back(param.grad().defined() ? param.grad() : torch::zeros_like(param));
  }
  // float32 gradients summed in a different order: allow 1e-4 of each parameter's largest entry, plus 1e-6.
  auto check = compare_gradients(names, got, expected, 1e-4, 1e-6);
  fmt::print(stderr, "gradsync verify: step {}: synchronised gradient vs one-process recomputation on {} samples: "
             "max |diff| {:.3g} (largest entry {:.3g}, worst '{}'){}\n", step, total, check.max_abs_diff,
             check.max_abs_ref, check.worst, check.ok ? "" : " -- FAILED");
  if (!check.ok) {
    throw DistributedError(fmt::format(
        "gradient verification failed at step {} on rank 0: the synchronised gradient of '{}' differs from the "
        "one-process recomputation by {:.3g} (tolerance 1e-6 + 1e-4 x largest entry)", step, check.worst,
        check.max_abs_diff));
  }
}

void verify_replicas(const StepContext& ctx, int64_t step) {
  const int diverge_at = fault_step(ctx.config.inject_fault, "diverge");
  if (diverge_at == step && ctx.world->rank() == ctx.world->size() - 1) {
    torch::NoGradGuard no_grad;
    ctx.model->parameters().back().add_(1e-3);  // a deliberately divergent replica (tests only)
  }
  // Running statistics are per rank under DDP until the next forward's broadcast; with --sync-bn they are equal.
  check_replicas_identical(ctx.world->comm(), *ctx.model, /*buffers=*/ctx.config.sync_bn);
}

}  // namespace gradsync::cli
