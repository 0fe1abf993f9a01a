// defines: built-in checks that a synchronised gradient is what its reduction claims, and that every rank holds
// the same parameters. Both are opt-in (gradsync train --verify-every S); their cost is stated where they run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync {

struct GradientCheck {
  double max_abs_diff = 0;   // max over parameters of max |got - expected|
  double max_abs_ref = 0;    // max |expected| over all parameters (for scale)
  std::string worst;         // the parameter with the largest difference
  bool ok = true;            // every parameter within atol + rtol * max|expected of that parameter|
};

// Compares gradients element-wise, parameter by parameter (names in the same order as the tensors).
GradientCheck compare_gradients(const std::vector<std::string>& names, const std::vector<torch::Tensor>& got,
                                const std::vector<torch::Tensor>& expected, double rtol, double atol);

// A 64-bit FNV-1a digest of a tensor's bytes: equal digests mean bit-identical values (in practice).
uint64_t tensor_digest(const torch::Tensor& tensor);

// Every rank digests its parameters (and buffers, unless `buffers` is false); one allgather of the digests (16 bytes
// per tensor per rank) compares them with rank 0's. A difference throws DistributedError on every rank, naming the
// first divergent tensor and the ranks that differ from rank 0. Leave buffers out where ranks may rightly differ:
// under DDP each rank's BatchNorm running statistics are its own until rank 0's are broadcast before the next
// forward (with SyncBatchNorm they are the same on every rank).
void check_replicas_identical(Collectives& comm, const torch::nn::Module& module, bool buffers = true);

}  // namespace gradsync
