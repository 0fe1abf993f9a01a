// Replica set-up and the buffer rule shared by every engine (see replica.h).
#include "engine/replica.h"

#include <fmt/format.h>

#include "common/consistency.h"
#include "gradsync/error.h"

namespace gradsync {

double gradient_factor(Reduction reduction, int ranks, const std::optional<int64_t>& items) {
  switch (reduction) {
    case Reduction::Mean: return 1.0 / ranks;
    case Reduction::Sum: return 1.0;
    case Reduction::GlobalMean: return items && *items > 0 ? 1.0 / static_cast<double>(*items) : 0.0;
  }
  return 1.0;
}

void require_item_count(const std::string& who, int rank, Reduction reduction, const std::optional<int64_t>& items) {
  if (reduction != Reduction::GlobalMean || items) return;
  throw ConfigError(fmt::format("{} on rank {}: Reduction::GlobalMean needs the step's item count over all ranks "
                                "before the synchronising backward; use gradsync::accumulate_global_mean() or "
                                "set_global_item_count()", who, rank));
}

std::vector<torch::Tensor> set_up_replica(Collectives& comm, const std::string& who, torch::nn::Module& module,
                                          const std::vector<std::string>& extra_lines) {
  auto lines = describe_module(module);
  lines.insert(lines.end(), extra_lines.begin(), extra_lines.end());
  check_same_on_every_rank(comm, who, lines);
  broadcast_from_rank0(comm, module);
  return module.buffers();
}

void broadcast_from_rank0(Collectives& comm, torch::nn::Module& module) {
  std::vector<torch::Tensor> everything = module.parameters();
  const auto buffers = module.buffers();
  everything.insert(everything.end(), buffers.begin(), buffers.end());
  comm.broadcast_coalesced(everything, /*root=*/0);
}

void BufferSync::before_forward(Collectives& comm) {
  if (enabled_ && required_ && comm.size() > 1 && !buffers_.empty()) {
    TraceLabel label(comm.tracer(), "buffers");
    comm.broadcast_coalesced(buffers_, root_);
  }
}

}  // namespace gradsync
