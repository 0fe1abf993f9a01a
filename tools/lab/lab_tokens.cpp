// The lab's tokens experiment (TokensResult in lab.h): a language model on real text, where micro-batches and
// ranks hold different numbers of valid tokens, so that the mean of per-micro-batch token means is not the token
// mean. Every figure comes from `gradsync train` runs of this executable (the product, as a user runs it):
//   reference   --strategy local --replay-ranks N --reduction global-mean: one process, the mean over every valid
//               token of the step's sequences
//   (a)         --strategy ddp --reduction mean: each micro-batch's token mean / K, DDP's mean over ranks
//   predicted   --strategy local --replay-ranks N --reduction mean: one process weighting each micro-batch's own
//               token-mean gradient by 1/(N*K) -- what (a) should be, by its weights
//   (b)         --strategy ddp --reduction global-mean: summed token losses / the step's tokens over all ranks
// The gradient of one step is what SGD with lr 1 applied (initial - final parameters), in float64 so that no
// rounding blurs a comparison. The loss curves train the three runs longer with Adam, in float64 as well: in float32
// the ranks' sums in another order round differently, and over tens of Adam steps that alone moves a run visibly off
// the reference, which would hide what the plot is about.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "gradsync/error.h"
#include "gradsync/state_dict.h"
#include "lab/lab.h"
#include "launch/spawn.h"

namespace gradsync::cli {
namespace {

constexpr const char* kTokenModel = "gpt:256-64-64-2-4";
constexpr int64_t kTokenBatch = 32;  // sequences per optimizer step, over all ranks and micro-batches
const std::vector<std::pair<int, int64_t>> kShapes{{1, 4}, {2, 2}, {4, 1}};  // (N, K)

struct TokenRun {
  std::string name;
  std::vector<std::string> flags;
};

// One `gradsync train` run of the tokens experiment; throws with its output when it fails.
void train(const LabConfig& c, const std::string& dir, const TokenRun& run, const std::vector<std::string>& common) {
  std::vector<std::string> argv{"--model", kTokenModel, "--data", "fortunes", "--global-batch",
                                std::to_string(kTokenBatch), "--seed", std::to_string(c.seed), "--init-state",
                                dir + "/init.pt"};
  argv.insert(argv.end(), common.begin(), common.end());
  argv.insert(argv.end(), run.flags.begin(), run.flags.end());
  run_lab_train(c, argv, dir + "/" + run.name + ".out", "the tokens run '" + run.name + "'");
}

std::vector<TokenRun> runs_for(int n, int64_t k, const std::string& suffix) {
  const std::vector<std::string> shape{"--accumulate", std::to_string(k)};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.end(), shape.begin(), shape.end());
    return flags;
  };
  const std::string ranks = std::to_string(n);
  return {{"reference" + suffix, with({"--strategy", "local", "--replay-ranks", ranks, "--reduction", "global-mean"})},
          {"predicted" + suffix, with({"--strategy", "local", "--replay-ranks", ranks, "--reduction", "mean"})},
          {"mean_of_means" + suffix, with({"--strategy", "ddp", "--world-size", ranks, "--reduction", "mean"})},
          {"global_mean" + suffix, with({"--strategy", "ddp", "--world-size", ranks, "--reduction", "global-mean"})}};
}

// initial - final parameters, flattened: the gradient one SGD step with lr 1 applied.
torch::Tensor applied_gradient(const StateDict& initial, const std::string& final_state) {
  const auto after = load_state_dict(final_state);
  std::vector<torch::Tensor> flat;
  for (size_t i = 0; i < after.size(); ++i) {
    flat.push_back((initial[i].second.to(torch::kDouble) - after[i].second.to(torch::kDouble)).reshape({-1}));
  }
  return torch::cat(flat);
}

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

