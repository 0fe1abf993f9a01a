// Parity with real PyTorch: `gradsync train` and tests/reference/torch_train.py (python3-torch, gloo backend,
// torch.nn.parallel.DistributedDataParallel) start from the same initial state and data file and must end with
// the same parameters (max relative difference <= 1e-5 per tensor) and the same per-step losses, on each of
// gradsync's backends (gloo and mpi; PyTorch always runs on gloo). Both run with
// OMP_NUM_THREADS=1 so that neither side's kernels split reductions differently.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/parity.h"
#include "support/subprocess.h"

namespace t = gradsync::test;
namespace parity = gradsync::test::parity;

namespace {

using parity::kPython;
using parity::kReference;
using parity::read_log;

struct ParityCase {
  std::string name;
  std::string model;
  std::string loss;
  int samples;
  int world;
  int accumulate;
  int global_batch;
  std::vector<std::string> extra;  // same flags for both sides
};

void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

t::CommandOptions options() {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(240);
  o.env = {{"OMP_NUM_THREADS", "1"}};
  return o;
}

// Both backends gradsync has, each checked against the same PyTorch run.
const std::vector<std::string> kBackends{"gloo", "mpi"};

// Runs PyTorch once and gradsync on every backend (DIR/gradsync-<backend>.pt/.jsonl); returns compare_states.py's
// result per backend (its last line is a JSON verdict), all compared in one process.
std::vector<t::ProcessResult> run_case(const ParityCase& c, const std::string& dir,
                                       const std::vector<std::string>& cpp_extra, bool expect_different) {
  auto made = parity::make_case(c, "7", dir, options());
  EXPECT_TRUE(made.ok()) << made.describe();

  std::vector<std::string> py{GRADSYNC_BIN, "launch", "-n", std::to_string(c.world), "--", kPython,
                              kReference + "/torch_train.py"};
  auto py_flags = parity::train_flags(c, dir, "pytorch", c.extra);
  py.insert(py.end(), py_flags.begin(), py_flags.end());
  auto theirs = t::run(py, options());
  EXPECT_TRUE(theirs.ok()) << theirs.describe();

  std::vector<parity::Comparison> comparisons;
  for (const auto& backend : kBackends) {
    std::vector<std::string> cpp{GRADSYNC_BIN, "train", "--backend", backend};
    auto flags = parity::train_flags(c, dir, "gradsync-" + backend, c.extra);
    cpp.insert(cpp.end(), flags.begin(), flags.end());
    cpp.insert(cpp.end(), cpp_extra.begin(), cpp_extra.end());
    auto ours = t::run(cpp, options());
    EXPECT_TRUE(ours.ok()) << backend << ": " << ours.describe();

    comparisons.push_back({"states", {dir + "/gradsync-" + backend + ".pt", dir + "/pytorch.pt", "--rtol", "1e-5"}});
    if (expect_different) comparisons.back().args.push_back("--expect-different");
  }
  return parity::compare_all(comparisons, dir, options());
}

}  // namespace

class Parity : public testing::TestWithParam<ParityCase> {};

TEST_P(Parity, FinalParametersAndLossesMatchPyTorchDdp) {
  const auto& c = GetParam();
  const std::string dir = t::make_temp_dir("gradsync-parity");
  auto verdicts = run_case(c, dir, {}, false);
  auto theirs = read_log(dir + "/pytorch.jsonl");
  ASSERT_GT(theirs.size(), 0u);
  for (size_t v = 0; v < kBackends.size(); ++v) {
    const auto& backend = kBackends[v];
    EXPECT_TRUE(verdicts[v].ok()) << backend << ": " << verdicts[v].describe();
    std::cout << c.name << " on " << backend << ": " << verdicts[v].out.substr(verdicts[v].out.rfind('{'));
    auto ours = read_log(dir + "/gradsync-" + backend + ".jsonl");
    ASSERT_EQ(ours.size(), theirs.size()) << backend;
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_EQ(ours[i]["step"], theirs[i]["step"]);
      EXPECT_EQ(ours[i]["epoch"], theirs[i]["epoch"]);
      EXPECT_EQ(ours[i]["samples"], theirs[i]["samples"]);
      const double a = ours[i]["loss"], b = theirs[i]["loss"];
      EXPECT_NEAR(a, b, 1e-5 * std::max(1.0, std::abs(b))) << backend << " step " << i;
    }
  }
}

