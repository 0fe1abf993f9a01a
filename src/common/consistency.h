// defines: the construction-time checks every data-parallel wrapper needs: that every rank has the same model
// (and the same sharding plan), failing on every rank with the first difference instead of deadlocking later.
#pragma once
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"

namespace gradsync {

// "parameter 0.weight float [16, 10]" and "buffer 1.running_mean float [16]", in state-dict order.
std::vector<std::string> describe_module(const torch::nn::Module& module);

// Every rank's lines must equal rank 0's; otherwise DistributedError on every rank naming, for each differing
// rank, the first line that differs. `who` starts the message ("FullyShardedDataParallel").
void check_same_on_every_rank(Collectives& comm, const std::string& who, const std::vector<std::string>& lines);

// Every rank reports `problem` ("" when fine); if any rank has one, every rank throws ConfigError listing them.
// Turns a failure on one rank (a missing checkpoint file) into a failure on all, instead of a hang.
void fail_together(Collectives& comm, const std::string& who, const std::string& problem);

// Runs fn() on this rank; what it throws becomes this rank's problem, then fail_together(): every rank throws
// the same ConfigError listing every rank's problem, or none does.
template <typename Fn>
void fail_together_on_throw(Collectives& comm, const std::string& who, Fn&& fn) {
  std::string problem;
  try {
    fn();
  } catch (const std::exception& e) {
    problem = *e.what() ? e.what() : "an error without a message";
  } catch (...) {
    problem = "an exception that is not a std::exception";
  }
  fail_together(comm, who, problem);
}

}  // namespace gradsync
