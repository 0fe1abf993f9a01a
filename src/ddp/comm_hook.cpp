// The communication hooks PyTorch ships, on gradsync's collectives (see comm_hook.h).
#include "gradsync/comm_hook.h"

namespace gradsync::hooks {
namespace {

// Compress, divide in the compressed type (as PyTorch does), SUM-allreduce, decompress into the bucket.
// `wire` is the dtype the collective moves; it differs from `compressed` where the backend lacks a sum for it.
PendingWork compressed_allreduce(Collectives& comm, GradBucket& bucket, torch::ScalarType compressed,
                                 torch::ScalarType wire) {
  auto values = bucket.buffer.to(compressed).div_(bucket.divisor).to(wire);
  auto buffer = bucket.buffer;
  return comm.allreduce_sum_async(values).then([values, buffer, compressed]() mutable {
    buffer.copy_(values.to(compressed));
  });
}

}  // namespace

CommHook allreduce() {
  return [](Collectives& comm, GradBucket& bucket) {
    bucket.buffer.div_(bucket.divisor);
    return comm.allreduce_sum_async(bucket.buffer);
  };
}

CommHook fp16_compress() {
  return [](Collectives& comm, GradBucket& bucket) {
    return compressed_allreduce(comm, bucket, torch::kHalf, torch::kHalf);
  };
}

CommHook bf16_compress() {
  return [](Collectives& comm, GradBucket& bucket) {
    const auto wire = comm.backend() == Backend::Gloo ? torch::kFloat : torch::kBFloat16;
    return compressed_allreduce(comm, bucket, torch::kBFloat16, wire);
  };
}

}  // namespace gradsync::hooks
