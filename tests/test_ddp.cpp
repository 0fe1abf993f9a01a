// DistributedDataParallel tests, in the style of PyTorch's own: every rank trains a DDP model on its share of
// each global batch AND a local replica on the whole global batch, and the parameters must agree after every
// step (data differs every step). Plus: sum vs mean told apart, unused parameters, buffers, model mismatch,
// gradients as bucket views, and communication overlapping backward.
#include <cmath>

#include <gtest/gtest.h>

#include "gradsync/engine.h"
#include "gradsync/ddp.h"
#include "gradsync/state_dict.h"
#include "support/subprocess.h"
#include "support/worker.h"

using gradsync::DdpOptions;
using gradsync::DistributedDataParallel;
using gradsync::Reduction;
namespace t = gradsync::test;
namespace nn = torch::nn;

namespace {

std::shared_ptr<gradsync::World> join() { return gradsync::init({std::chrono::seconds(60), std::nullopt, std::nullopt}); }

// Runs the worker scenario `name` on n ranks, each given at most 60 s.
std::vector<t::ProcessResult> run_worker(int n, const std::string& name, const std::vector<std::string>& args = {}) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  return t::run_ranks(n, t::worker_argv(name, args), opts);
}

nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return nn::Sequential(nn::Linear(6, 16), nn::ReLU(), nn::Linear(16, 8), nn::ReLU(), nn::Linear(8, 3));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, nn::Sequential& model) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

double max_relative_difference(nn::Module& a, nn::Module& b) {
  auto sa = gradsync::state_dict(a);
  auto sb = gradsync::state_dict(b);
  double worst = 0;
  for (size_t i = 0; i < sa.size(); ++i) {
    auto x = sa[i].second.to(torch::kDouble);
    auto y = sb[i].second.to(torch::kDouble);
    double scale = std::max(y.abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (x - y).abs().max().item<double>() / scale);
  }
  return worst;
}

// Global batch of step s: the same on every rank, new every step.
std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, int64_t size) {
  torch::manual_seed(1000 + static_cast<uint64_t>(step));
  return {torch::randn({size, 6}), torch::randint(0, 3, {size})};
}

int arg_int(const std::vector<std::string>& args, size_t i, int fallback) {
  return args.size() > i ? std::stoi(args[i]) : fallback;
}

}  // namespace

// args: K (micro-batches), optimizer (sgd|adam), bucket_view (0|1)
GRADSYNC_WORKER(ddp_equivalence) {
  auto world = join();
  const int n = world->size();
  const int r = world->rank();
  const int k = arg_int(args, 0, 1);
  const std::string opt_kind = args.size() > 1 ? args[1] : "sgd";
  DdpOptions options;
  options.gradient_as_bucket_view(arg_int(args, 2, 0) == 1);
  options.first_bucket_bytes(256);  // several buckets even for a tiny model
  options.bucket_cap_mb(1024.0 / (1 << 20));

  auto local = make_mlp(0);
  auto replica = make_mlp(static_cast<uint64_t>(r) * 7919);  // differs per rank: DDP must broadcast rank 0's
  DistributedDataParallel ddp(replica, world, options);
  WORKER_CHECK(max_relative_difference(*replica, *local) == 0, "parameters not broadcast from rank 0");
  auto local_opt = make_optimizer(opt_kind, local);
  auto ddp_opt = make_optimizer(opt_kind, replica);

  const int64_t b = 4;  // per-rank micro-batch
  for (int64_t step = 0; step < 5; ++step) {
    auto [x, y] = global_batch(step, b * k * n);
    local_opt->zero_grad();
    torch::nn::functional::cross_entropy(local->forward(x), y).backward();
    local_opt->step();

    ddp.zero_grad();
    auto rank_x = x.narrow(0, r * b * k, b * k);
    auto rank_y = y.narrow(0, r * b * k, b * k);
    gradsync::accumulate(ddp, k, [&](int64_t m) {
      return torch::nn::functional::cross_entropy(ddp.forward(rank_x.narrow(0, m * b, b)), rank_y.narrow(0, m * b, b));
    });
    ddp_opt->step();
    double diff = max_relative_difference(*replica, *local);
    WORKER_CHECK(diff < 1e-5, "step {}: DDP on {} ranks x {} micro-batches differs from one process by {}", step, n,
                 k, diff);
  }
  fmt::print("equivalent on rank {} of {}\n", r, n);
  return 0;
}

