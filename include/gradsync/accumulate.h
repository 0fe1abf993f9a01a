// defines: accumulate(), one optimizer step's worth of K micro-batches.
//
// Why the loss is scaled by 1/K: backward() *adds* into .grad. After K backward passes .grad holds the SUM of
// the K micro-batch gradients, K times the gradient of the mean loss. Dividing each micro-batch's (per-sample
// mean) loss by K turns that sum into the mean over the K micro-batches, which for equal micro-batches is the
// gradient of the mean loss over all K*b samples. DDP then averages over ranks (Reduction::Mean), so the step's
// gradient is the gradient of the mean loss over the whole global batch of N*K*b samples.
// Communication happens once, on the last micro-batch: the first K-1 run under no_sync().
#pragma once
#include <cstdint>

#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/ddp.h"
#include "gradsync/error.h"

namespace gradsync {

namespace detail {
inline void check_micro_batches(int64_t k) {
  if (k < 1) throw ConfigError(fmt::format("accumulate: {} micro-batches requested; expected at least 1", k));
}
}  // namespace detail

// Local training: micro_loss(k) returns micro-batch k's loss (a per-sample mean, with its graph). Returns the
// step's loss, sum over k of loss_k / K.
template <typename LossFn>
double accumulate(int64_t micro_batches, LossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches);
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
template <typename ModuleHolder, typename LossFn>
double accumulate(DistributedDataParallel<ModuleHolder>& ddp, int64_t micro_batches, LossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches);
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

}  // namespace gradsync