TokenRow measure(const LabConfig& c, const std::string& dir, int n, int64_t k) {
  const std::string suffix = fmt::format("-{}x{}", n, k);
  fmt::print(stderr, "[lab] tokens, N={} K={}: one SGD step (lr 1, float64) four ways\n", n, k);
  std::map<std::string, torch::Tensor> g;
  const auto initial = load_state_dict(dir + "/init.pt");
  for (const auto& run : runs_for(n, k, suffix)) {
    const std::string state = dir + "/" + run.name + ".pt";
    train(c, dir, run, {"--steps", "1", "--optimizer", "sgd", "--lr", "1", "--dtype", "fp64", "--save-state", state});
    g[run.name.substr(0, run.name.size() - suffix.size())] = applied_gradient(initial, state);
  }
  TokenRow row{n, k, rel(g["global_mean"], g["reference"]), rel(g["mean_of_means"], g["reference"]),
               rel(g["predicted"], g["reference"]), rel(g["mean_of_means"], g["predicted"]),
               rel(g["global_mean"], g["predicted"])};
  fmt::print(stderr, "[lab]   GlobalMean {:.1e} from one process; mean of token means {:.2e} (predicted {:.2e})\n",
             row.global_mean_rel_diff, row.mean_of_means_rel_diff, row.mean_of_means_predicted_rel_diff);
  return row;
}

std::vector<double> logged_losses(const std::string& log) {
  std::vector<double> out;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j.at("loss").get<double>());
  }
  return out;
}

// Longer training at (N, K) = (2, 2): the loss each run logs, and how far its final parameters are from the
// reference's.
TokenCurves curves(const LabConfig& c, const std::string& dir) {
  TokenCurves out{2, 2, c.quick ? 30 : 300, {}, {}, {}, 0, 0};
  fmt::print(stderr, "[lab] tokens, N=2 K=2: {} Adam steps, reference, mean of token means, GlobalMean\n", out.steps);
  std::map<std::string, std::string> states;
  for (const auto& run : runs_for(out.world_size, out.accumulate, "-curve")) {
    if (run.name.rfind("predicted", 0) == 0) continue;
    const std::string base = dir + "/" + run.name;
    train(c, dir, run, {"--steps", std::to_string(out.steps), "--optimizer", "adam", "--lr", "2e-3", "--dtype", "fp64",
                        "--log", base + ".jsonl", "--save-state", base + ".pt"});
    states[run.name] = base + ".pt";
  }
  out.reference = logged_losses(dir + "/reference-curve.jsonl");
  out.mean_of_means = logged_losses(dir + "/mean_of_means-curve.jsonl");
  out.global_mean = logged_losses(dir + "/global_mean-curve.jsonl");
  const auto initial = load_state_dict(dir + "/init.pt");
  const auto moved = applied_gradient(initial, states["reference-curve"]);  // the reference's total update
  out.mean_of_means_final_rel_diff = rel(applied_gradient(initial, states["mean_of_means-curve"]), moved);
  out.global_mean_final_rel_diff = rel(applied_gradient(initial, states["global_mean-curve"]), moved);
  return out;
}

}  // namespace

void run_lab_train(const LabConfig& c, const std::vector<std::string>& flags, const std::string& log,
                   const std::string& what) {
  std::vector<std::string> argv{self_executable(), "train", "--quiet", "--timeout",
                                fmt::format("{}", c.rank_timeout_seconds)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  const auto status = run_logged(argv, "", log, std::chrono::seconds(static_cast<int64_t>(c.rank_timeout_seconds) * 4),
                                 {{"OMP_NUM_THREADS", "1"}});
  if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    throw Error(fmt::format("lab: {} failed:\n{}", what, read_text(log)));
  }
}

TokensResult run_tokens(const LabConfig& c, const std::string& scratch) {
  const auto start = std::chrono::steady_clock::now();
  const std::string dir = scratch + "/tokens";
  std::filesystem::create_directories(dir);
  torch::manual_seed(c.seed);
  save_state_dict(state_dict(*make_model(kTokenModel)), dir + "/init.pt");
  TokensResult result;
  result.model = kTokenModel;
  result.global_batch = kTokenBatch;
  for (const auto& [n, k] : kShapes) result.rows.push_back(measure(c, dir, n, k));
  result.curves = curves(c, dir);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace gradsync::cli
