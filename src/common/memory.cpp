// Memory accounting (MemoryStats and MemoryMeter in stats.h).
#include "gradsync/stats.h"

#include <algorithm>

#include <fmt/format.h>

#include "shard/optimizer_state.h"

namespace gradsync {

std::string format_bytes(int64_t bytes) {
  if (bytes >= (1 << 20)) return fmt::format("{:.2f} MiB", bytes / 1048576.0);
  if (bytes >= (1 << 10)) return fmt::format("{:.1f} KiB", bytes / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string MemoryStats::to_string() const {
  return fmt::format("peak {} (params {}, grads {}, optimizer {})", format_bytes(peak_total()),
                     format_bytes(at_peak.params), format_bytes(at_peak.grads), format_bytes(at_peak.optimizer));
}

void StorageBytes::add(const torch::Tensor& t) {
  if (!t.defined()) return;
  const auto* impl = t.storage().unsafeGetStorageImpl();
  if (!seen_.insert(impl).second) return;
  bytes_ += static_cast<int64_t>(t.storage().nbytes());
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  StorageBytes bytes;
  for (const auto& entry : optimizer.state()) {
    for (const auto& [name, tensor] : state_tensors(*entry.second)) bytes.add(tensor);
  }
  return bytes.bytes();
}

MemoryBreakdown module_memory(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer) {
  StorageBytes params, grads;
  for (const auto& p : module.parameters()) {
    params.add(p);
    grads.add(p.grad());
  }
  return {params.bytes(), grads.bytes(), optimizer ? optimizer_state_bytes(*optimizer) : 0};
}

void MemoryMeter::sample(const MemoryBreakdown& now) {
  stats_.current = now;
  if (now.total() > stats_.at_peak.total()) stats_.at_peak = now;
  stats_.peak_params = std::max(stats_.peak_params, now.params);
  stats_.peak_grads = std::max(stats_.peak_grads, now.grads);
  stats_.peak_optimizer = std::max(stats_.peak_optimizer, now.optimizer);
}

void MemoryMeter::reset_peak() {
  auto current = stats_.current;
  stats_ = MemoryStats{};
  sample(current);
}

}  // namespace gradsync
