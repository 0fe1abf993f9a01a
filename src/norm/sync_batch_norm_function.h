// defines: normalise(), SyncBatchNorm's differentiable step: the input normalised with given global statistics, and
// a backward whose two per-channel gradient sums are reduced over the group (docs/semantics.md, Note
// [SyncBatchNorm]).
#pragma once
#include <cstdint>
#include <memory>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync::norm {

// y = (x - mean) * invstd * weight + bias, per channel (dimension 1). mean and invstd ([C]; float32 for a half or
// bfloat16 input, which is computed in float32 and returned in its own dtype, else the input's dtype) are the group's; count is the group's values per channel. Backward, for the input: sum_dy and sum_dy_xmu of every
// rank, one SUM allreduce of 2C numbers, divided by count; for weight and bias: this rank's own sums (the engine
// reduces parameters). Undefined weight and bias (no affine): 1 and 0.
torch::Tensor normalise(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                        const torch::Tensor& mean, const torch::Tensor& invstd, int64_t count,
                        std::shared_ptr<Collectives> group);

}  // namespace gradsync::norm
