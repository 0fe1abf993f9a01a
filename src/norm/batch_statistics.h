// defines: the global batch statistics of a SyncBatchNorm: every rank's per-channel count, mean and biased
// variance, gathered once and combined weighted by count (docs/semantics.md, Note [SyncBatchNorm]).
#pragma once
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync::norm {

struct BatchStatistics {
  torch::Tensor mean;         // [C] float64: sum over ranks of n_r * mean_r, divided by n
  torch::Tensor var;          // [C] float64, biased: sum over ranks of n_r * (var_r + (mean_r - mean)^2), over n
  int64_t count = 0;          // n: values per channel over every rank of the group
  std::vector<int64_t> per_rank;  // n_r, in rank order (for messages)
};

// The per-channel values of `input` ([B, C, *]) counted over dimensions 0 and 2.. .
int64_t values_per_channel(const torch::Tensor& input);

// Collective over `group`: one all-gather of this rank's (n_r, mean_r, var_r), 2C + 1 float64 numbers. An empty
// input contributes n_r = 0 and still joins.
BatchStatistics gather_statistics(Collectives& group, const torch::Tensor& input);

}  // namespace gradsync::norm
