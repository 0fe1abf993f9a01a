// Bucket layout (see bucket.h).
#include "gradsync/bucket.h"

#include <map>

namespace gradsync {

std::vector<BucketPlan> plan_buckets(const std::vector<torch::Tensor>& params, size_t first_cap_bytes,
                                     size_t cap_bytes) {
  std::vector<BucketPlan> done;
  std::map<c10::ScalarType, BucketPlan> open;  // one open bucket per dtype
  auto cap = [&] { return done.empty() ? first_cap_bytes : cap_bytes; };
  for (size_t i = params.size(); i-- > 0;) {
    const auto& p = params[i];
    auto& bucket = open[p.scalar_type()];
    bucket.dtype = p.scalar_type();
    bucket.entries.push_back({i, bucket.numel, p.numel()});
    bucket.numel += p.numel();
    if (static_cast<size_t>(bucket.numel) * p.element_size() >= cap()) {
      done.push_back(std::move(bucket));
      open.erase(p.scalar_type());
    }
  }
  for (auto& [dtype, bucket] : open) {
    if (!bucket.entries.empty()) done.push_back(std::move(bucket));
  }
  return done;
}

}  // namespace gradsync
