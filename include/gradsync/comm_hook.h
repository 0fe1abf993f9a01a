// defines: DDP communication hooks (PyTorch's DistributedDataParallel.register_comm_hook): what happens to one
// bucket of gradients between "every gradient in it is ready" and "it holds the reduced gradient", and the three
// hooks PyTorch ships. A hook replaces DDP's default path, so it also owns the division:
//
//   default (no hook):  bucket = grad x (1/N)  while copying   -> SUM allreduce
//   hooks::allreduce(): bucket = grad          -> bucket / N   -> SUM allreduce           (PyTorch's allreduce_hook)
//   hooks::fp16_compress(): grad -> float16 -> / N -> SUM allreduce in float16 -> float32 (fp16_compress_hook)
//
//   gradsync::DistributedDataParallel ddp(model, world);
//   ddp.register_comm_hook(gradsync::hooks::fp16_compress());   // once, before the first backward
#pragma once
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync {

// One bucket as a hook sees it (PyTorch's GradBucket).
struct GradBucket {
  size_t index = 0;
  bool is_last = false;        // the last bucket of this backward
  torch::Tensor buffer;        // flat, this rank's gradients summed over its micro-batches, NOT divided
  double divisor = 1;          // what the engine's reduction divides by: N (Mean), 1 (Sum), the items T (GlobalMean)
  std::vector<std::string> parameter_names;  // in the bucket's order
};

// Starts the bucket's reduction; after the returned work's wait(), bucket.buffer must hold the reduced gradient
// (use PendingWork::then() for work that follows the collective). Runs inside backward, on the thread that
// computed the bucket's last gradient; buckets are handed over in index order on every rank.
using CommHook = std::function<PendingWork(Collectives& comm, GradBucket& bucket)>;

namespace hooks {
// bucket / divisor, then a SUM allreduce: DDP's default result (dividing instead of multiplying by 1/N, as
// PyTorch's allreduce_hook does).
CommHook allreduce();
// PyTorch's fp16_compress_hook: the bucket in float16, divided by the divisor in float16, SUM-allreduced in float16
// and copied back. Half the bytes; each value carries float16's rounding (relative 2^-11) of the input, the quotient
// and every partial sum, and values beyond 65504 overflow.
CommHook fp16_compress();
// PyTorch's bf16_compress_hook: the same in bfloat16 (range of float32, relative rounding 2^-8). Gloo has no
// bfloat16 sum: on gloo the bfloat16 values travel as float32 (no byte saving) and are summed exactly there, then
// rounded to bfloat16 once; on mpi they travel and are summed as bfloat16, like PyTorch's NCCL path.
CommHook bf16_compress();
}  // namespace hooks

}  // namespace gradsync