struct DdpCase {
  int world;
  int k;
  std::string optimizer;
  int bucket_view;
};

void PrintTo(const DdpCase& c, std::ostream* os) {
  *os << fmt::format("N={} K={} {}{}", c.world, c.k, c.optimizer, c.bucket_view ? " bucket-view" : "");
}

class DdpEquivalence : public testing::TestWithParam<DdpCase> {};

TEST_P(DdpEquivalence, MatchesOneProcessOnTheGlobalBatchAfterEveryStep) {
  const auto& c = GetParam();
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(120);
  auto results = t::run_ranks(c.world, t::worker_argv("ddp_equivalence", {std::to_string(c.k), c.optimizer,
                                                                          std::to_string(c.bucket_view)}), opts);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DdpEquivalence,
    testing::Values(DdpCase{1, 1, "sgd", 0}, DdpCase{2, 1, "sgd", 0}, DdpCase{3, 1, "adam", 0},
                    DdpCase{4, 1, "sgd", 0}, DdpCase{1, 3, "adam", 0}, DdpCase{2, 2, "sgd", 0},
                    DdpCase{3, 2, "adam", 1}, DdpCase{4, 2, "sgd", 1}),
    [](const testing::TestParamInfo<DdpCase>& info) {
      return fmt::format("N{}_K{}_{}{}", info.param.world, info.param.k, info.param.optimizer,
                         info.param.bucket_view ? "_bucketview" : "");
    });

// Rank r's loss is 2^r * sum(w): its gradient is 2^r everywhere, so mean = (2^N-1)/N, sum = 2^N-1.
GRADSYNC_WORKER(ddp_sum_vs_mean) {
  auto world = join();
  const Reduction reduction = gradsync::parse_reduction(args.at(0));
  auto model = nn::Linear(nn::LinearOptions(4, 1).bias(false));
  DdpOptions options;
  options.reduction(reduction);
  DistributedDataParallel ddp(model, world, options);
  auto x = torch::full({1, 4}, std::ldexp(1.0, world->rank()));
  ddp.forward(x).sum().backward();
  const double sum = std::ldexp(1.0, world->size()) - 1;
  const double expected = reduction == Reduction::Sum ? sum : sum / world->size();
  auto grad = model->weight.grad();
  WORKER_CHECK(torch::allclose(grad, torch::full_like(grad, expected), 1e-6, 0), "{}: grad {} expected {}",
               args.at(0), grad[0][0].item<double>(), expected);
  fmt::print("grad {}\n", grad[0][0].item<double>());
  return 0;
}

TEST(Ddp, MeanAndSumAreToldApart) {
  for (const char* reduction : {"mean", "sum"}) {
    auto results = run_worker(3, "ddp_sum_vs_mean", {reduction});
    for (const auto& r : results) ASSERT_TRUE(r.ok()) << reduction << ": " << r.describe();
  }
}

// A model whose second head is used only when asked: args: find_unused (0|1), who uses the head ("none", "odd")
struct TwoHeadsImpl : nn::Module {
  TwoHeadsImpl() {
    torch::manual_seed(3);
    body = register_module("body", nn::Linear(4, 4));
    head = register_module("head", nn::Linear(4, 2));
    spare = register_module("spare", nn::Linear(4, 2));
  }
  torch::Tensor forward(torch::Tensor x, bool use_spare) {
    auto h = torch::relu(body->forward(x));
    return use_spare ? head->forward(h) + spare->forward(h) : head->forward(h);
  }
  nn::Linear body{nullptr}, head{nullptr}, spare{nullptr};
};
TORCH_MODULE(TwoHeads);

