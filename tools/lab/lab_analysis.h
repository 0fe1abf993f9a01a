// declares: what lab_experiments.cpp and lab_analysis.cpp share (private to tools/lab/): the single-process
// gradients and verdict rules every comparison uses, and the measurements lab_analysis.cpp adds:
//   measure_divided             accumulation with .grad divided by K afterwards, on equal and unequal micro-batches
//   analyse_fsdp_accumulation   FSDP (FullShard) with K micro-batches per rank, both ShardedAccumulation modes
//   analyse_summed_loss         DDP (Reduction::Mean) when each rank's loss is the sum over its samples
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "lab/lab.h"

namespace gradsync::cli::lab_detail {

torch::Tensor mean_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y);
// Gradient of the per-sample mean loss over (x, y), starting from zero.
torch::Tensor mean_loss_gradient(Model& model, const torch::Tensor& x, const torch::Tensor& y);
// `first` when the measurement is within tolerance of it and not of the other; `second` symmetrically;
// otherwise `neither`.
std::string decide(double to_first, double to_second, double tol, const std::string& first,
                   const std::string& second, const std::string& neither);
// The mean-loss gradient of each consecutive block of `sizes` rows of (x, y) (each rank's shard, each micro-batch).
std::vector<torch::Tensor> shard_gradients(Model& model, const torch::Tensor& x,
                                           const torch::Tensor& y, const std::vector<int64_t>& sizes);
// The sum of the gradients, in float64.
torch::Tensor sum_of(const std::vector<torch::Tensor>& grads);

struct Verdict {
  std::string verdict;  // "mean", "sum" or "neither"
  std::string note;
};
// The DDP and FSDP rule: ranks must agree (`between` < tol), then mean vs sum; N = 1 cannot tell them apart.
Verdict mean_or_sum(int n, double to_mean, double to_sum, double between, double tol, const char* disagree_note);

// Rank r's tensor `key` from its rank<r>.pt.
using RankTensor = std::function<torch::Tensor(int rank, const std::string& key)>;

// Fills the divided-accumulation fields of `r`. (x, y): the K*b samples; raw: .grad after K backward passes of the
// equal micro-batches' mean losses; scaled: accumulate()'s gradient (loss/K); full: the mean gradient of all K*b.
void measure_divided(AccumulationResult& r, Model& model, const torch::Tensor& x,
                     const torch::Tensor& y, const torch::Tensor& raw, const torch::Tensor& scaled,
                     const torch::Tensor& full, double tol);
// (x, y): the even global batch the N ranks split; K micro-batches per rank ("even.fsdp_accum_*").
FsdpAccumulationResult analyse_fsdp_accumulation(Model& model, const torch::Tensor& x,
                                                 const torch::Tensor& y, int n, int64_t k, const RankTensor& tensor,
                                                 double tol);
// (x, y): the even global batch; the ranks' synced gradients of their summed losses ("even.ddp_summed_loss").
SummedLossResult analyse_summed_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y,
                                     int n, const RankTensor& tensor, double tol);

}  // namespace gradsync::cli::lab_detail
