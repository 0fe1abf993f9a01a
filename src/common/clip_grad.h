// defines: clip_grad_norm() for gradients spread over ranks: the norm of the whole (unsharded) gradient, from each
// rank's partial sums, so that sharded training clips exactly when and by how much unsharded training would.
#pragma once
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync {

// Scales the .grad of `tensors` by max_norm / (total_norm + 1e-6) when that is < 1, where total_norm is the
// norm_type-norm (a finite p >= 1, or infinity) of all gradients together, as torch::nn::utils::clip_grad_norm_.
// `spread_over`: the gradients are disjoint pieces of one gradient spread over the ranks of this communicator
// (shards), so the per-rank sums of |g|^p are added (the max, for infinity) across ranks; nullptr when this rank
// holds the whole gradient. Returns total_norm, the same on every rank. Tensors without .grad are skipped.
double clip_grad_norm(const std::vector<torch::Tensor>& tensors, double max_norm, double norm_type,
                      Collectives* spread_over);

}  // namespace gradsync