GRADSYNC_WORKER(ddp_unused) {
  auto world = join();
  DdpOptions options;
  options.find_unused_parameters(args.at(0) == "1");
  const bool use_spare = args.at(1) == "odd" && world->rank() % 2 == 1;
  TwoHeads model;
  DistributedDataParallel ddp(model, world, options);
  auto x = torch::ones({2, 4}) * (world->rank() + 1);
  ddp.forward_with([&] { return model->forward(x, use_spare); }).sum().backward();
  auto grad = model->spare->weight.grad();
  if (args.at(1) == "none") {
    WORKER_CHECK(!grad.defined(), "a parameter unused on every rank must keep .grad undefined");
  } else {
    // Used on odd ranks only: the mean gradient is (sum over odd ranks q of g_q) / N, even ranks adding zeros.
    WORKER_CHECK(grad.defined(), "a parameter used on some rank must get a gradient on every rank");
    TwoHeads reference;  // same seed, same initial parameters as every rank's model
    for (int q = 1; q < world->size(); q += 2) {
      reference->forward(torch::ones({2, 4}) * (q + 1), true).sum().backward();
    }
    auto expected = reference->spare->weight.grad() / world->size();
    WORKER_CHECK(torch::allclose(grad, expected, 1e-5, 1e-7), "spare.weight grad {} expected {}",
                 grad.sum().item<double>(), expected.sum().item<double>());
  }
  fmt::print("unused handled on rank {}\n", world->rank());
  return 0;
}

// A parameter used in a no_sync micro-step and unused on every rank in the synchronised one: as in PyTorch, each
// rank's accumulated gradient is reduced (the mean over ranks of their micro-step gradients), not replaced by zeros.
GRADSYNC_WORKER(ddp_unused_after_no_sync) {
  auto world = join();
  DdpOptions options;
  options.find_unused_parameters(true);
  TwoHeads model;
  DistributedDataParallel ddp(model, world, options);
  auto x = torch::ones({2, 4}) * (world->rank() + 1);
  {
    auto guard = ddp.no_sync();
    ddp.forward_with([&] { return model->forward(x, true); }).sum().backward();
  }
  ddp.forward_with([&] { return model->forward(x, false); }).sum().backward();
  TwoHeads reference;  // same seed, same initial parameters as every rank's model
  for (int q = 0; q < world->size(); ++q) reference->forward(torch::ones({2, 4}) * (q + 1), true).sum().backward();
  auto expected = reference->spare->weight.grad() / world->size();
  auto grad = model->spare->weight.grad();
  WORKER_CHECK(grad.defined() && torch::allclose(grad, expected, 1e-5, 1e-7), "spare.weight grad {} expected {}",
               grad.defined() ? grad.sum().item<double>() : -1.0, expected.sum().item<double>());
  return 0;
}

TEST(Ddp, AGradientAccumulatedUnderNoSyncIsReducedWhenTheSyncedStepLeavesItUnused) {
  auto results = run_worker(3, "ddp_unused_after_no_sync");
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
}

TEST(Ddp, UnusedParameterWithoutFindUnusedFailsNamingItInsteadOfHanging) {
  auto results = run_worker(2, "ddp_unused", {"0", "none"});
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find("spare.weight"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("find_unused_parameters"), std::string::npos) << r.describe();
  }
}

TEST(Ddp, UnusedParametersWithFindUnused) {
  for (const char* who : {"none", "odd"}) {
    auto results = run_worker(3, "ddp_unused", {"1", who});
    for (const auto& r : results) ASSERT_TRUE(r.ok()) << who << ": " << r.describe();
  }
}

// Every rank builds the model with its own seed; DDP must make parameters and buffers equal to rank 0's, and a
// shape that differs on one rank must fail on every rank, naming the parameter and the ranks.
GRADSYNC_WORKER(ddp_mismatch) {
  auto world = join();
  const int64_t width = world->rank() == 1 ? 5 : 4;
  auto model = nn::Sequential(nn::Linear(3, width), nn::ReLU(), nn::Linear(width, 2));
  DistributedDataParallel ddp(model, world);
  return 0;
}

