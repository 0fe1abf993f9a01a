// defines: what every data-parallel engine does to become a replica of rank 0's model (set_up_replica), the buffer
// rule they all follow (BufferSync), and the factor their reductions scale gradients by (gradient_factor).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"
#include "gradsync/reduction.h"

namespace gradsync {

// Every rank must describe the same model (parameters and buffers: names, dtypes, shapes; plus `extra_lines`,
// e.g. a sharding plan), else DistributedError on every rank naming the first difference -- a mismatch found later
// would be a deadlock or garbage. Then rank 0's parameters (frozen ones too, as PyTorch DDP) and buffers overwrite
// every rank's. Returns the module's buffers.
std::vector<torch::Tensor> set_up_replica(Collectives& comm, const std::string& who, torch::nn::Module& module,
                                          const std::vector<std::string>& extra_lines = {});

// Rank 0's parameters (all of them, frozen ones too) and buffers overwrite every rank's: one coalesced broadcast.
void broadcast_from_rank0(Collectives& comm, torch::nn::Module& module);

// PyTorch DDP's buffer rule (broadcast_buffers): rank 0's buffers (BatchNorm statistics) overwrite every rank's
// before a forward that follows a synchronised one. A forward that will not synchronise (no_sync, no grad) or a
// continued accumulation step skips the next broadcast, so statistics stay per rank within an optimizer step.
class BufferSync {
 public:
  BufferSync() = default;
  BufferSync(std::vector<torch::Tensor> buffers, bool enabled) : buffers_(std::move(buffers)), enabled_(enabled) {}

  void before_forward(Collectives& comm);
  // The rank whose buffers are broadcast: 0, or under Join the highest rank still training (PyTorch's rule).
  void set_root(int root) { root_ = root; }
  void after_forward(bool synchronised) { required_ = synchronised; }
  void continue_accumulation() { required_ = false; }
  const std::vector<torch::Tensor>& buffers() const { return buffers_; }

 private:
  std::vector<torch::Tensor> buffers_;
  bool enabled_ = true;
  bool required_ = true;
  int root_ = 0;
};

// What each rank's gradient is multiplied by before the SUM (Note [Where the division happens]): 1/ranks for Mean,
// 1 for Sum, 1/T for GlobalMean with T = `items` (0 for a step without items).
double gradient_factor(Reduction reduction, int ranks, const std::optional<int64_t>& items);
// GlobalMean needs the step's item count before the synchronising backward: ConfigError naming `who` and `rank`
// when it is missing; nothing for the other reductions.
void require_item_count(const std::string& who, int rank, Reduction reduction, const std::optional<int64_t>& items);

}  // namespace gradsync
