// Parity of the sharded strategies with real PyTorch: `gradsync train --strategy fsdp-full|fsdp-grad-op|
// fsdp-no-shard|hsdp|hsdp-grad-op|zero1` and tests/reference/torch_train.py (the build's reference Python, gloo) with
// DistributedDataParallel (ShardedParity) or with PyTorch's own FSDP (FsdpParity: fully_shard, FSDP1) start from
// the same initial state and data file; every strategy must end with the same parameters (relative per tensor,
// compare_states.py), the same per-step losses and the same optimizer state keyed by parameter names
// (compare_optim_states.py). The reference runs once per configuration, the comparisons in one process. Sharded
// strategies sum in another order than PyTorch's allreduce, so equality is within rounding, not bitwise.
#include <algorithm>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "support/parity.h"
#include "support/subprocess.h"

namespace t = gradsync::test;
namespace parity = gradsync::test::parity;

namespace {

using parity::kPython;
using parity::kReference;
using parity::read_log;

struct ShardedParityCase {
  std::string name;
  std::string model;
  std::string loss;
  int samples;
  int world;
  int accumulate;
  int global_batch;
  std::vector<std::string> flags;                   // both sides
  std::vector<std::vector<std::string>> strategies;  // gradsync only: --strategy X [extra flags]
  std::vector<std::string> reference = {"--strategy", "ddp"};  // torch_train.py only
  std::string rtol = "1e-5";                                   // of every parameter and optimizer state tensor
  double loss_rtol = 1e-5;                                     // of every step's loss
  // A difference by design (16-bit reductions): each comparison's max_rel (per tensor, on the reference's scale)
  // must lie in (differs_above, max_rel_at_most]; rtol then only bounds single elements against gross errors.
  double differs_above = 0;
  double max_rel_at_most = 0;
};

// ctest lists the parameter next to the test name: the case's model and strategies, not the struct's bytes.
void PrintTo(const ShardedParityCase& c, std::ostream* os) {
  *os << fmt::format("{} N={} K={} {} strategies against {}", c.model, c.world, c.accumulate, c.strategies.size(),
                     fmt::join(c.reference, " "));
}

t::CommandOptions options() {
  return t::job_options(std::chrono::seconds(120));
}

std::string tag_of(const std::vector<std::string>& strategy) {
  std::string tag;
  for (const auto& part : strategy) {
    for (char ch : part) tag += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  }
  return tag;
}

// The run's per-step losses and sample counts are the reference's.
void check_losses(const std::string& tag, const std::string& dir, const std::vector<nlohmann::json>& reference_log,
                  double rtol) {
  auto log = read_log(dir + "/" + tag + ".jsonl");
  ASSERT_EQ(log.size(), reference_log.size()) << tag;
  for (size_t i = 0; i < log.size(); ++i) {
    EXPECT_EQ(log[i]["samples"], reference_log[i]["samples"]) << tag << " step " << i;
    const double a = log[i]["loss"], b = reference_log[i]["loss"];
    EXPECT_NEAR(a, b, rtol * std::max(1.0, std::abs(b))) << tag << " step " << i;
    EXPECT_TRUE(log[i].contains("memory_peak") && log[i].contains("sent_bytes")) << log[i].dump();
  }
}

// gradsync with one strategy on one backend against the PyTorch run in `dir`: its losses here, its states by the
// two comparisons it appends to `checks`, named in `what` (run for every strategy at once, after the last).
void check_strategy(const ShardedParityCase& c, const std::string& dir, const std::vector<std::string>& strategy,
                    const std::string& backend, const std::vector<nlohmann::json>& reference_log,
                    std::vector<std::string>& what, std::vector<parity::Comparison>& checks) {
  const auto tag = tag_of(strategy) + "_" + backend;
  std::vector<std::string> cpp{GRADSYNC_BIN, "train", "--backend", backend};
  auto flags = parity::train_flags(c, dir, tag, c.flags);
  cpp.insert(cpp.end(), flags.begin(), flags.end());
  cpp.insert(cpp.end(), strategy.begin(), strategy.end());
  cpp.insert(cpp.end(), {"--save-optim", dir + "/" + tag + ".optim.pt"});
  auto ours = t::run(cpp, options());
  ASSERT_TRUE(ours.ok()) << tag << ": " << ours.describe();
  EXPECT_NE(ours.out.find("memory per rank"), std::string::npos) << ours.out;
  if (strategy[1].rfind("hsdp", 0) == 0) {  // hybrid: the traffic inside a shard group and across replicas
    EXPECT_NE(ours.out.find("inside its shard group"), std::string::npos) << ours.out;
  }

  what.push_back(tag);
  checks.push_back({"states", {dir + "/" + tag + ".pt", dir + "/pytorch.pt", "--rtol", c.rtol}});
  // A Sum run's momentum buffers are N times DDP's mean ones (its lr N times smaller): only its states compare.
  if (std::find(strategy.begin(), strategy.end(), "sum") == strategy.end()) {
    // The optimizer's state, gathered and keyed by parameter names, is PyTorch's (FSDP.full_optim_state_dict's
    // layout).
    what.push_back(tag + " optimizer");
    checks.push_back({"optim", {dir + "/" + tag + ".optim.pt", dir + "/pytorch.optim.pt", "--rtol", c.rtol}});
  }
  check_losses(tag, dir, reference_log, c.loss_rtol);
}

// The reference (torch_train.py with c.reference) once, then every strategy of the case on both backends against it.
void check_case(const ShardedParityCase& c) {
  const std::string dir = t::make_temp_dir("gradsync-sharded-parity");
  auto made = parity::make_case(c, "11", dir, options());
  ASSERT_TRUE(made.ok()) << made.describe();
  std::vector<std::string> py{GRADSYNC_BIN, "launch", "-n", std::to_string(c.world), "--", kPython,
                              kReference + "/torch_train.py"};
  py.insert(py.end(), c.reference.begin(), c.reference.end());
  auto py_flags = parity::train_flags(c, dir, "pytorch", c.flags);
  py.insert(py.end(), py_flags.begin(), py_flags.end());
  py.insert(py.end(), {"--save-optim", dir + "/pytorch.optim.pt"});
  auto theirs = t::run(py, options());
  ASSERT_TRUE(theirs.ok()) << theirs.describe();
  const auto reference_log = read_log(dir + "/pytorch.jsonl");
  ASSERT_GT(reference_log.size(), 0u);

  std::vector<std::string> what;
  std::vector<parity::Comparison> checks;
  for (const auto& strategy : c.strategies) {
    for (const char* backend : {"gloo", "mpi"}) {
      check_strategy(c, dir, strategy, backend, reference_log, what, checks);
    }
  }
  const auto verdicts = parity::compare_all(checks, dir, options());
  for (size_t i = 0; i < checks.size(); ++i) {
    EXPECT_TRUE(verdicts[i].ok()) << what[i] << ": " << verdicts[i].describe();
    // A passing check's last line is its JSON verdict.
    const auto& out = verdicts[i].out;
    if (!verdicts[i].ok()) continue;
    const auto verdict = out.substr(out.rfind('{'));
    std::cout << c.name << " " << what[i] << ": " << verdict;
    if (c.differs_above > 0) {
      const double max_rel = nlohmann::json::parse(verdict).at("max_rel").get<double>();
      EXPECT_GT(max_rel, c.differs_above) << what[i] << ": the difference by design does not show";
      EXPECT_LE(max_rel, c.max_rel_at_most) << what[i];
    }
  }
}

}  // namespace