TEST(Ddp, ModelMismatchFailsOnEveryRankNamingParameterAndRanks) {
  auto results = run_worker(3, "ddp_mismatch");
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find("0.weight"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("[5, 3]"), std::string::npos) << r.describe();
  }
}

// A minimal batch norm with buffers (running_mean, running_var, num_batches_tracked) that Sequential can hold.
struct SequentialBatchNormImpl : nn::Module {
  explicit SequentialBatchNormImpl(int64_t features) {
    weight = register_parameter("weight", torch::ones({features}));
    bias = register_parameter("bias", torch::zeros({features}));
    running_mean = register_buffer("running_mean", torch::zeros({features}));
    running_var = register_buffer("running_var", torch::ones({features}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(), 0.1, 1e-5, false);
  }
  torch::Tensor weight, bias, running_mean, running_var;
};
TORCH_MODULE(SequentialBatchNorm);

GRADSYNC_WORKER(ddp_buffers) {
  auto world = join();
  torch::manual_seed(static_cast<uint64_t>(world->rank()) + 11);
  auto model = nn::Sequential(nn::Linear(3, 4), SequentialBatchNorm(4), nn::ReLU(), nn::Linear(4, 2));
  // Distinct buffers per rank before wrapping.
  auto bn = model->ptr<SequentialBatchNormImpl>(1);
  {
    torch::NoGradGuard no_grad;
    bn->running_mean.fill_(world->rank() + 1.0);
  }
  DistributedDataParallel ddp(model, world);
  auto gather_all = [&] {
    std::string mine;
    for (const auto& [name, tensor] : gradsync::state_dict(*model)) {
      auto flat = tensor.to(torch::kDouble).flatten();
      for (int64_t i = 0; i < flat.numel(); ++i) mine += fmt::format("{}:{:.17g};", name, flat[i].item<double>());
    }
    return world->comm().allgather_strings(mine);
  };
  auto states = gather_all();
  for (const auto& s : states) WORKER_CHECK(s == states[0], "parameters/buffers differ from rank 0 after wrapping");
  // One synced step with rank-dependent data: running stats diverge, and the next forward re-broadcasts
  // rank 0's buffers before computing (PyTorch's broadcast_buffers).
  auto x = torch::randn({8, 3}) + world->rank();
  ddp.forward(x).sum().backward();
  auto before = bn->running_mean.clone();
  auto rank0_before = before.clone();
  world->comm().broadcast(rank0_before, 0);
  {
    torch::NoGradGuard no_grad;
    bn->eval();
    ddp.forward(x);  // eval forward: no running-stat update, buffers broadcast first
  }
  WORKER_CHECK(torch::equal(bn->running_mean, rank0_before), "buffers were not broadcast from rank 0");
  fmt::print("buffers ok\n");
  return 0;
}

TEST(Ddp, ParametersAndBuffersFollowRankZero) {
  auto results = run_worker(3, "ddp_buffers");
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
}

// A deep-ish model with tiny buckets: bucket 0 (the last layers) must be launched while backward is still
// computing the first layers' gradients.
GRADSYNC_WORKER(ddp_overlap) {
  auto world = join();
  torch::manual_seed(0);
  nn::Sequential model;
  for (int i = 0; i < 8; ++i) {
    model->push_back(nn::Linear(256, 256));
    model->push_back(nn::ReLU());
  }
  DdpOptions options;
  options.first_bucket_bytes(256 * 256 * 4);
  options.bucket_cap_mb(256.0 * 256 * 4 / (1 << 20));
  DistributedDataParallel ddp(model, world, options);
  auto x = torch::randn({64, 256});
  for (int it = 0; it < 3; ++it) ddp.forward(x).sum().backward();
  auto timeline = ddp.last_timeline();
  WORKER_CHECK(ddp.bucket_count() >= 4, "expected several buckets, got {}", ddp.bucket_count());
  WORKER_CHECK(timeline.bucket_launch_ms.size() == ddp.bucket_count(), "not every bucket launched");
  fmt::print("bucket launches (ms since first gradient): {:.3f}; last gradient ready at {:.3f} ms; wait began at "
             "{:.3f} ms\n", fmt::join(timeline.bucket_launch_ms, ", "), timeline.last_hook_ms, timeline.finalize_ms);
  WORKER_CHECK(timeline.bucket_launch_ms.front() < timeline.last_hook_ms,
               "bucket 0 launched at {} ms, after the last gradient ({} ms): no overlap",
               timeline.bucket_launch_ms.front(), timeline.last_hook_ms);
  return 0;
}

TEST(Ddp, EarlyBucketAllreduceStartsBeforeBackwardEnds) {
  auto results = run_worker(2, "ddp_overlap");
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    std::cout << r.out;
  }
}

