// The memory and traffic report of `gradsync train` (see resource_report.h).
#include "train/resource_report.h"

#include <fmt/format.h>

#include "train/train.h"

namespace gradsync::cli {

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