class ShardedParity : public testing::TestWithParam<ShardedParityCase> {};

TEST_P(ShardedParity, EveryStrategyEndsWherePyTorchDdpEnds) { check_case(GetParam()); }

// Sizes chosen so that flat parameters need padding (143, 98, 24 at N = 3; 176, 32, 68 at N = 4), short last
// micro-batches and accumulation groups (100 samples), and epochs crossed by --steps.
INSTANTIATE_TEST_SUITE_P(
    Configurations, ShardedParity,
    testing::Values(
        ShardedParityCase{"N3_K2_adam", "mlp:10-13-7-3", "ce", 100, 3, 2, 18, {"--optimizer", "adam", "--steps", "8"},
                          {{"--strategy", "fsdp-full"},
                           {"--strategy", "fsdp-full", "--accumulate-grads", "sharded", "--wrap", "params:150"},
                           {"--strategy", "fsdp-grad-op", "--wrap", "children"},
                           {"--strategy", "fsdp-no-shard"},
                           {"--strategy", "zero1"}}},
        ShardedParityCase{"N4_K2_sgd_batchnorm", "mlp-bn:10-16-4", "ce", 96, 4, 2, 24,
                          {"--momentum", "0.5", "--weight-decay", "0.01", "--steps", "6", "--no-shuffle"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"},
                           {"--strategy", "fsdp-grad-op", "--wrap", "list:0,3"},
                           {"--strategy", "fsdp-no-shard"},
                           {"--strategy", "zero1"}}},
        ShardedParityCase{"N2_K1_sgd_mse", "mlp:10-12-8-3", "mse", 100, 2, 1, 16,
                          {"--momentum", "0.9", "--epochs", "2"},
                          {{"--strategy", "fsdp-full", "--wrap", "list:0,4"}, {"--strategy", "zero1"}}},
        // A convolutional network (cnn:C1-C2-OUT): with children, units are its two Conv2d and its Linear.
        ShardedParityCase{"N2_K2_cnn_adam", "cnn:3-5-10", "ce", 48, 2, 2, 16, {"--optimizer", "adam", "--steps", "5"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"},
                           {"--strategy", "fsdp-grad-op"},
                           {"--strategy", "zero1"}}},
        // res:IN-H-B-OUT is not a Sequential: FSDP runs its Blocks as units in their slots of `blocks` (inp and out
        // form the root unit), chosen by children, by type and by qualified name; ZeRO-1 takes the same units.
        ShardedParityCase{"N4_K3_res_adam", "res:9-11-3-5", "ce", 100, 4, 3, 24, {"--optimizer", "adam", "--steps", "7"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"},
                           {"--strategy", "fsdp-full", "--wrap", "type:Block", "--no-prefetch"},
                           {"--strategy", "fsdp-grad-op", "--wrap", "list:blocks.1"},
                           {"--strategy", "fsdp-no-shard"},
                           {"--strategy", "zero1"},
                           {"--strategy", "zero1", "--wrap", "type:Block"}}},
        // Frozen parameters (no unit holds them, no collective moves them) and a second optimizer group without
        // weight decay over the original parameters (FSDP and ZeRO-1 step views of their shards).
        ShardedParityCase{"N3_K2_res_frozen_no_decay_sgd", "res:10-12-2-4", "mse", 90, 3, 2, 18,
                          {"--momentum", "0.9", "--weight-decay", "0.1", "--no-decay-1d", "--freeze",
                           "inp.,blocks.1.norm", "--steps", "6"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"},
                           {"--strategy", "hsdp", "--replicas", "3", "--wrap", "children"},
                           {"--strategy", "fsdp-grad-op"},
                           {"--strategy", "zero1"}}},
        ShardedParityCase{"N2_K1_cnn_frozen_conv_no_decay", "cnn:3-4-10", "ce", 40, 2, 1, 8,
                          {"--optimizer", "adam", "--weight-decay", "0.05", "--no-decay-1d", "--freeze", "1.",
                           "--steps", "4"},
                          {{"--strategy", "fsdp-full", "--wrap", "type:Conv2d,Linear"}, {"--strategy", "zero1"}}},
        // A gpt with its blocks as units; the tied wte (first and last layer) stays in the root unit.
        ShardedParityCase{"N2_K2_gpt_adam", "gpt:17-8-12-2-3", "ce", 48, 2, 2, 16, {"--optimizer", "adam", "--steps", "4"},
                          {{"--strategy", "fsdp-full", "--wrap", "type:Block"},
                           {"--strategy", "hsdp", "--replicas", "2", "--wrap", "type:Block"},
                           {"--strategy", "fsdp-grad-op", "--wrap", "list:blocks.0,blocks.1"},
                           {"--strategy", "zero1"}}}),
    [](const testing::TestParamInfo<ShardedParityCase>& info) { return info.param.name; });

