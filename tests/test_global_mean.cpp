// Reduction::GlobalMean: the gradient of the mean loss over every item of the step, whatever the per-rank and
// per-micro-batch counts (a rank may have none), against one process on the union; the no-padding sampler; and
// the --verify-every checks catching an injected wrong gradient and an injected divergence.
#include <set>

#include <gtest/gtest.h>

#include "gradsync/engine.h"
#include "gradsync/ddp.h"
#include "gradsync/sampler.h"
#include "support/subprocess.h"
#include "support/worker.h"

using gradsync::DdpOptions;
using gradsync::DistributedDataParallel;
using gradsync::Reduction;
namespace t = gradsync::test;
namespace nn = torch::nn;

namespace {

nn::Sequential make_model() {
  torch::manual_seed(0);
  return nn::Sequential(nn::Linear(5, 7), nn::Tanh(), nn::Linear(7, 3));
}

// Micro-batch sizes per rank and micro-step: rank 1 has nothing, the others differ in count and size.
std::vector<std::vector<int64_t>> micro_sizes(int world) {
  std::vector<std::vector<int64_t>> sizes{{3, 5}, {}, {1}, {4, 2, 6}};
  sizes.resize(static_cast<size_t>(world));
  return sizes;
}

template <typename Forward>
torch::Tensor item_losses(Forward&& forward, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(forward(x), y,
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// Deterministic data for (rank, micro-step): every process can rebuild every rank's data.
std::pair<torch::Tensor, torch::Tensor> data_for(int rank, size_t k, int64_t size) {
  torch::manual_seed(100 + static_cast<uint64_t>(rank) * 10 + k);
  return {torch::randn({size, 5}), torch::randint(0, 3, {size})};
}

}  // namespace

// args: reduction (global-mean | mean)
GRADSYNC_WORKER(global_mean_uneven) {
  auto world = gradsync::init({std::chrono::seconds(60), std::nullopt, std::nullopt});
  const auto reduction = gradsync::parse_reduction(args.at(0));
  auto model = make_model();
  DdpOptions options;
  options.reduction(reduction);
  DistributedDataParallel ddp(model, world, options);
  const auto sizes = micro_sizes(world->size());
  const auto& mine = sizes[static_cast<size_t>(world->rank())];
  const auto group = static_cast<int64_t>(mine.size());
  if (reduction == Reduction::GlobalMean) {
    gradsync::accumulate_global_mean(ddp, group, [&](int64_t k) {
      auto [x, y] = data_for(world->rank(), static_cast<size_t>(k), mine[static_cast<size_t>(k)]);
      auto summed = item_losses([&](const torch::Tensor& in) { return ddp.forward(in); }, x, y);
      return gradsync::ItemLoss{summed, x.size(0)};
    });
  } else {
    gradsync::accumulate(ddp, group, [&](int64_t k) {
      auto [x, y] = data_for(world->rank(), static_cast<size_t>(k), mine[static_cast<size_t>(k)]);
      return torch::nn::functional::cross_entropy(ddp.forward(x), y);
    });
  }
  // One process, the union of every rank's items, the plain mean loss.
  auto reference = make_model();
  std::vector<torch::Tensor> xs, ys;
  for (int r = 0; r < world->size(); ++r) {
    for (size_t k = 0; k < sizes[static_cast<size_t>(r)].size(); ++k) {
      auto [x, y] = data_for(r, k, sizes[static_cast<size_t>(r)][k]);
      xs.push_back(x);
      ys.push_back(y);
    }
  }
  torch::nn::functional::cross_entropy(reference->forward(torch::cat(xs)), torch::cat(ys)).backward();
  double worst = 0;
  auto got = model->parameters();
  auto expected = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, (got[i].grad() - expected[i].grad()).abs().max().item<double>());
  }
  fmt::print("max |diff| to the union's mean gradient: {:.3g}\n", worst);
  if (reduction == Reduction::GlobalMean) {
    WORKER_CHECK(worst <= 1e-6, "global-mean differs from the single-process mean over the union by {}", worst);
  } else {
    WORKER_CHECK(worst > 1e-3, "the plain mean of means should differ from the global mean here, differs by {}",
                 worst);
  }
  return 0;
}

TEST(GlobalMean, UnevenRanksAndMicroBatchesMatchOneProcessOnTheUnion) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(90);
  for (int world : {3, 4}) {
    auto results = t::run_ranks(world, t::worker_argv("global_mean_uneven", {"global-mean"}), opts);
    for (const auto& r : results) ASSERT_TRUE(r.ok()) << "N=" << world << ": " << r.describe();
  }
}

TEST(GlobalMean, PlainMeanOfMeansDiffersOnUnevenCounts) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(90);
  auto results = t::run_ranks(4, t::worker_argv("global_mean_uneven", {"mean"}), opts);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
}

