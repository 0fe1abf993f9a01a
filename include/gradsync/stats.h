// defines: what an engine reports about its resources. Memory: the memory accounting of data-parallel training: MemoryStats (bytes held per rank by parameters,
// gradients and optimizer state, now and at the peak) and MemoryMeter, which samples them at the moments a
// strategy allocates or frees.
//
// What is counted: the storage bytes of the tensors that hold parameters (shards and gathered full parameters),
// gradients (.grad, shard gradients, unsharded gradient buffers) and optimizer state (every tensor of
// torch::optim SGD/Adam/AdamW/Adagrad/RMSprop state). A storage shared by two of them is counted once.
// Not counted: activations, communication scratch inside Collectives (the alltoall receive buffer of a
// reduce-scatter is one unit's size, transient), DDP's buckets (another Psi unless gradient_as_bucket_view).
//
// Traffic: CommStats, the bytes one rank sends per collective kind as the algorithms move them, and
// process_bytes_written(), the kernel's own count of what this process wrote (Gloo's TCP transport included),
// which measures the same thing from outside.
//
// Per-rank volume of a collective over N ranks on S bytes in total (ring algorithms; what Gloo 1.13 measured on
// loopback, see docs/sharding.md): all-gather and reduce-scatter (N-1)/N * S, allreduce 2(N-1)/N * S. For Psi
// parameters of b bytes: DDP's allreduce is 2(N-1)/N * b*Psi, the "2 Psi" of the ZeRO paper, whose figures drop
// the (N-1)/N.
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

// ---- traffic ----------------------------------------------------------------------------------------


struct CommStats {
  int64_t allgather = 0;       // bytes sent by this rank
  int64_t reduce_scatter = 0;
  int64_t allreduce = 0;
  int64_t across_replicas = 0;  // hybrid sharding: the shards' all-reduce between replicas (the rest: in a shard group)
  int64_t calls = 0;
  int64_t total() const { return allgather + reduce_scatter + allreduce + across_replicas; }

  void add_allgather(int64_t total_bytes, int world);
  void add_reduce_scatter(int64_t total_bytes, int world);
  void add_allreduce(int64_t bytes, int world);
  void add_replica_allreduce(int64_t bytes, int replicas);
  CommStats operator-(const CommStats& before) const;
};

// /proc/self/io "wchar": bytes this process has written with write()/writev() (sockets and files), -1 if unknown.
int64_t process_bytes_written();
// /proc/self/status "VmHWM": this process's peak resident memory in bytes (everything, not only tensors), -1 if
// unknown.
int64_t process_peak_resident_bytes();

}  // namespace gradsync
