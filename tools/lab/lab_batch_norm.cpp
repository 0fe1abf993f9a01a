// The lab's BatchNorm experiment (BatchNormResult in lab.h). Gradients are not all data parallelism combines: a
// BatchNorm normalises with its batch's statistics and keeps running ones. Two statements are decided here, each
// from one step of `gradsync train` (float64, no shuffling, so every rank's samples are known) on mlp-bn:
//   plain BatchNorm under DDP, equal ranks of 8: are the running statistics averaged over the ranks? The lab
//     predicts both "averaged" and "rank 0's own" from the ranks' batches and measures which one rank 0 saved
//     (under DDP each rank keeps its own until rank 0's are broadcast before the next forward).
//   --sync-bn on uneven ranks (--no-pad: 4+3 at N=2, 4+4+3+3 at N=4): are the ranks weighted by their counts? The
//     lab predicts the union's statistics (count-weighted) and the plain mean of the ranks' statistics.
// Each prediction is BatchNorm's update from its initial state (mean 0, variance 1, momentum 0.1) with the
// statistics of the first Linear's outputs, which the lab computes itself from the initial state.
#include <filesystem>

#include <fmt/format.h>

#include "gradsync/state_dict.h"
#include "lab/lab.h"

namespace gradsync::cli {
namespace {

constexpr const char* kBatchNormModel = "mlp-bn:784-32-10";
constexpr double kMomentum = 0.1;  // BatchNorm's default, which the model uses

struct Stats {
  torch::Tensor mean, unbiased_var;
};

// BatchNorm's running statistics after one update from (0, 1) with `s`, as one vector [mean, var].
torch::Tensor updated(const Stats& s) {
  return torch::cat({s.mean * kMomentum, 1 - kMomentum + s.unbiased_var * kMomentum});
}

double rel(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).norm().item<double>() / b.norm().item<double>(); }

// The first Linear's outputs for the samples a rank gets without shuffling: positions r, r + N, ... of the data.
std::vector<torch::Tensor> rank_activations(const StateDict& init, const torch::Tensor& inputs, int n) {
  torch::Tensor w, b;
  for (const auto& [name, t] : init) {
    if (name == "0.weight") w = t.to(torch::kDouble);
    if (name == "0.bias") b = t.to(torch::kDouble);
  }
  std::vector<torch::Tensor> out;
  for (int r = 0; r < n; ++r) {
    const auto x = inputs.to(torch::kDouble).slice(0, r, inputs.size(0), n);
    out.push_back(torch::addmm(b, x, w.t()));
  }
  return out;
}

Stats of(const torch::Tensor& h) { return {h.mean(0), h.var(0, /*unbiased=*/true)}; }

// The plain mean over ranks of their own statistics.
Stats averaged(const std::vector<torch::Tensor>& per_rank) {
  Stats s{torch::zeros_like(per_rank[0][0]), torch::zeros_like(per_rank[0][0])};
  for (const auto& h : per_rank) {
    s.mean = s.mean + h.mean(0) / static_cast<double>(per_rank.size());
    s.unbiased_var = s.unbiased_var + h.var(0, true) / static_cast<double>(per_rank.size());
  }
  return s;
}

torch::Tensor saved_running_stats(const std::string& state) {
  torch::Tensor mean, var;
  for (const auto& [name, t] : load_state_dict(state)) {
    if (name == "1.running_mean") mean = t.to(torch::kDouble);
    if (name == "1.running_var") var = t.to(torch::kDouble);
  }
  return torch::cat({mean, var});
}

// One step on the first `rows` rows of `batch_file`, saved as DIR/NAME.pt; returns those rows' inputs.
torch::Tensor one_step(const LabConfig& c, const std::string& dir, const std::string& name, const std::string& batch_file,
                       int n, int64_t rows, int64_t global_batch, const std::vector<std::string>& extra) {
  const auto [inputs, targets] = read_batch(batch_file, rows);
  save_state_dict({{"inputs", inputs}, {"targets", targets}}, dir + "/" + name + "-data.pt");
  std::vector<std::string> flags{"--model", kBatchNormModel, "--data", dir + "/" + name + "-data.pt", "--init-state",
                                 dir + "/init.pt", "--world-size", std::to_string(n), "--global-batch",
                                 std::to_string(global_batch), "--steps", "1", "--no-shuffle", "--dtype", "fp64",
                                 "--lr", "1", "--save-state", dir + "/" + name + ".pt"};
  if (!c.backend.empty()) flags.insert(flags.end(), {"--backend", c.backend});
  flags.insert(flags.end(), extra.begin(), extra.end());
  run_lab_train(c, flags, dir + "/" + name + ".out", "the BatchNorm run '" + name + "'");
  return inputs;
}

std::vector<int64_t> counts(const std::vector<torch::Tensor>& per_rank) {
  std::vector<int64_t> out;
  for (const auto& h : per_rank) out.push_back(h.size(0));
  return out;
}

BatchNormRow measure(const LabConfig& c, const std::string& dir, const std::string& batch_file, int n) {
  fmt::print(stderr, "[lab] BatchNorm, N={}: plain under DDP on equal ranks, SyncBatchNorm on uneven ranks\n", n);
  const auto init = load_state_dict(dir + "/init.pt");
  BatchNormRow row;
  row.world_size = n;
  const auto equal_inputs = one_step(c, dir, fmt::format("ddp-{}", n), batch_file, n, 8 * n, 8 * n, {});
  const auto equal = rank_activations(init, equal_inputs, n);
  const auto ddp = saved_running_stats(fmt::format("{}/ddp-{}.pt", dir, n));
  row.equal_samples = counts(equal);
  row.ddp_to_averaged = rel(ddp, updated(averaged(equal)));
  row.ddp_to_rank0 = rel(ddp, updated(of(equal[0])));
  const int64_t rows = 4 * n - n / 2;  // ranks of 4 and 3 samples
  const auto uneven_inputs = one_step(c, dir, fmt::format("sync-{}", n), batch_file, n, rows, 4 * n,
                                      {"--sync-bn", "--no-pad", "--reduction", "global-mean"});
  const auto uneven = rank_activations(init, uneven_inputs, n);
  const auto sync = saved_running_stats(fmt::format("{}/sync-{}.pt", dir, n));
  row.uneven_samples = counts(uneven);
  row.sync_to_weighted = rel(sync, updated(of(torch::cat(uneven))));
  row.sync_to_plain_mean = rel(sync, updated(averaged(uneven)));
  fmt::print(stderr, "[lab]   DDP: {:.1e} from the averaged statistics, {:.1e} from rank 0's; SyncBatchNorm: {:.1e} "
             "from the count-weighted ones, {:.1e} from the plain mean\n", row.ddp_to_averaged, row.ddp_to_rank0,
             row.sync_to_weighted, row.sync_to_plain_mean);
  return row;
}

}  // namespace

BatchNormResult run_batch_norm(const LabConfig& c, const std::string& scratch, const std::string& batch_file) {
  const auto start = std::chrono::steady_clock::now();
  const std::string dir = scratch + "/batch_norm";
  std::filesystem::create_directories(dir);
  torch::manual_seed(c.seed);
  save_state_dict(state_dict(*make_model(kBatchNormModel)), dir + "/init.pt");
  BatchNormResult result;
  result.model = kBatchNormModel;
  for (int n : c.world_sizes) {
    if (n >= 2) result.rows.push_back(measure(c, dir, batch_file, n));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

nlohmann::ordered_json batch_norm_json(const BatchNormResult& b) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const auto& r : b.rows) {
    rows.push_back({{"world_size", r.world_size}, {"equal_samples", r.equal_samples},
                    {"uneven_samples", r.uneven_samples}, {"ddp_to_averaged", r.ddp_to_averaged},
                    {"ddp_to_rank0", r.ddp_to_rank0}, {"sync_to_weighted", r.sync_to_weighted},
                    {"sync_to_plain_mean", r.sync_to_plain_mean}});
  }
  return {{"model", b.model}, {"rows", rows}, {"seconds", b.seconds}};
}

}  // namespace gradsync::cli
