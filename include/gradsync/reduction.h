// defines: Reduction, the declared semantics of every cross-rank gradient reduction in gradsync.
#pragma once
#include <string>

namespace gradsync {

// Note [Where the division happens]
// A Mean reduction over N ranks is computed as "multiply each rank's tensor by 1/N, then SUM-allreduce":
//  - it is what PyTorch DDP does (the 1/N is folded into the copy of .grad into the flat bucket), so gradsync's
//    default is bit-for-bit the same arithmetic;
//  - dividing before the sum keeps magnitudes bounded (a SUM of N large gradients could overflow fp16);
//  - Gloo in libtorch 1.13 has no ReduceOp::AVG, so a post-divide would be an extra pass anyway.
// Sum skips the scaling. Neither divides by the number of accumulation micro-steps: that scaling belongs to the
// loss (see accumulate() in engine.h), because .grad sums over backward passes.
//
// GlobalMean is the gradient of the mean loss over every item (sample, token) that took part in the step, on
// every rank and in every micro-batch, whatever their counts. Each rank backpropagates SUMMED losses, so .grad
// holds the sum of its per-item gradients; one small allreduce of the item counts gives the step's total T
// before the last backward, and the 1/T is folded into the bucket copy exactly where Mean folds its 1/N. Mean
// equals GlobalMean only when every rank and micro-batch holds the same number of items.
enum class Reduction {
  Mean,        // (1/N) * sum over ranks: PyTorch DDP/FSDP semantics, the default
  Sum,         // sum over ranks, no division anywhere
  GlobalMean,  // (1/T) * sum over ranks of summed per-item gradients, T = items in the step over all ranks
};

const char* to_string(Reduction reduction);
// Parses "mean", "sum" or "global-mean"; throws ConfigError naming the value otherwise.
Reduction parse_reduction(const std::string& text);

}  // namespace gradsync
