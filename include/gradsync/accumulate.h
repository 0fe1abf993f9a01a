// defines: accumulate(), one optimizer step's worth of K micro-batches.
//
// Why the loss is scaled by 1/K: backward() *adds* into .grad. After K backward passes .grad holds the SUM of
// the K micro-batch gradients, K times the gradient of the mean loss. Dividing each micro-batch's (per-sample
// mean) loss by K turns that sum into the mean over the K micro-batches, which for equal micro-batches is the
// gradient of the mean loss over all K*b samples. DDP then averages over ranks (Reduction::Mean), so the step's
// gradient is the gradient of the mean loss over the whole global batch of N*K*b samples.
// Communication happens once, on the last micro-batch: the first K-1 run under no_sync().
//
// The 1/K rule gives the mean over the global batch only when every micro-batch and every rank holds the same
// number of items. accumulate_global_mean() gives it for any counts (Reduction::GlobalMean, see reduction.h).
#pragma once
#include <cmath>
#include <cstdint>

#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/ddp.h"
#include "gradsync/error.h"

namespace gradsync {

namespace detail {
inline void check_micro_batches(int64_t k, int64_t minimum) {
  if (k < minimum) {
    throw ConfigError(fmt::format("accumulate: {} micro-batches requested; expected at least {}", k, minimum));
  }
}

// A rank with no micro-batch in this step still takes part in its collectives, with zero gradients.
template <typename ModuleHolder>
void join_step(DistributedDataParallel<ModuleHolder>& ddp) {
  auto& reducer = ddp.reducer();
  reducer.before_forward();
  reducer.after_forward();
  reducer.join_backward();
}
}  // namespace detail

// Local training: micro_loss(k) returns micro-batch k's loss (a per-sample mean, with its graph). Returns the
// step's loss, sum over k of loss_k / K.
template <typename LossFn>
double accumulate(int64_t micro_batches, LossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches, 1);
  double total = 0;
  for (int64_t k = 0; k < micro_batches; ++k) {
    auto scaled = micro_loss(k) / static_cast<double>(micro_batches);
    scaled.backward();
    total += scaled.template item<double>();
  }
  return total;
}

// Data-parallel: micro-batches 0..K-2 accumulate locally under no_sync(); the last one synchronises the summed
// gradient. micro_loss(k) must run ddp.forward itself so the no_sync scope covers the forward pass too.
// micro_batches may be 0 on a rank that has no data left in this step (uneven inputs): it then contributes
// zeros, still counted in the 1/N of Reduction::Mean (as PyTorch's Join does).
template <typename ModuleHolder, typename LossFn>
double accumulate(DistributedDataParallel<ModuleHolder>& ddp, int64_t micro_batches, LossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches, 0);
  if (micro_batches == 0) {
    detail::join_step(ddp);
    return 0;
  }
  double total = 0;
  for (int64_t k = 0; k < micro_batches; ++k) {
    auto step = [&] {
      auto scaled = micro_loss(k) / static_cast<double>(micro_batches);
      scaled.backward();
      total += scaled.template item<double>();
    };
    if (k + 1 < micro_batches) {
      auto guard = ddp.no_sync();
      step();
    } else {
      step();
    }
  }
  return total;
}

// One micro-batch's contribution under Reduction::GlobalMean: the SUM of its per-item losses and how many items
// (samples, non-padding tokens, ...) it holds.
struct ItemLoss {
  torch::Tensor summed_loss;
  int64_t items = 0;
};

struct GlobalStepLoss {
  double mean_loss = 0;     // sum of all items' losses / total items, over all ranks
  int64_t total_items = 0;  // T: items in the step over all ranks and micro-batches
};

// Reduction::GlobalMean: every micro-batch backpropagates its summed loss (no scaling: .grad sums per-item
// gradients), micro-batches 0..K-2 under no_sync(). Before the last backward one allreduce of two numbers gives
// the step's total item count T (and loss sum), and the reducer folds 1/T into the bucket copy. The gradient is
// then exactly that of the mean loss over all T items, whatever the per-rank and per-micro-batch counts.
// micro_batches may be 0 on a rank without data in this step; it contributes zero items and zero gradients.
template <typename ModuleHolder, typename ItemLossFn>
GlobalStepLoss accumulate_global_mean(DistributedDataParallel<ModuleHolder>& ddp, int64_t micro_batches,
                                      ItemLossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches, 0);
  auto& reducer = ddp.reducer();
  if (reducer.options().reduction != Reduction::GlobalMean) {
    throw ConfigError("accumulate_global_mean needs a DistributedDataParallel built with Reduction::GlobalMean");
  }
  int64_t items = 0;
  double loss_sum = 0;
  auto totals = [&] {
    auto t = torch::tensor({static_cast<double>(items), loss_sum}, torch::kDouble);
    reducer.world().comm().allreduce(t, Reduction::Sum);
    GlobalStepLoss out;
    out.total_items = static_cast<int64_t>(std::llround(t[0].item<double>()));
    out.mean_loss = out.total_items > 0 ? t[1].item<double>() / static_cast<double>(out.total_items) : 0.0;
    reducer.set_global_item_count(out.total_items);
    return out;
  };
  if (micro_batches == 0) {
    reducer.before_forward();
    reducer.after_forward();
    auto out = totals();
    reducer.join_backward();
    return out;
  }
  for (int64_t k = 0; k + 1 < micro_batches; ++k) {
    auto guard = ddp.no_sync();
    ItemLoss part = micro_loss(k);
    items += part.items;
    loss_sum += part.summed_loss.template item<double>();
    part.summed_loss.backward();
  }
  ItemLoss last = micro_loss(micro_batches - 1);  // synchronised forward
  items += last.items;
  loss_sum += last.summed_loss.template item<double>();
  auto out = totals();
  last.summed_loss.backward();
  return out;
}

}  // namespace gradsync