// Hybrid sharding: R replicas of S-rank shard groups (rank = replica x S + shard index) end where PyTorch DDP over
// all N ranks ends, whatever R (1: fsdp-full, N: every rank a replica), in both accumulation modes. Sum reduction
// with lr / N is DDP's mean with lr under SGD with momentum (the momentum buffer scales with the gradient).
INSTANTIATE_TEST_SUITE_P(
    Hybrid, ShardedParity,
    testing::Values(
        ShardedParityCase{"N4_K2_hsdp_mlp_sgd", "mlp:10-13-7-3", "ce", 100, 4, 2, 24,
                          {"--momentum", "0.9", "--steps", "7"},
                          {{"--strategy", "hsdp", "--replicas", "2"},
                           {"--strategy", "hsdp", "--replicas", "2", "--accumulate-grads", "sharded", "--wrap",
                            "params:150"},
                           {"--strategy", "hsdp-grad-op", "--replicas", "4", "--wrap", "children"},
                           {"--strategy", "hsdp", "--replicas", "2", "--reduction", "sum", "--lr", "0.0025"}}},
        ShardedParityCase{"N3_K3_hsdp_res_adam", "res:9-11-3-5", "ce", 100, 3, 3, 18,
                          {"--optimizer", "adam", "--steps", "6"},
                          {{"--strategy", "hsdp", "--replicas", "3", "--wrap", "children"},
                           {"--strategy", "hsdp-grad-op", "--replicas", "3", "--accumulate-grads", "sharded", "--wrap",
                            "type:Block"},
                           {"--strategy", "hsdp", "--replicas", "1", "--wrap", "children"}}},
        ShardedParityCase{"N4_K2_hsdp_batchnorm_sgd", "mlp-bn:10-16-4", "ce", 96, 4, 2, 24,
                          {"--momentum", "0.5", "--weight-decay", "0.01", "--steps", "6", "--no-shuffle"},
                          {{"--strategy", "hsdp", "--replicas", "2", "--wrap", "children"},
                           {"--strategy", "hsdp-grad-op", "--replicas", "2", "--accumulate-grads", "sharded",
                            "--wrap", "list:0,3"}}}),
    [](const testing::TestParamInfo<ShardedParityCase>& info) { return info.param.name; });

