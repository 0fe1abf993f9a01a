// The lab's measurements made in this process (see lab.h): loss vs batch size through `gradsync train`'s own
// loop, gradient accumulation, and the single-process references the DDP and FSDP ranks' gradients are compared
// with.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "gradsync/engine.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"
#include "lab/lab.h"
#include "lab/lab_analysis.h"
#include "data/models.h"
#include "train/train.h"

namespace gradsync::cli {
namespace lab_detail {

torch::Tensor mean_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(model.forward(x), y);
}

// Gradient of the per-sample mean loss over (x, y), starting from zero.
torch::Tensor mean_loss_gradient(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  model->zero_grad();
  mean_loss(model, x, y).backward();
  return flat_gradient(*model);
}

// A verdict between two hypotheses: `first` when the measurement is within tolerance of it and not of the
// other; `second` symmetrically; otherwise `neither` (both near, or both far: the numbers cannot tell).
std::string decide(double to_first, double to_second, double tol, const std::string& first,
                   const std::string& second, const std::string& neither) {
  if (to_first < tol && to_second > tol) return first;
  if (to_second < tol && to_first > tol) return second;
  return neither;
}

// The gradients of the per-sample mean loss of each rank's shard, in this one process.
std::vector<torch::Tensor> shard_gradients(Model& model, const torch::Tensor& x,
                                           const torch::Tensor& y, const std::vector<int64_t>& sizes) {
  std::vector<torch::Tensor> grads;
  int64_t offset = 0;
  for (int64_t size : sizes) {
    grads.push_back(mean_loss_gradient(model, x.narrow(0, offset, size), y.narrow(0, offset, size)));
    offset += size;
  }
  return grads;
}

torch::Tensor sum_of(const std::vector<torch::Tensor>& grads) {
  auto total = torch::zeros_like(grads.front(), torch::kDouble);
  for (const auto& g : grads) total += g.to(torch::kDouble);
  return total;
}

// The rule every DDP and FSDP row is judged by: every rank must hold the same gradient (`between` < tol); then
// the largest distance over the ranks to the mean (`to_mean`) and the smallest to the sum (`to_sum`) decide. One
// rank: the sum of one gradient is that gradient, so no measurement can tell sum from mean there.
Verdict mean_or_sum(int n, double to_mean, double to_sum, double between, double tol, const char* disagree_note) {
  if (n == 1) return {to_mean < tol ? "mean" : "neither", "N=1: sum = mean"};
  if (between >= tol) return {"neither", disagree_note};
  return {decide(to_mean, to_sum, tol, "mean", "sum", "neither"), ""};
}

}  // namespace lab_detail

using namespace lab_detail;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("lab: cannot read {}: a rank finished without writing its measurements", path));
  return nlohmann::json::parse(in);
}

torch::Tensor find_tensor(const StateDict& state, const std::string& key, const std::string& path) {
  for (const auto& [name, tensor] : state) {
    if (name == key) return tensor;
  }
  throw Error(fmt::format("lab: {} has no tensor '{}'", path, key));
}

}  // namespace

Model lab_model(const std::string& spec, const std::string& init_state) {
  auto model = make_model(spec);
  load_into(*model, load_state_dict(init_state));
  model->train();
  return model;
}

std::pair<torch::Tensor, torch::Tensor> read_batch(const std::string& batch_file, int64_t rows) {
  const auto state = load_state_dict(batch_file);
  auto x = find_tensor(state, "inputs", batch_file);
  auto y = find_tensor(state, "targets", batch_file);
  if (x.size(0) < rows) {
    throw Error(fmt::format("lab: {} holds {} samples; {} needed", batch_file, x.size(0), rows));
  }
  return {x.narrow(0, 0, rows), y.narrow(0, 0, rows)};
}

torch::Tensor flat_gradient(torch::nn::Module& model) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : model.parameters()) {
    parts.push_back(p.grad().defined() ? p.grad().detach().flatten() : torch::zeros({p.numel()}, p.options()));
  }
  return torch::cat(parts);
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

int64_t usable_batch(int64_t global, int world_size) { return global / world_size * world_size; }

std::vector<int64_t> even_split(int64_t global, int world_size) {
  return std::vector<int64_t>(static_cast<size_t>(world_size), global / world_size);
}

std::vector<int64_t> uneven_split(int64_t global, int world_size) {
  const int64_t parts = static_cast<int64_t>(world_size) * (world_size + 1) / 2;
  std::vector<int64_t> sizes;
  int64_t used = 0;
  for (int r = 0; r < world_size; ++r) {
    sizes.push_back(global * (r + 1) / parts);
    used += sizes.back();
  }
  sizes.back() += global - used;
  return sizes;
}

// ---- loss vs batch size ------------------------------------------------------------------------------------

