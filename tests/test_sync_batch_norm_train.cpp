// `gradsync train --sync-bn` against real PyTorch: one process training plain BatchNorm on each step's union of
// the ranks' samples (tests/reference/torch_global_batches.py) must end with the same parameters and running
// statistics; the same run without --sync-bn must not. Uneven ranks come from --no-pad, where a rank may hold
// fewer samples than the others, or none, in an epoch's last step.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/parity.h"
#include "support/subprocess.h"

namespace t = gradsync::test;
using t::parity::kPython;
using t::parity::kReference;

namespace {

t::CommandOptions cli() {
  return t::job_options(std::chrono::seconds(180));
}

struct Case {
  std::string model;
  int samples;
  int ranks;
  std::vector<std::string> flags;  // both sides: batch, optimizer, epochs, --no-pad, --dtype
  std::vector<std::string> ours;   // gradsync only: strategy, reduction, backend
  // The control without --sync-bn: it ends elsewhere, or (a rank with a single sample) BatchNorm refuses to train.
  bool control_fails = false;
};

std::string make_case(const Case& c) {
  const auto dir = t::make_temp_dir("gradsync-syncbn");
  auto made = t::run({kPython, kReference + "/make_case.py", "--model", c.model, "--n", std::to_string(c.samples),
                      "--loss", "ce", "--seed", "11", "--data-out", dir + "/data.pt", "--state-out", dir + "/init.pt"},
                     cli());
  EXPECT_TRUE(made.ok()) << made.describe();
  return dir;
}

std::vector<std::string> common(const Case& c, const std::string& dir) {
  std::vector<std::string> out{"--model", c.model, "--data", dir + "/data.pt", "--init-state", dir + "/init.pt"};
  out.insert(out.end(), c.flags.begin(), c.flags.end());
  return out;
}

// Trains with --sync-bn (must end where PyTorch does) and without (must not).
void expect_union_batch_norm(const Case& c) {
  const auto dir = make_case(c);
  auto py = common(c, dir);
  py.insert(py.begin(), {kPython, kReference + "/torch_global_batches.py"});
  py.insert(py.end(), {"--ranks", std::to_string(c.ranks), "--save-state", dir + "/pytorch.pt"});
  auto ref = t::run(py, cli());
  ASSERT_TRUE(ref.ok()) << ref.describe();
  for (const bool sync : {true, false}) {
    const std::string out = dir + (sync ? "/sync.pt" : "/plain.pt");
    std::vector<std::string> ours{GRADSYNC_BIN, "train", "--world-size", std::to_string(c.ranks), "--save-state",
                                  out, "--quiet"};
    if (sync) ours.push_back("--sync-bn");
    ours.insert(ours.end(), c.ours.begin(), c.ours.end());
    const auto both = common(c, dir);
    ours.insert(ours.end(), both.begin(), both.end());
    auto r = t::run(ours, cli());
    if (!sync && c.control_fails) {
      EXPECT_EQ(r.exit_code, 1) << r.describe();
      EXPECT_NE(r.err.find("Expected more than 1 value per channel when training"), std::string::npos) << r.describe();
      EXPECT_NE(r.err.find("so that no micro-batch is degenerate)"), std::string::npos) << r.describe();
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.describe();
    std::vector<std::string> cmp{kPython, kReference + "/compare_states.py", out, dir + "/pytorch.pt", "--rtol",
                                 "1e-5", "--atol", "1e-7"};
    if (!sync) cmp.push_back("--expect-different");
    auto verdict = t::run(cmp, cli());
    EXPECT_TRUE(verdict.ok()) << (sync ? "with" : "without") << " --sync-bn: " << verdict.describe();
    if (sync) {  // the running statistics are compared too (BatchNorm's buffers are in the state)
      EXPECT_NE(verdict.out.find("1.running_var"), std::string::npos) << verdict.describe();
    }
  }
}

}  // namespace

// 3 ranks, 70 samples without padding (24/23/23): every epoch ends on uneven ranks. SGD with momentum, float32.
TEST(SyncBatchNormTrain, DdpGlobalMeanOnUnevenRanksIsOneProcessOnTheUnion) {
  expect_union_batch_norm({"mlp-bn:8-12-10-5", 70, 3,
                           {"--global-batch", "12", "--momentum", "0.9", "--lr", "0.05", "--epochs", "2", "--no-pad"},
                           {"--reduction", "global-mean", "--verify-every", "1"}});
}

// 4 ranks, 42 samples (11/11/10/10) in micro-batches of 2: each epoch's last step has one sample on ranks 0 and 1
// and none on ranks 2 and 3, which join with empty micro-batches. Adam in float64 (a bias before BatchNorm has a
// true gradient of zero, which Adam would turn into steps of about lr in float32 rounding noise).
TEST(SyncBatchNormTrain, FsdpFullAdamWithEmptyRanksIsOneProcessOnTheUnion) {
  expect_union_batch_norm({"mlp-bn:8-6-7-5", 42, 4,
                           {"--global-batch", "8", "--optimizer", "adam", "--epochs", "2", "--no-pad", "--dtype",
                            "fp64"},
                           {"--strategy", "fsdp-full", "--wrap", "children", "--reduction", "global-mean"}, true});
}

// Equal ranks (DistributedSampler's padding) and PyTorch's own mean: DDP's mean is the union's then.
TEST(SyncBatchNormTrain, Zero1MeanOnEqualRanksIsOneProcessOnTheUnion) {
  expect_union_batch_norm({"mlp-bn:6-9-4", 48, 2,
                           {"--global-batch", "8", "--momentum", "0.5", "--lr", "0.1", "--epochs", "2"},
                           {"--strategy", "zero1"}});
}

TEST(SyncBatchNormTrain, OnMpiTooWithAnEmptyRank) {
  expect_union_batch_norm({"mlp-bn:8-6-7-5", 42, 4,
                           {"--global-batch", "8", "--momentum", "0.9", "--epochs", "1", "--no-pad"},
                           {"--backend", "mpi", "--reduction", "global-mean"}, true});
}

// K = 2: each micro-step normalises over the union of the ranks' k-th micro-batches, which is what --verify-every's
// reference computes (one process, those unions one after another); and FSDP with bfloat16 parameters, whose
// SyncBatchNorm computes in float32 and reduces float32 sums.
TEST(SyncBatchNormTrain, AccumulationVerifiesAndBfloat16Trains) {
  const Case c{"mlp-bn:8-12-5", 96, 3, {"--global-batch", "24", "--epochs", "1"}, {}};
  const auto dir = make_case(c);
  std::vector<std::string> ours{GRADSYNC_BIN, "train", "--world-size", "3", "--sync-bn", "--accumulate", "2",
                                "--verify-every", "1", "--quiet"};
  const auto both = common(c, dir);
  ours.insert(ours.end(), both.begin(), both.end());
  auto r = t::run(ours, cli());
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.err.find("gradsync verify: step 3"), std::string::npos) << r.describe();
  std::vector<std::string> bf16{GRADSYNC_BIN, "train", "--world-size", "2", "--sync-bn", "--strategy", "fsdp-full",
                                "--param-dtype", "bf16", "--quiet"};
  bf16.insert(bf16.end(), both.begin(), both.end());
  auto b = t::run(bf16, cli());
  EXPECT_TRUE(b.ok()) << b.describe();
}

TEST(SyncBatchNormTrain, NeedsBatchNormAndRanks) {
  auto no_bn = t::run({GRADSYNC_BIN, "train", "--model", "mlp:8-4-2", "--data", "synthetic:16", "--sync-bn",
                       "--global-batch", "8",
                       "--world-size", "2"}, cli());
  EXPECT_EQ(no_bn.exit_code, 1) << no_bn.describe();
  EXPECT_NE(no_bn.err.find("--sync-bn synchronises BatchNorm statistics, and --model mlp:8-4-2 has no BatchNorm"),
            std::string::npos) << no_bn.describe();
  auto local = t::run({GRADSYNC_BIN, "train", "--model", "mlp-bn:8-4-2", "--data", "synthetic:16", "--sync-bn",
                       "--global-batch", "8",
                       "--strategy", "local"}, cli());
  EXPECT_EQ(local.exit_code, 1) << local.describe();
  EXPECT_NE(local.err.find("--sync-bn with --strategy local"), std::string::npos) << local.describe();
}