// DDP's zero_grad() releases the gradients (where Optimizer::zero_grad() throws on bucket views), and a second
// step after it gives the same gradient as the first, which is then the bucket itself. args: bucket_view (0|1)
GRADSYNC_WORKER(ddp_zero_grad_releases) {
  auto world = join();
  auto model = make_mlp(0);
  DdpOptions options;
  options.gradient_as_bucket_view(args.at(0) == "1");
  DistributedDataParallel ddp(model, world, options);
  auto weight = model[0]->as<nn::Linear>()->weight;
  auto x = torch::randn({4, 6});
  ddp.forward(x).sum().backward();
  auto first = weight.grad().clone();
  const void* storage = nullptr;  // the bucket's, from the second step on (the buckets are rebuilt before it)
  for (int step = 1; step < 3; ++step) {
    ddp.zero_grad();
    WORKER_CHECK(!weight.grad().defined(), "zero_grad() left .grad defined");
    ddp.forward(x).sum().backward();
    WORKER_CHECK(torch::equal(first, weight.grad()), "gradient of step {} differs", step);
    WORKER_CHECK(!options.gradient_as_bucket_view() || step == 1 || weight.grad().data_ptr() == storage,
                 "with bucket views .grad must be the bucket again after a backward");
    storage = weight.grad().data_ptr();
  }
  return 0;
}

// Runs a worker that takes bucket_view (0|1) on 2 ranks, without and with bucket views.
static void expect_ok_without_and_with_bucket_views(const char* worker) {
  for (const char* view : {"0", "1"}) {
    auto results = run_worker(2, worker, {view});
    for (const auto& r : results) ASSERT_TRUE(r.ok()) << "bucket view " << view << ": " << r.describe();
  }
}

TEST(Ddp, ZeroGradReleasesGradientsAndTheNextBackwardRefillsThem) {
  expect_ok_without_and_with_bucket_views("ddp_zero_grad_releases");
}

// A parameter used in one step and unused on every rank in the next gets zeros after that backward, as zeroing in
// place would leave (PyTorch 1.13's zero_grad()), though zero_grad() released it: an optimizer with momentum or
// weight decay still steps it, as PyTorch's does. args: bucket_view (0|1)
GRADSYNC_WORKER(ddp_released_then_unused) {
  auto world = join();
  DdpOptions options;
  options.find_unused_parameters(true).gradient_as_bucket_view(args.at(0) == "1");
  TwoHeads model;
  DistributedDataParallel ddp(model, world, options);
  auto x = torch::ones({2, 4}) * (world->rank() + 1);
  ddp.forward_with([&] { return model->forward(x, true); }).sum().backward();
  ddp.zero_grad();
  ddp.forward_with([&] { return model->forward(x, false); }).sum().backward();
  auto grad = model->spare->weight.grad();
  WORKER_CHECK(grad.defined() && grad.abs().sum().item<double>() == 0, "spare.weight must hold zeros, has {}",
               grad.defined() ? grad.abs().sum().item<double>() : -1.0);
  return 0;
}

TEST(Ddp, AReleasedGradientOfAParameterUnusedEverywhereComesBackAsZeros) {
  expect_ok_without_and_with_bucket_views("ddp_released_then_unused");
}
