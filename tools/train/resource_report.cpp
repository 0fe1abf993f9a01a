// The memory and traffic report of `gradsync train` (see resource_report.h).
#include "train/resource_report.h"

#include <algorithm>

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

namespace {

// Every rank's values, rank by rank (a collective when there are several ranks).
std::vector<int64_t> gather_per_rank(const std::vector<int64_t>& mine, const std::shared_ptr<World>& world) {
  auto local = torch::tensor(mine, torch::kLong);
  if (!world || world->size() == 1) return mine;
  auto all = torch::empty({static_cast<int64_t>(mine.size()) * world->size()}, torch::kLong);
  world->comm().allgather_flat(local, all);
  return {all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel()};
}

// Hybrid sharding: a replica group all-reduces each rank's shard, Psi/S, in a ring of R: 2 (Psi/S)(R-1)/R sent.
void print_traffic_split(const ResourceReport& r, const std::vector<int64_t>& v, int n) {
  const int s = n / r.replicas;
  const double psi = static_cast<double>(r.model_bytes);
  const double predicted = 2 * (psi / s) * (r.replicas - 1) / r.replicas;
  fmt::print("gradsync train: {} bytes per step per rank, {} replica(s) of {} rank(s) (mean of {} step(s); "
             "predicted across replicas 2 (Psi/S)(R-1)/R = {}):\n", r.strategy, r.replicas, s, r.steps,
             format_bytes(static_cast<int64_t>(predicted)));
  for (int rank = 0; rank < n; ++rank) {
    fmt::print("  rank {}: inside its shard group {}, across replicas {}\n", rank, format_bytes(v[6 * rank + 4]),
               format_bytes(v[6 * rank + 5]));
  }
}

}  // namespace

void print_resource_report(const ResourceReport& r, const std::shared_ptr<World>& world) {
  const int n = world ? world->size() : 1;
  const int64_t steps = std::max<int64_t>(r.steps, 1);
  const auto& m = r.memory.at_peak;
  const auto v = gather_per_rank({m.params, m.grads, m.optimizer, static_cast<int64_t>(r.sent_per_step),
                                  (r.traffic.total() - r.traffic.across_replicas) / steps,
                                  r.traffic.across_replicas / steps}, world);
  if (world && !world->is_main()) return;
  fmt::print("gradsync train: {} memory per rank (peak of parameters + gradients + optimizer state held in tensors):\n",
             r.strategy);
  for (int rank = 0; rank < n; ++rank) {
    const int64_t* p = &v[6 * rank];
    const int64_t total = p[0] + p[1] + p[2];
    fmt::print("  rank {}: {} = params {} + grads {} + optimizer {}  ({:.3f} x parameter bytes)\n", rank,
               format_bytes(total), format_bytes(p[0]), format_bytes(p[1]), format_bytes(p[2]),
               static_cast<double>(total) / static_cast<double>(r.model_bytes));
  }
  if (n > 1) {
    const double psi_ring = static_cast<double>(r.model_bytes) * (n - 1) / n;
    fmt::print("gradsync train: {} sent per step per rank {} = {:.2f} x Psi(N-1)/N (Psi = {} of parameters)\n",
               r.strategy, format_bytes(v[3]), static_cast<double>(v[3]) / psi_ring, format_bytes(r.model_bytes));
  }
  if (r.replicas > 0 && n > 1) print_traffic_split(r, v, n);
}

}  // namespace gradsync::cli
