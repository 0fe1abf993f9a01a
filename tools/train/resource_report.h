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

// What a run reports at its end (train.cpp fills it before saving, so the state-dict gathers are not counted).
struct ResourceReport {
  std::string strategy;
  MemoryStats memory;          // this rank's
  double sent_per_step = 0;    // this rank's, mean_sent_bytes()
  int64_t model_bytes = 0;     // Psi in bytes
  CommStats traffic;           // this rank's unit collectives since the engine was built
  int64_t steps = 0;           // steps this process ran
  int replicas = 0;            // hybrid sharding: R; 0 otherwise
};

// Rank 0 prints every rank's peak memory (parameters, gradients, optimizer state) and the bytes each rank sent per
// step against Psi; under hybrid sharding also each rank's bytes per step inside its shard group and across
// replicas, against the prediction for the latter. A collective (every rank calls it).
void print_resource_report(const ResourceReport& report, const std::shared_ptr<World>& world);

}  // namespace gradsync::cli
