// Gradient clipping across shards (see clip_grad.h).
#include "common/clip_grad.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {

double clip_grad_norm(const std::vector<torch::Tensor>& tensors, double max_norm, double norm_type,
                      Collectives* spread_over) {
  const bool infinity = std::isinf(norm_type);
  if (!infinity && !(norm_type >= 1)) {
    throw ConfigError(fmt::format("clip_grad_norm: norm type {} is not supported; expected p >= 1 or infinity",
                                  norm_type));
  }
  torch::NoGradGuard no_grad;
  // float64 partial sums: the shards' sums are added in a different order than one tensor's norm would add them,
  // so extra precision keeps the total within rounding of the unsharded value.
  double local = 0;
  for (const auto& t : tensors) {
    const auto& g = t.grad();
    if (!g.defined() || g.numel() == 0) continue;
    auto g64 = g.to(torch::kDouble).abs();
    local = infinity ? std::max(local, g64.max().item<double>()) : local + g64.pow(norm_type).sum().item<double>();
  }
  double total_power = local;
  if (spread_over && spread_over->size() > 1) {
    if (infinity) {
      auto mine = torch::tensor({local}, torch::kDouble);
      auto all = torch::empty({spread_over->size()}, torch::kDouble);
      spread_over->allgather_flat(mine, all);
      total_power = all.max().item<double>();
    } else {
      auto sum = torch::tensor({local}, torch::kDouble);
      spread_over->allreduce(sum, Reduction::Sum);
      total_power = sum.item<double>();
    }
  }
  const double total = infinity ? total_power : std::pow(total_power, 1.0 / norm_type);
  const double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1) {
    for (const auto& t : tensors) {
      if (t.grad().defined()) t.grad().mul_(coefficient);
    }
  }
  return total;
}

}  // namespace gradsync
