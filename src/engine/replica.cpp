// Replica set-up and the buffer rule shared by every engine (see replica.h).
#include "engine/replica.h"

#include <fmt/format.h>

#include "common/consistency.h"
#include "gradsync/error.h"

namespace gradsync {

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
  if (enabled_ && required_ && comm.size() > 1 && !buffers_.empty()) comm.broadcast_coalesced(buffers_, root_);
}

}  // namespace gradsync
