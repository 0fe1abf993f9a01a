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
// loss (see accumulate.h), because .grad sums over backward passes.
enum class Reduction {
  Mean,  // (1/N) * sum over ranks: PyTorch DDP/FSDP semantics, the default
  Sum,   // sum over ranks, no division anywhere
};

const char* to_string(Reduction reduction);
// Parses "mean" or "sum"; throws ConfigError naming the value otherwise.
Reduction parse_reduction(const std::string& text);

}  // namespace gradsync