LossResult run_loss_vs_batch(const LabConfig& lab) {
  LossResult result;
  result.steps = lab.loss_steps;
  result.lr = lab.lr;
  for (int64_t batch : lab.batch_sizes) {
    const auto start = Clock::now();
    TrainConfig c;
    c.model = lab.model;
    c.data = lab.data;
    c.global_batch = batch;
    c.strategy = Strategy::Local;
    c.lr = lab.lr;
    c.seed = lab.seed;
    c.steps = lab.loss_steps;
    fmt::print(stderr, "[lab] loss vs batch size: B = {}, {} SGD steps (lr {})\n", batch, lab.loss_steps, lab.lr);
    LossRun run;
    run.batch = batch;
    for (const auto& record : train_rank(c, nullptr)) run.losses.push_back(record.loss);
    // The same first batch (same seed, same sampler order) with the samples' losses added, not averaged.
    c.steps = 1;
    c.loss_reduction = "sum";
    c.quiet = true;
    run.step0_sum = train_rank(c, nullptr).at(0).loss;
    run.seconds = seconds_since(start);
    fmt::print(stderr, "[lab]   step-0 loss {:.4f} (sum {:.2f} = {:.2f} x), final {:.4f}  ({:.1f} s)\n",
               run.step0_mean(), run.step0_sum, run.sum_over_mean(), run.final_loss(), run.seconds);
    result.runs.push_back(std::move(run));
  }
  double lo = INFINITY, hi = -INFINITY, total = 0;
  for (const auto& run : result.runs) {
    lo = std::min(lo, run.step0_mean());
    hi = std::max(hi, run.step0_mean());
    total += run.step0_mean();
    const auto b = static_cast<double>(run.batch);
    result.ratio_error = std::max(result.ratio_error, std::abs(run.sum_over_mean() - b) / b);
  }
  result.step0_spread = result.runs.empty() ? 0 : (hi - lo) / (total / static_cast<double>(result.runs.size()));
  // A per-sample mean is the same size at every B (different samples: a few percent apart at most); a sum
  // is B times it.
  result.verdict = result.step0_spread < 0.05 && result.ratio_error < 0.01 ? "per-sample mean" : "inconclusive";
  return result;
}

// ---- gradient accumulation ---------------------------------------------------------------------------------

AccumulationResult run_accumulation(const LabConfig& lab, const std::string& init_state,
                                    const std::string& batch_file) {
  const auto start = Clock::now();
  AccumulationResult r;
  r.micro_batches = lab.accumulate;
  r.micro_batch = lab.micro_batch;
  const int64_t k = lab.accumulate, b = lab.micro_batch;
  fmt::print(stderr, "[lab] accumulation: K = {} micro-batches of {} vs one batch of {}\n", k, b, k * b);
  auto model = lab_model(lab.model, init_state);
  auto [x, y] = read_batch(batch_file, k * b);
  auto micro_loss = [&, &x = x, &y = y](int64_t i) {
    return mean_loss(model, x.narrow(0, i * b, b), y.narrow(0, i * b, b));
  };

  const auto full = mean_loss_gradient(model, x, y);
  // What most accumulation loops do: K backward passes of the micro-batch loss, nothing divided.
  model->zero_grad();
  for (int64_t i = 0; i < k; ++i) micro_loss(i).backward();
  const auto raw = flat_gradient(*model);
  // gradsync::accumulate(): each micro-batch loss divided by K before its backward.
  model->zero_grad();
  gradsync::accumulate(k, micro_loss);
  const auto scaled = flat_gradient(*model);

  r.full_norm = full.norm().item<double>();
  r.raw_norm = raw.norm().item<double>();
  r.raw_ratio = r.raw_norm / r.full_norm;
  r.raw_to_sum = max_abs_diff(raw, full * static_cast<double>(k));
  r.raw_to_mean = max_abs_diff(raw, full);
  r.scaled_to_mean = max_abs_diff(scaled, full);
  r.raw_verdict = decide(r.raw_to_sum, r.raw_to_mean, lab.tolerance, "sum", "mean", "neither");
  r.scaled_verdict = decide(r.scaled_to_mean, max_abs_diff(scaled, full * static_cast<double>(k)), lab.tolerance,
                            "mean", "sum", "neither");
  measure_divided(r, model, x, y, raw, scaled, full, lab.tolerance);
  r.seconds = seconds_since(start);
  fmt::print(stderr, "[lab]   raw |.grad| / |g| = {:.4f}; loss/K: max |diff| to g {:.1e}  ({:.1f} s)\n", r.raw_ratio,
             r.scaled_to_mean, r.seconds);
  fmt::print(stderr, "[lab]   .grad / K afterwards: max |diff| to loss/K {:.1e}, to g {:.1e}: {}\n",
             r.divided_to_scaled, r.divided_to_mean, r.divided_verdict);
  fmt::print(stderr, "[lab]   unequal micro-batches {}: .grad / K {:.1e} from g, {:.1e} from the mean of micro-batch "
             "means ({}); summed / {} {:.1e} from g\n", fmt::join(r.unequal_sizes, "+"), r.unequal_divided_to_mean,
             r.unequal_divided_to_micro_means, r.unequal_divided_verdict, k * b, r.unequal_global_to_mean);
  return r;
}

