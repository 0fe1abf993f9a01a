// The lab's newer comparisons (see lab_analysis.h): gradient accumulation divided by K after the backward passes
// (in this process, on equal and on unequal micro-batches), FSDP with K micro-batches per rank in both
// accumulation modes, and DDP when every rank backpropagates the SUM of its samples' losses. The ranks' sides
// are in lab_rank.cpp; the single-process references are computed here, on exactly the rows the ranks used.
#include <algorithm>
#include <cmath>

#include "lab/lab_analysis.h"

namespace gradsync::cli::lab_detail {
namespace {

namespace F = torch::nn::functional;

torch::Tensor summed_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  return F::cross_entropy(model.forward(x), y, F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// .grad after one backward pass per consecutive block of `sizes` rows, nothing divided: of each block's
// per-sample mean loss, or with `summed` of its summed loss.
torch::Tensor accumulated(Model& model, const torch::Tensor& x, const torch::Tensor& y,
                          const std::vector<int64_t>& sizes, bool summed) {
  model->zero_grad();
  int64_t offset = 0;
  for (int64_t size : sizes) {
    const auto xs = x.narrow(0, offset, size), ys = y.narrow(0, offset, size);
    (summed ? summed_loss(model, xs, ys) : mean_loss(model, xs, ys)).backward();
    offset += size;
  }
  return flat_gradient(*model);
}

// Over the ranks: the largest distance of the tensor `key` to `mean`, the smallest to `sum`; `between` grows to
// the largest distance to rank 0's.
void distances(const RankTensor& tensor, int n, const std::string& key, const torch::Tensor& mean,
               const torch::Tensor& sum, double& to_mean, double& to_sum, double& between) {
  to_mean = 0;
  to_sum = INFINITY;
  const auto first = tensor(0, key);
  for (int r = 0; r < n; ++r) {
    const auto applied = tensor(r, key);
    to_mean = std::max(to_mean, max_abs_diff(applied, mean));
    to_sum = std::min(to_sum, max_abs_diff(applied, sum));
    between = std::max(between, max_abs_diff(applied, first));
  }
}

}  // namespace

void measure_divided(AccumulationResult& r, Model& model, const torch::Tensor& x,
                     const torch::Tensor& y, const torch::Tensor& raw, const torch::Tensor& scaled,
                     const torch::Tensor& full, double tol) {
  const auto k = static_cast<double>(r.micro_batches);
  // DeepSpeed's order: K backward passes of the micro-batch mean losses, then .grad / K.
  const auto divided = raw / k;
  r.divided_to_scaled = max_abs_diff(divided, scaled);
  r.divided_to_mean = max_abs_diff(divided, full);
  r.divided_to_raw = max_abs_diff(divided, raw);  // the alternative: no division
  r.divided_verdict = r.divided_to_mean <= tol && r.raw_to_mean > tol ? "mean" : "neither";
  // The same K*b samples in K micro-batches of sizes proportional to 1..K: dividing by K afterwards averages the
  // micro-batch means, each micro-batch weighted 1/K whatever its size, which is not the mean over the samples.
  r.unequal_sizes = uneven_split(x.size(0), static_cast<int>(r.micro_batches));
  const auto unequal = accumulated(model, x, y, r.unequal_sizes, false) / k;
  const auto micro_means = sum_of(shard_gradients(model, x, y, r.unequal_sizes)) / k;
  r.unequal_divided_to_mean = max_abs_diff(unequal, full);
  r.unequal_divided_to_micro_means = max_abs_diff(unequal, micro_means);
  // GlobalMean's way: every micro-batch backpropagates its summed loss, .grad / (number of samples).
  const auto global = accumulated(model, x, y, r.unequal_sizes, true) / static_cast<double>(x.size(0));
  r.unequal_global_to_mean = max_abs_diff(global, full);
  const double to_means = r.unequal_divided_to_micro_means, to_mean = r.unequal_divided_to_mean;
  r.unequal_divided_verdict = to_means <= tol && tol < to_mean   ? "mean of micro-batch means"
                              : to_mean <= tol && tol < to_means ? "sample mean"
                                                                 : "neither";
}

FsdpAccumulationResult analyse_fsdp_accumulation(Model& model, const torch::Tensor& x,
                                                 const torch::Tensor& y, int n, int64_t k, const RankTensor& tensor,
                                                 double tol) {
  FsdpAccumulationResult a;
  a.micro_batches = k;
  const int64_t share = x.size(0) / n;
  a.micro_batch = share / k;
  // Each rank used the first K*b rows of its even share (lab_rank.cpp); the references use the same rows.
  const int64_t used = k * a.micro_batch;
  std::vector<torch::Tensor> xs, ys;
  for (int r = 0; r < n; ++r) {
    xs.push_back(x.narrow(0, r * share, used));
    ys.push_back(y.narrow(0, r * share, used));
  }
  const auto ux = torch::cat(xs), uy = torch::cat(ys);
  // Equal micro-batches on equal ranks: loss/K then 1/N is the mean over all used rows.
  const auto mean = mean_loss_gradient(model, ux, uy);
  const auto sum = sum_of(shard_gradients(model, ux, uy, std::vector<int64_t>(static_cast<size_t>(n), used)));
  distances(tensor, n, "even.fsdp_accum_full", mean, sum, a.full_to_mean, a.full_to_sum, a.between_ranks);
  distances(tensor, n, "even.fsdp_accum_sharded", mean, sum, a.sharded_to_mean, a.sharded_to_sum, a.between_ranks);
  const char* disagree = "ranks disagree after the step";
  const auto full = mean_or_sum(n, a.full_to_mean, a.full_to_sum, a.between_ranks, tol, disagree);
  const auto sharded = mean_or_sum(n, a.sharded_to_mean, a.sharded_to_sum, a.between_ranks, tol, disagree);
  a.verdict = full.verdict == sharded.verdict ? full.verdict : "neither";
  a.note = full.note.empty() ? sharded.note : full.note;
  return a;
}

SummedLossResult analyse_summed_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y,
                                     int n, const RankTensor& tensor, double tol) {
  model->zero_grad();
  summed_loss(model, x, y).backward();
  const auto summed = flat_gradient(*model).to(torch::kDouble);  // G: the summed loss of the whole global batch
  const auto over_n = summed / static_cast<double>(n);
  SummedLossResult s;
  s.max_abs = over_n.abs().max().item<double>();
  s.to_sum = INFINITY;
  for (int r = 0; r < n; ++r) {
    const auto synced = tensor(r, "even.ddp_summed_loss");
    s.to_sum_over_n = std::max(s.to_sum_over_n, max_abs_diff(synced, over_n));
    s.to_sum = std::min(s.to_sum, max_abs_diff(synced, summed));
  }
  // A summed gradient is B/N times a mean one, and so is its float32 rounding error: this row compares the
  // differences relative to the scale, max |diff| / max |G/N|, with the tolerance (the other rows: absolute).
  const double to_over_n = s.to_sum_over_n / s.max_abs, to_sum = s.to_sum / s.max_abs;
  if (n == 1) {
    s.verdict = to_over_n < tol ? "sum / N" : "neither";
    s.note = "N=1: sum / N = sum";
  } else {
    s.verdict = decide(to_over_n, to_sum, tol, "sum / N", "sum", "neither");
  }
  return s;
}

}  // namespace gradsync::cli::lab_detail
