// defines: the memory accounting of data-parallel training: MemoryStats (bytes held per rank by parameters,
// gradients and optimizer state, now and at the peak) and MemoryMeter, which samples them at the moments a
// strategy allocates or frees.
//
// What is counted: the storage bytes of the tensors that hold parameters (shards and gathered full parameters),
// gradients (.grad, shard gradients, unsharded gradient buffers) and optimizer state (every tensor of
// torch::optim SGD/Adam/AdamW/Adagrad/RMSprop state). A storage shared by two of them is counted once.
// Not counted: activations, communication scratch inside Collectives (the alltoall receive buffer of a
// reduce-scatter is one unit's size, transient), DDP's buckets (another Psi unless gradient_as_bucket_view).
#pragma once
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

struct MemoryBreakdown {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

struct MemoryStats {
  MemoryBreakdown current;
  MemoryBreakdown at_peak;  // the breakdown at the moment the total peaked
  int64_t peak_params = 0, peak_grads = 0, peak_optimizer = 0;  // each component's own maximum
  int64_t peak_total() const { return at_peak.total(); }
  // "peak 1.23 MB (params 0.50 MB, grads 0.25 MB, optimizer 0.48 MB)"
  std::string to_string() const;
};

// Adds storage bytes, counting each storage once.
class StorageBytes {
 public:
  void add(const torch::Tensor& t);
  int64_t bytes() const { return bytes_; }

 private:
  std::unordered_set<const void*> seen_;
  int64_t bytes_ = 0;
};

// Bytes of every state tensor the optimizer holds (0 for optimizer types it does not know).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

// Parameters + .grad of a plain module, and its optimizer's state: how DDP and local training are measured.
MemoryBreakdown module_memory(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer);

class MemoryMeter {
 public:
  void sample(const MemoryBreakdown& now);
  const MemoryStats& stats() const { return stats_; }
  void reset_peak();

 private:
  MemoryStats stats_;
};

std::string format_bytes(int64_t bytes);

}  // namespace gradsync