// ---- DDP: the ranks' gradients against one process ---------------------------------------------------------

namespace {

// The single-process side of one DDP comparison: the model and global batch the ranks started from, and the
// gradients this process computes from them.
struct Reference {
  Model model;
  torch::Tensor x, y;                 // the global batch
  torch::Tensor mean;                 // gradient of the mean loss over the whole global batch
  std::vector<torch::Tensor> shards;  // each rank's mean-loss gradient on the even split
  torch::Tensor sum;                  // the sum of `shards`: what a SUM allreduce without the 1/N would leave
};

Reference single_process_reference(const LabConfig& lab, int n, int64_t global_batch, const std::string& init_state,
                                   const std::string& batch_file) {
  Reference ref;
  ref.model = lab_model(lab.model, init_state);
  std::tie(ref.x, ref.y) = read_batch(batch_file, global_batch);
  ref.mean = mean_loss_gradient(ref.model, ref.x, ref.y);
  ref.shards = shard_gradients(ref.model, ref.x, ref.y, even_split(global_batch, n));
  ref.sum = sum_of(ref.shards);
  return ref;
}

// What the ranks of one run wrote into `dir`: rank r's gradients (states[r], rank<r>.pt) and measurements
// (rank<r>.json).
struct RankFiles {
  std::string dir;
  std::vector<StateDict> states;

