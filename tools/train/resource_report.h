// defines: the memory and traffic report `gradsync train` prints and logs for every strategy.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/runtime.h"
#include "gradsync/stats.h"

namespace gradsync::cli {

struct StepRecord;

// Bytes of a module's parameters (Psi in bytes).
int64_t parameter_bytes(const torch::nn::Module& module);
// Mean of the records' sent_bytes, leaving out the first step (first-step order checks, DDP's bucket rebuild)
// when there are others; 0 when nothing was measured.
double mean_sent_bytes(const std::vector<StepRecord>& records);

// Rank 0 prints every rank's peak memory (parameters, gradients, optimizer state) and the bytes each rank sent per
// step against Psi; a collective (every rank calls it).
void print_resource_report(const std::string& strategy, const MemoryStats& mine, double sent_per_step,
                           int64_t model_bytes, const std::shared_ptr<World>& world);

}  // namespace gradsync::cli
