// defines: the flat-bucket layout of data-parallel gradient reduction: which parameters share one buffer, at
// which offsets, and in which order buckets are reduced. The rules are PyTorch DDP's, so that the same
// elements are summed in the same order by Gloo and results agree bit for bit:
//  - initial layout: parameters walked in registration order and grouped up to the size limits, buckets sorted
//    by their smallest parameter index, then the list reversed (backward reaches the last layers first). Without
//    find_unused_parameters the only limit is "unlimited": one bucket per dtype for the first iteration;
//  - after the first synchronised backward the layout is rebuilt once, in the order gradients actually became
//    ready, with limits [first bucket cap (1 MiB), bucket cap (25 MiB), ...].
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

struct BucketEntry {
  size_t param;    // index into the parameter list
  int64_t offset;  // first element in the bucket's flat buffer
  int64_t numel;
};

struct BucketPlan {
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t numel = 0;
  std::vector<BucketEntry> entries;  // in buffer order
};

// Groups params[order[0]], params[order[1]], ... into buckets: a bucket is closed once it holds at least the
// current limit in bytes, and each dtype then moves on to the next limit (the last one repeats). Parameters
// of different dtypes never share a bucket. Buckets are returned in the order they were closed, then the
// still-open ones.
std::vector<BucketPlan> assign_buckets(const std::vector<torch::Tensor>& params, const std::vector<size_t>& order,
                                       const std::vector<size_t>& limits);

// The layout before any backward has been observed (see the file comment).
std::vector<BucketPlan> initial_bucket_layout(const std::vector<torch::Tensor>& params, bool find_unused_parameters,
                                              size_t first_cap_bytes, size_t cap_bytes);

// The layout rebuilt from the order in which gradients became ready.
std::vector<BucketPlan> rebuilt_bucket_layout(const std::vector<torch::Tensor>& params,
                                              const std::vector<size_t>& ready_order, size_t first_cap_bytes,
                                              size_t cap_bytes);

}  // namespace gradsync