  torch::Tensor tensor(int rank, const std::string& key) const {
    return find_tensor(states[static_cast<size_t>(rank)], key, lab_rank_tensors(dir, rank));
  }
  nlohmann::json meta(int rank) const { return read_json(lab_rank_json(dir, rank)); }
};

// The probe: the first element of the last parameter (the output layer's bias), shown rank by rank. Fills the
// probe fields of `d`; returns the element's index in the flat gradient.
int64_t choose_probe(DdpResult& d, const Reference& ref) {
  const auto named = ref.model->named_parameters();
  const auto last = named.pairs().back();
  const int64_t probe = ref.mean.numel() - last.second.numel();
  d.probe_name = fmt::format("{}[0]", last.first);
  d.probe_mean = ref.mean[probe].item<double>();
  d.probe_sum = ref.sum[probe].item<double>();
  return probe;
}

// Rank r's gradient on the even split before and after sync, against the references and rank 0.
RankGradients rank_gradients(const RankFiles& files, int r, const Reference& ref, int64_t probe) {
  const auto meta = files.meta(r);
  const auto local = files.tensor(r, "even.local");
  const auto synced = files.tensor(r, "even.synced");
  const auto synced0 = files.tensor(0, "even.synced");
  RankGradients g;
  g.rank = r;
  g.samples = meta.at("even_samples").get<int64_t>();
  g.local_to_shard = max_abs_diff(local, ref.shards[static_cast<size_t>(r)]);
  g.local_to_mean = max_abs_diff(local, ref.mean);
  g.local_norm = local.norm().item<double>();
  g.synced_to_mean = max_abs_diff(synced, ref.mean);
  g.synced_to_sum = max_abs_diff(synced, ref.sum);
  g.synced_to_rank0 = max_abs_diff(synced, synced0);
  g.local_probe = local[probe].item<double>();
  g.synced_probe = synced[probe].item<double>();
  return g;
}

void judge_ddp(DdpResult& d, double tol) {
  // Both conditions must hold on every rank: the largest distance to the hypothesis it matches, the smallest
  // to the one it must not match.
  d.to_sum = INFINITY;
  for (const auto& g : d.ranks) {
    d.to_mean = std::max(d.to_mean, g.synced_to_mean);
    d.to_sum = std::min(d.to_sum, g.synced_to_sum);
    d.between_ranks = std::max(d.between_ranks, g.synced_to_rank0);
  }
  auto v = mean_or_sum(d.world_size, d.to_mean, d.to_sum, d.between_ranks, tol, "ranks disagree after sync");
  d.verdict = std::move(v.verdict);
  d.note = std::move(v.note);
}

// FSDP (FullShard) on the same even shares, judged by the same rule.
void judge_fsdp(DdpResult& d, const RankFiles& files, const Reference& ref, double tol) {
  d.fsdp_to_sum = INFINITY;
  const auto fsdp0 = files.tensor(0, "even.fsdp_full");
  for (int r = 0; r < d.world_size; ++r) {
    const auto fsdp = files.tensor(r, "even.fsdp_full");
    d.fsdp_to_mean = std::max(d.fsdp_to_mean, max_abs_diff(fsdp, ref.mean));
    d.fsdp_to_sum = std::min(d.fsdp_to_sum, max_abs_diff(fsdp, ref.sum));
    d.fsdp_between_ranks = std::max(d.fsdp_between_ranks, max_abs_diff(fsdp, fsdp0));
  }
  auto v = mean_or_sum(d.world_size, d.fsdp_to_mean, d.fsdp_to_sum, d.fsdp_between_ranks, tol,
                       "ranks disagree after the step");
  d.fsdp_verdict = std::move(v.verdict);
  d.fsdp_note = std::move(v.note);
}

// Reduction::Mean on shares proportional to rank+1: the mean of the per-rank means (`means`), not the mean
// over all samples (`mean`).
void judge_uneven_mean(UnevenResult& u, const RankFiles& files, const torch::Tensor& mean, const torch::Tensor& means,
                       double tol) {
  u.to_mean_of_means = 0;
  u.to_global_mean = INFINITY;
  for (int r = 0; r < u.world_size; ++r) {
    const auto synced = files.tensor(r, "uneven.synced");
    u.to_mean_of_means = std::max(u.to_mean_of_means, max_abs_diff(synced, means));
    u.to_global_mean = std::min(u.to_global_mean, max_abs_diff(synced, mean));
  }
  u.verdict = decide(u.to_mean_of_means, u.to_global_mean, tol, "mean of per-rank means", "sample mean", "neither");
}

// Reduction::GlobalMean on the same shares: the hypotheses swap places.
void judge_uneven_global_mean(UnevenResult& u, const RankFiles& files, const torch::Tensor& mean,
                              const torch::Tensor& means, int64_t global_batch, double tol) {
  u.global_to_mean_of_means = INFINITY;
  const auto global0 = files.tensor(0, "uneven.global_mean");
  bool counts_agree = true;
  for (int r = 0; r < u.world_size; ++r) {
    const auto synced = files.tensor(r, "uneven.global_mean");
    u.global_to_sample_mean = std::max(u.global_to_sample_mean, max_abs_diff(synced, mean));
    u.global_to_mean_of_means = std::min(u.global_to_mean_of_means, max_abs_diff(synced, means));
    u.global_between_ranks = std::max(u.global_between_ranks, max_abs_diff(synced, global0));
    const auto items = files.meta(r).at("uneven_global_mean_items").get<int64_t>();
    if (r == 0) u.global_items = items;
    counts_agree = counts_agree && items == u.global_items;
  }
  // Every rank must hold the same gradient and have divided by the whole global batch.
  u.global_verdict = counts_agree && u.global_items == global_batch && u.global_between_ranks < tol
                         ? decide(u.global_to_sample_mean, u.global_to_mean_of_means, tol, "sample mean",
                                  "mean of per-rank means", "neither")
                         : "neither";
}

void analyse_uneven(UnevenResult& u, int n, int64_t global_batch, const RankFiles& files, Reference& ref,
                    double tol) {
  u.world_size = n;
  u.samples = uneven_split(global_batch, n);
  const auto means = sum_of(shard_gradients(ref.model, ref.x, ref.y, u.samples)) / static_cast<double>(n);
  judge_uneven_mean(u, files, ref.mean, means, tol);
  judge_uneven_global_mean(u, files, ref.mean, means, global_batch, tol);
}

}  // namespace

DdpResult analyse_ddp(const LabConfig& lab, int n, const std::string& rank_dir, const std::string& init_state,
                      const std::string& batch_file, UnevenResult* uneven) {
  DdpResult d;
  d.world_size = n;
  d.global_batch = usable_batch(lab.ddp_batch, n);
  Reference ref = single_process_reference(lab, n, d.global_batch, init_state, batch_file);
  d.mean_max_abs = ref.mean.abs().max().item<double>();
  const int64_t probe = choose_probe(d, ref);
  RankFiles files{rank_dir, {}};
  for (int r = 0; r < n; ++r) {
    files.states.push_back(load_state_dict(lab_rank_tensors(rank_dir, r)));
    d.ranks.push_back(rank_gradients(files, r, ref, probe));
  }
  judge_ddp(d, lab.tolerance);
  judge_fsdp(d, files, ref, lab.tolerance);
  if (uneven && n >= 2) analyse_uneven(*uneven, n, d.global_batch, files, ref, lab.tolerance);
  const RankTensor tensor = [&files](int r, const std::string& key) { return files.tensor(r, key); };
  d.fsdp_accumulation = analyse_fsdp_accumulation(ref.model, ref.x, ref.y, n, lab.accumulate, tensor, lab.tolerance);
  d.summed_loss = analyse_summed_loss(ref.model, ref.x, ref.y, n, tensor, lab.tolerance);
  return d;
}

}  // namespace gradsync::cli