// The sharded strategies against PyTorch's own FSDP on CPU with gloo (torch 2.x only): fsdp-full and hsdp against
// FSDP2's fully_shard (hsdp on a 2-D (replicate, shard) mesh), fsdp-grad-op and fsdp-no-shard against FSDP1's
// SHARD_GRAD_OP and NO_SHARD. float32 with SGD and momentum within 1e-5; Adam in float64 within 1e-10 (in float32
// Adam turns the rounding of near-zero gradients into lr-sized steps). Both sides divide by N around a SUM
// reduction, each in its own place (docs/semantics.md): equal within rounding, not bitwise.
class FsdpParity : public testing::TestWithParam<ShardedParityCase> {};

TEST_P(FsdpParity, EveryStrategyEndsWherePyTorchsFsdpEnds) {
#if TORCH_VERSION_MAJOR < 2
  GTEST_SKIP() << "PyTorch's FSDP on CPU needs torch 2.x; this build's reference is torch " << TORCH_VERSION;
#endif
  check_case(GetParam());
}

namespace {

const std::vector<std::string> kFp64Adam{"--dtype", "fp64", "--optimizer", "adam"};

std::vector<std::string> with(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(
    PyTorchFsdp, FsdpParity,
    testing::Values(
        ShardedParityCase{"N3_K2_mlp_sgd_fully_shard", "mlp:10-13-7-3", "ce", 100, 3, 2, 18,
                          {"--momentum", "0.9", "--steps", "7"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"},
                           {"--strategy", "fsdp-full", "--accumulate-grads", "sharded", "--wrap", "params:150"}},
                          {"--strategy", "fully-shard", "--wrap", "children"}},
        ShardedParityCase{"N4_K3_res_adam_fp64_fully_shard", "res:9-11-3-5", "ce", 100, 4, 3, 24,
                          with(kFp64Adam, {"--steps", "6"}),
                          {{"--strategy", "fsdp-full", "--wrap", "type:Block"}},
                          {"--strategy", "fully-shard", "--wrap", "type:Block"}, "1e-10"},
        ShardedParityCase{"N2_K1_gpt_sgd_fully_shard", "gpt:17-8-12-2-3", "ce", 48, 2, 1, 8,
                          {"--momentum", "0.9", "--steps", "5"},
                          {{"--strategy", "fsdp-full", "--wrap", "type:Block"}},
                          {"--strategy", "fully-shard", "--wrap", "type:Block"}},
        ShardedParityCase{"N4_K2_mlp_sgd_fully_shard_hsdp", "mlp:10-13-7-3", "mse", 100, 4, 2, 24,
                          {"--momentum", "0.9", "--steps", "6"},
                          {{"--strategy", "hsdp", "--replicas", "2", "--wrap", "children"}},
                          {"--strategy", "fully-shard-hsdp", "--replicas", "2", "--wrap", "children"}},
        // Six ranks, R = 3 replicas of S = 2: PyTorch divides by 2 in the shard group and by 3 across replicas,
        // gradsync by 6 once (docs/semantics.md, PyTorch 2.x's fully_shard): the printed max_rel is what that costs.
        ShardedParityCase{"N6_K1_res_sgd_fully_shard_hsdp_R3", "res:9-11-3-5", "ce", 96, 6, 1, 24,
                          {"--momentum", "0.9", "--steps", "5"},
                          {{"--strategy", "hsdp", "--replicas", "3", "--wrap", "children"}},
                          {"--strategy", "fully-shard-hsdp", "--replicas", "3", "--wrap", "children"}},
        ShardedParityCase{"N4_K1_gpt_adam_fp64_fully_shard_hsdp", "gpt:17-8-12-2-3", "ce", 48, 4, 1, 16,
                          with(kFp64Adam, {"--steps", "4"}),
                          {{"--strategy", "hsdp", "--replicas", "2", "--wrap", "type:Block"}},
                          {"--strategy", "fully-shard-hsdp", "--replicas", "2", "--wrap", "type:Block"}, "1e-10"},
        // 16-bit reductions (docs/semantics.md, PyTorch 2.x's fully_shard): gradsync scales by 1/N in the 16-bit
        // dtype and sums in float32; fully_shard pre- and post-divides around the backend's 16-bit SUM (float16) or
        // averages in it (bfloat16). Not equal by design: the printed max_rel is what the difference measures. Per
        // tensor it must stay within four roundings of the 16-bit dtype (bfloat16 2^-8, float16 2^-11 relative
        // each) and be above 1e-5, which it would not be if either side reduced in float32. Single elements near
        // zero differ by more relative to themselves (rtol 1: no sign flips, nothing twice its reference).
        ShardedParityCase{"N3_K2_mlp_sgd_bf16_reduce_fully_shard", "mlp:10-13-7-3", "ce", 100, 3, 2, 18,
                          {"--momentum", "0.9", "--steps", "6", "--reduce-dtype", "bf16"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"}},
                          {"--strategy", "fully-shard", "--wrap", "children"}, "1", 1.5625e-2, 1e-5, 1.5625e-2},
        ShardedParityCase{"N3_K1_res_sgd_fp16_reduce_fully_shard", "res:9-11-3-5", "ce", 96, 3, 1, 24,
                          {"--momentum", "0.9", "--steps", "5", "--reduce-dtype", "fp16"},
                          {{"--strategy", "fsdp-full", "--wrap", "children"}},
                          {"--strategy", "fully-shard", "--wrap", "children"}, "1", 1.953125e-3, 1e-5, 1.953125e-3},
        ShardedParityCase{"N2_K3_mlp_sgd_fsdp1_grad_op", "mlp:10-13-7-3", "ce", 100, 2, 3, 18,
                          {"--momentum", "0.9", "--steps", "6"},
                          {{"--strategy", "fsdp-grad-op", "--wrap", "children"}},
                          {"--strategy", "fsdp1-grad-op", "--wrap", "children"}},
        ShardedParityCase{"N3_K2_res_adam_fp64_fsdp1_grad_op", "res:9-11-3-5", "ce", 100, 3, 2, 18,
                          with(kFp64Adam, {"--steps", "6"}),
                          {{"--strategy", "fsdp-grad-op", "--wrap", "type:Block"}},
                          {"--strategy", "fsdp1-grad-op", "--wrap", "type:Block"}, "1e-10"},
        ShardedParityCase{"N3_K2_gpt_sgd_fsdp1_no_shard", "gpt:17-8-12-2-3", "ce", 48, 3, 2, 12,
                          {"--momentum", "0.9", "--steps", "4"},
                          {{"--strategy", "fsdp-no-shard", "--wrap", "type:Block"}},
                          {"--strategy", "fsdp1-no-shard", "--wrap", "type:Block"}},
        ShardedParityCase{"N2_K2_res_adam_fp64_fsdp1_no_shard", "res:9-11-3-5", "mse", 100, 2, 2, 16,
                          with(kFp64Adam, {"--steps", "5"}),
                          {{"--strategy", "fsdp-no-shard", "--wrap", "children"}},
                          {"--strategy", "fsdp1-no-shard", "--wrap", "children"}, "1e-10"}),
    [](const testing::TestParamInfo<ShardedParityCase>& info) { return info.param.name; });
