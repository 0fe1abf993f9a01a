// Bucket layouts (see bucket.h for the rules and why they are PyTorch's).
#include "ddp/bucket.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

namespace gradsync {

std::vector<BucketPlan> assign_buckets(const std::vector<torch::Tensor>& params, const std::vector<size_t>& order,
                                       const std::vector<size_t>& limits) {
  std::vector<BucketPlan> done;
  std::map<c10::ScalarType, BucketPlan> open;     // one open bucket per dtype
  std::map<c10::ScalarType, size_t> limit_index;  // which limit applies to that dtype's next bucket
  for (size_t i : order) {
    const auto& p = params[i];
    const auto dtype = p.scalar_type();
    auto& bucket = open[dtype];
    bucket.dtype = dtype;
    bucket.entries.push_back({i, bucket.numel, p.numel()});
    bucket.numel += p.numel();
    auto& li = limit_index[dtype];
    if (static_cast<size_t>(bucket.numel) * p.element_size() >= limits[li]) {
      done.push_back(std::move(bucket));
      open.erase(dtype);
      li = std::min(li + 1, limits.size() - 1);
    }
  }
  for (auto& entry : open) {
    if (!entry.second.entries.empty()) done.push_back(std::move(entry.second));
  }
  return done;
}

std::vector<BucketPlan> initial_bucket_layout(const std::vector<torch::Tensor>& params, bool find_unused_parameters,
                                              size_t first_cap_bytes, size_t cap_bytes) {
  std::vector<size_t> registration(params.size());
  std::iota(registration.begin(), registration.end(), size_t{0});
  // Without find_unused_parameters the first iteration uses one bucket: until the ready order is known, any
  // split could launch a bucket too early on one rank (PyTorch's reasoning, mirrored).
  const std::vector<size_t> limits = find_unused_parameters
                                         ? std::vector<size_t>{first_cap_bytes, cap_bytes}
                                         : std::vector<size_t>{std::numeric_limits<size_t>::max()};
  auto buckets = assign_buckets(params, registration, limits);
  auto smallest = [](const BucketPlan& b) {
    size_t m = std::numeric_limits<size_t>::max();
    for (const auto& e : b.entries) m = std::min(m, e.param);
    return m;
  };
  std::sort(buckets.begin(), buckets.end(),
            [&](const BucketPlan& a, const BucketPlan& b) { return smallest(a) < smallest(b); });
  std::reverse(buckets.begin(), buckets.end());
  return buckets;
}

std::vector<BucketPlan> rebuilt_bucket_layout(const std::vector<torch::Tensor>& params,
                                              const std::vector<size_t>& ready_order, size_t first_cap_bytes,
                                              size_t cap_bytes) {
  return assign_buckets(params, ready_order, {first_cap_bytes, cap_bytes});
}

}  // namespace gradsync
