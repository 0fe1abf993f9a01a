// defines: Collectives, the typed layer between gradsync and a c10d process group. Every reduction states its
// semantics (Reduction::Sum or Reduction::Mean) and every failure names the rank, the operation and its
// sequence number.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include "gradsync/reduction.h"

namespace gradsync {

// An operation in flight. wait() rethrows a transport failure as DistributedError naming rank and operation.
class PendingWork {
 public:
  PendingWork() = default;
  PendingWork(c10::intrusive_ptr<c10d::Work> work, std::string what);
  bool valid() const { return static_cast<bool>(work_); }
  void wait();

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;  // "rank 1 of 4: allreduce #12 (sum, 262144 x float)" for error messages
};

class Collectives {
 public:
  Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group, int rank, int size);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

  // In place. Mean multiplies by 1/N before a SUM allreduce (see Note [Where the division happens]).
  void allreduce(torch::Tensor& tensor, Reduction reduction);
  // SUM allreduce started now, finished by PendingWork::wait(); the caller has already applied any scaling.
  PendingWork allreduce_sum_async(torch::Tensor& tensor);
  void broadcast(torch::Tensor& tensor, int root);
  // Broadcasts a list of tensors from root, coalesced into one flat buffer per dtype.
  void broadcast_coalesced(const std::vector<torch::Tensor>& tensors, int root);
  // output[r*n : (r+1)*n] = input of rank r, where n = input.numel(). output.numel() must be size()*n.
  void allgather_flat(const torch::Tensor& input, torch::Tensor& output);
  // output (n elements) on rank r = reduction over ranks of input[r*n : (r+1)*n]; input.numel() = size()*n.
  // Gloo 1.13 has no reduce_scatter: alltoall_base then a local sum moves the same bytes per rank.
  void reduce_scatter(const torch::Tensor& input, torch::Tensor& output, Reduction reduction);
  // Every rank's string, in rank order (used for cross-rank consistency checks).
  std::vector<std::string> allgather_strings(const std::string& mine);
  void barrier();

 private:
  std::string describe(const char* op, const torch::Tensor* tensor, const char* detail = nullptr);
  void check_contiguous(const torch::Tensor& t, const char* op) const;
  void reject_global_mean(Reduction reduction, const char* op) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
  uint64_t sequence_ = 0;  // counts operations so an error can say which one failed
};

}  // namespace gradsync