// 100 samples leave a short last micro-batch and a short last accumulation group, and --steps crosses epochs.
INSTANTIATE_TEST_SUITE_P(
    Configurations, Parity,
    testing::Values(
        ParityCase{"N1_K1_sgd_momentum", "mlp:10-16-4", "ce", 100, 1, 1, 16, {"--momentum", "0.9", "--epochs", "2"}},
        ParityCase{"N1_K3_sgd", "mlp:10-16-4", "ce", 100, 1, 3, 15, {"--steps", "9", "--lr", "0.05"}},
        ParityCase{"N2_K1_sgd_wd", "mlp:10-16-4", "ce", 100, 2, 1, 16,
                   {"--momentum", "0.9", "--weight-decay", "0.01", "--epochs", "2"}},
        ParityCase{"N2_K2_adam_mse", "mlp:10-12-8-3", "mse", 100, 2, 2, 16, {"--optimizer", "adam", "--steps", "10"}},
        ParityCase{"N4_K1_adam", "mlp:10-16-4", "ce", 100, 4, 1, 16, {"--optimizer", "adam", "--epochs", "2"}},
        ParityCase{"N4_K2_sgd_batchnorm", "mlp-bn:10-16-4", "ce", 96, 4, 2, 24,
                   {"--momentum", "0.5", "--steps", "6", "--no-shuffle"}},
        // PyTorch's fp16_compress_hook: half-precision buckets, divided and summed in float16.
        ParityCase{"N2_K2_fp16_comm_hook", "mlp:10-16-4", "ce", 96, 2, 2, 16,
                   {"--comm-hook", "fp16", "--momentum", "0.9", "--epochs", "2"}},
        // cnn:C1-C2-OUT (Conv2d, ReLU, MaxPool2d twice, then Linear) on flattened 28x28 inputs.
        ParityCase{"N3_K1_cnn_sgd_momentum", "cnn:4-6-10", "ce", 60, 3, 1, 12, {"--momentum", "0.9", "--steps", "5"}},
        // res:IN-H-B-OUT, not a Sequential (LayerNorm, residual connections); DDP's buckets in Python's order.
        ParityCase{"N3_K2_res_adam", "res:9-11-2-5", "ce", 90, 3, 2, 18, {"--optimizer", "adam", "--steps", "6"}},
        // Frozen parameters are neither hooked nor reduced; biases and norm weights in a group without decay.
        ParityCase{"N2_K1_res_frozen_no_decay", "res:8-10-2-3", "ce", 64, 2, 1, 16,
                   {"--freeze", "inp.", "--no-decay-1d", "--weight-decay", "0.1", "--momentum", "0.9", "--steps", "5"}},
        // gpt:V-T-D-L-H on ragged token sequences: each micro-batch's loss the mean over its valid tokens (targets
        // != -100), DDP's mean over ranks of the 1/K-scaled sums; the tied wte gets both of its gradients.
        ParityCase{"N2_K2_gpt_sgd_momentum", "gpt:17-8-12-2-3", "ce", 64, 2, 2, 16,
                   {"--momentum", "0.9", "--lr", "0.1", "--steps", "6"}},
        ParityCase{"N3_K1_gpt_adam", "gpt:13-6-8-1-2", "ce", 60, 3, 1, 12, {"--optimizer", "adam", "--steps", "5"}}),
    [](const testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

// The test can fail: gradsync with Reduction::Sum must NOT match PyTorch DDP (which averages).
TEST(Parity, SumReductionDiffersFromPyTorchDdp) {
  ParityCase c{"N2_sum", "mlp:10-16-4", "ce", 64, 2, 1, 16, {"--steps", "3"}};
  const std::string dir = t::make_temp_dir("gradsync-parity");
  for (const auto& verdict : run_case(c, dir, {"--reduction", "sum"}, true)) {
    EXPECT_TRUE(verdict.ok()) << verdict.describe();
  }
}

// Buckets of megabytes take Gloo's two-rank allreduce (src/runtime/gloo_group.cpp) instead of the ring; at two ranks
// either gives every element the sum of the same two values, so the parameters match PyTorch DDP's bit for bit.
// mlp:16-1200-1200-4's first bucket is 5.8 MB (several segments per rank), its second one 82 KB (the ring).
TEST(Parity, TwoRankBucketsOfMegabytesAreBitIdenticalToPyTorchDdp) {
  ParityCase c{"N2_megabyte_buckets", "mlp:16-1200-1200-4", "ce", 64, 2, 1, 16, {"--momentum", "0.9", "--steps", "4"}};
  const std::string dir = t::make_temp_dir("gradsync-parity");
  auto verdicts = run_case(c, dir, {}, false);
  for (size_t v = 0; v < kBackends.size(); ++v) {
    ASSERT_TRUE(verdicts[v].ok()) << kBackends[v] << ": " << verdicts[v].describe();
    auto verdict = nlohmann::json::parse(verdicts[v].out.substr(verdicts[v].out.rfind('{')));
    EXPECT_EQ(verdict["max_rel"].get<double>(), 0.0) << kBackends[v] << ": " << verdicts[v].out;
  }
}