TEST(GlobalMean, SamplerWithoutPaddingCoversEveryIndexExactlyOnce) {
  for (int64_t n : {1, 2, 7, 10, 11, 100}) {
    for (int64_t replicas : {1, 3, 4, 12}) {
      for (int64_t epoch : {0, 3}) {
        std::multiset<int64_t> seen;
        int64_t total = 0;
        for (int64_t r = 0; r < replicas; ++r) {
          auto s = gradsync::DistributedSampler::without_padding(n, replicas, r, true, 5);
          s.set_epoch(epoch);
          auto idx = s.indices();
          EXPECT_EQ(static_cast<int64_t>(idx.size()), s.num_samples());
          total += s.num_samples();
          seen.insert(idx.begin(), idx.end());
        }
        EXPECT_EQ(total, n);
        for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen.count(i), 1u) << "n=" << n << " N=" << replicas << " i=" << i;
      }
    }
  }
  // Same permutation as the padded sampler, only without the wrap-around duplicates.
  // Rank 3 of 4 over 10 samples: positions 3, 7 (and 11, a wrap-around duplicate, only when padded).
  auto padded = gradsync::DistributedSampler(10, 4, 3, true, 9).indices();
  auto unpadded = gradsync::DistributedSampler::without_padding(10, 4, 3, true, 9).indices();
  ASSERT_EQ(padded.size(), 3u);
  EXPECT_EQ(std::vector<int64_t>(padded.begin(), padded.begin() + 2), unpadded);
}

namespace {

const std::string kPython = GRADSYNC_PYTHON;
const std::string kReference = std::string(GRADSYNC_SOURCE_DIR) + "/tests/reference";

t::CommandOptions cli() {
  return t::job_options(std::chrono::seconds(180));
}

std::string make_case(const std::string& dir, int n, const std::string& model = "mlp:8-16-5") {
  auto made = t::run({kPython, kReference + "/make_case.py", "--model", model, "--n", std::to_string(n),
                      "--loss", "ce", "--seed", "5", "--data-out", dir + "/data.pt", "--state-out", dir + "/init.pt"},
                     cli());
  EXPECT_TRUE(made.ok()) << made.describe();
  return dir;
}

t::ProcessResult compare(const std::string& a, const std::string& b, bool expect_different) {
  std::vector<std::string> argv{kPython, kReference + "/compare_states.py", a, b, "--rtol", "1e-5", "--atol", "1e-7"};
  if (expect_different) argv.push_back("--expect-different");
  return t::run(argv, cli());
}

}  // namespace

// 100 samples over 3 ranks without padding: 34/33/33, so the last step is uneven across ranks (and, with K=2,
// across micro-batches). global-mean must end where real PyTorch ends when one process trains on the same global
// batches; the PyTorch-style mean must not.
TEST(GlobalMean, TrainMatchesPyTorchOnTheSameGlobalBatches) {
  const std::string dir = make_case(t::make_temp_dir("gradsync-gm"), 100);
  for (const char* k : {"1", "2"}) {
    const std::vector<std::string> common{"--model", "mlp:8-16-5", "--data", dir + "/data.pt", "--init-state",
                                          dir + "/init.pt", "--global-batch", "24", "--accumulate", k,
                                          "--momentum", "0.9", "--epochs", "3", "--no-pad"};
    auto py = common;
    py.insert(py.begin(), {kPython, kReference + "/torch_global_batches.py"});
    py.insert(py.end(), {"--ranks", "3", "--save-state", dir + "/pytorch.pt"});
    auto ref = t::run(py, cli());
    ASSERT_TRUE(ref.ok()) << ref.describe();
    for (const char* reduction : {"global-mean", "mean"}) {
      std::vector<std::string> ours{GRADSYNC_BIN, "train", "--world-size", "3", "--reduction", reduction,
                                    "--save-state", dir + "/" + reduction + ".pt", "--quiet"};
      ours.insert(ours.end(), common.begin(), common.end());
      auto r = t::run(ours, cli());
      ASSERT_TRUE(r.ok()) << r.describe();
      const bool global = std::string(reduction) == "global-mean";
      auto verdict = compare(dir + "/" + reduction + ".pt", dir + "/pytorch.pt", !global);
      EXPECT_TRUE(verdict.ok()) << "K=" << k << " " << reduction << ": " << verdict.describe();
    }
  }
}

