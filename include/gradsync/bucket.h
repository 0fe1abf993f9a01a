// defines: the flat-bucket layout shared by data-parallel strategies: which parameters share one buffer, at
// which offsets, in the order gradients become ready (the reverse of registration, as PyTorch DDP).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

struct BucketEntry {
  size_t param;    // index into the parameter list given to plan_buckets
  int64_t offset;  // first element in the bucket's flat buffer
  int64_t numel;
};

struct BucketPlan {
  c10::ScalarType dtype;
  int64_t numel = 0;
  std::vector<BucketEntry> entries;
};

// Walks the parameters from last to first (backward produces the last layers' gradients first) and closes a
// bucket once it holds at least its byte cap: the first bucket uses first_cap_bytes (small, so the first
// allreduce starts early), the others cap_bytes. Parameters of different dtypes never share a bucket.
std::vector<BucketPlan> plan_buckets(const std::vector<torch::Tensor>& params, size_t first_cap_bytes,
                                     size_t cap_bytes);

}  // namespace gradsync