// The sharded strategies (hybrid ones included) with global-mean and no padding: 90 samples over 4 ranks leave 23/23/22/22 per epoch, so
// with K = 3 micro-batches of 2 the last step of each epoch has ranks running 3 and 2 micro-batches (FSDP adds a
// shadow micro-step to the shorter ones). Every strategy must end where PyTorch's one process on the same global
// batches ends, on res (units: its Blocks) and on an MLP, and --verify-every must pass every step.
TEST(GlobalMean, EveryShardedStrategyWithUnevenRanksMatchesOneProcessOnTheUnion) {
  for (const char* model : {"res:8-10-2-5", "mlp:8-12-9-5"}) {
    const std::string dir = make_case(t::make_temp_dir("gradsync-gm-sharded"), 90, model);
    const std::vector<std::string> common{"--model", model, "--data", dir + "/data.pt", "--init-state",
                                          dir + "/init.pt", "--global-batch", "24", "--accumulate", "3",
                                          "--optimizer", "adam", "--epochs", "2", "--no-pad"};
    auto py = common;
    py.insert(py.begin(), {kPython, kReference + "/torch_global_batches.py"});
    py.insert(py.end(), {"--ranks", "4", "--save-state", dir + "/pytorch.pt"});
    auto ref = t::run(py, cli());
    ASSERT_TRUE(ref.ok()) << ref.describe();
    // Hybrid: 1/T before the shard group's reduce-scatter, then the shards summed across the replicas.
    const std::vector<std::vector<std::string>> strategies{{"fsdp-full"}, {"fsdp-grad-op"}, {"zero1"},
                                                           {"hsdp", "--replicas", "2"},
                                                           {"hsdp-grad-op", "--replicas", "4"}};
    for (const auto& with : strategies) {
      const std::string strategy = with[0];
      const std::string out = dir + "/" + strategy + ".pt";
      std::vector<std::string> ours{GRADSYNC_BIN, "train", "--world-size", "4", "--strategy", strategy,
                                    "--reduction", "global-mean", "--verify-every", "1", "--save-state", out,
                                    "--quiet"};
      ours.insert(ours.end(), with.begin() + 1, with.end());
      if (strategy != "zero1") ours.insert(ours.end(), {"--wrap", "children"});  // several units
      ours.insert(ours.end(), common.begin(), common.end());
      auto r = t::run(ours, cli());
      ASSERT_TRUE(r.ok()) << model << " " << strategy << ": " << r.describe();
      EXPECT_NE(r.err.find("gradsync verify: step 7"), std::string::npos) << r.describe();
      EXPECT_EQ(r.err.find("FAILED"), std::string::npos) << r.describe();
      auto verdict = compare(out, dir + "/pytorch.pt", false);
      EXPECT_TRUE(verdict.ok()) << model << " " << strategy << ": " << verdict.describe();
    }
  }
}

TEST(Verify, PassesOnCorrectRunsAndCatchesAWrongGradientAndADivergentReplica) {
  const std::string dir = make_case(t::make_temp_dir("gradsync-verify"), 60);
  const std::vector<std::string> base{GRADSYNC_BIN, "train", "--model", "mlp:8-16-5", "--data", dir + "/data.pt",
                                      "--global-batch", "12", "--world-size", "3", "--steps", "6", "--verify-every",
                                      "2", "--quiet"};
  for (const char* reduction : {"mean", "sum", "global-mean"}) {
    auto argv = base;
    argv.insert(argv.end(), {"--reduction", reduction, "--no-pad"});
    auto ok = t::run(argv, cli());
    EXPECT_TRUE(ok.ok()) << reduction << ": " << ok.describe();
    EXPECT_NE(ok.err.find("gradsync verify: step 4"), std::string::npos) << ok.describe();
  }
  auto wrong = base;
  wrong.insert(wrong.end(), {"--inject-fault", "grad@2"});
  auto caught = t::run(wrong, cli());
  EXPECT_FALSE(caught.ok());
  EXPECT_FALSE(caught.timed_out);
  EXPECT_NE(caught.err.find("gradient verification failed at step 2"), std::string::npos) << caught.describe();
  EXPECT_NE(caught.err.find("'0.weight'"), std::string::npos) << caught.describe();

  auto diverged = base;
  diverged.insert(diverged.end(), {"--inject-fault", "diverge@4"});
  auto found = t::run(diverged, cli());
  EXPECT_FALSE(found.ok());
  EXPECT_FALSE(found.timed_out);
  EXPECT_NE(found.err.find("'2.bias' differs from rank 0's on rank(s) 2"), std::string::npos) << found.describe();
}

// A sharded engine's gradient is checked whole (its shards' gradients gathered): a wrong shard gradient on rank 0
// is caught, naming a parameter that shard holds.
TEST(Verify, CatchesAWrongShardGradient) {
  const std::string dir = make_case(t::make_temp_dir("gradsync-verify-sharded"), 60);
  for (const char* strategy : {"fsdp-full", "zero1"}) {
    auto caught = t::run({GRADSYNC_BIN, "train", "--model", "mlp:8-16-5", "--data", dir + "/data.pt",
                          "--global-batch", "12", "--world-size", "3", "--steps", "4", "--verify-every", "1",
                          "--strategy", strategy, "--inject-fault", "grad@2", "--quiet"}, cli());
    EXPECT_FALSE(caught.ok()) << strategy;
    EXPECT_FALSE(caught.timed_out) << strategy;
    EXPECT_NE(caught.err.find("gradsync verify: step 1"), std::string::npos) << caught.describe();
    EXPECT_NE(caught.err.find("gradient verification failed at step 2"), std::string::npos) << caught.describe();
    EXPECT_NE(caught.err.find("'0.weight'"), std::string::npos) << caught.describe();
  }
}
