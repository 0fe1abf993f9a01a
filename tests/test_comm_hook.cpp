// Tests for include/gradsync/comm_hook.h: each hook's gradient equals its formula, computed in one process from
// every rank's local gradient (rank r's input is a function of r), on gloo and on mpi. allreduce() gives DDP's
// default mean; fp16 and bf16 round the inputs, the quotient and the sum in their type and so differ from the
// float32 mean by about their precision -- and not more.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/comm_hook.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "support/subprocess.h"
#include "support/worker.h"

namespace {

namespace t = gradsync::test;

torch::nn::Linear make_layer() {
  torch::manual_seed(3);
  return torch::nn::Linear(torch::nn::LinearOptions(16, 8).bias(false));
}

// Rank r's local gradient of sum(layer(x_r)^2) / 2 (no communication).
torch::Tensor local_gradient(int rank) {
  auto layer = make_layer();
  torch::manual_seed(100 + rank);
  const auto x = torch::randn({4, 16}) * (1 + rank);
  (layer->forward(x).pow(2).sum() / 2).backward();
  return layer->weight.grad().clone();
}

// What the hook should produce for `world` ranks: compress, divide in the compressed type, sum, decompress.
torch::Tensor expected(const std::string& hook, int world) {
  if (hook == "allreduce" || hook == "none") {
    auto sum = torch::zeros({8, 16});
    for (int r = 0; r < world; ++r) sum += local_gradient(r) / world;
    return sum;
  }
  const auto type = hook == "fp16" ? torch::kHalf : torch::kBFloat16;
  auto sum = torch::zeros({8, 16});
  for (int r = 0; r < world; ++r) sum += local_gradient(r).to(type).div_(world).to(torch::kFloat);
  return sum.to(type).to(torch::kFloat);  // two ranks: one rounding of the sum, as every backend does it
}

// args: hook (none|allreduce|fp16|bf16)
GRADSYNC_WORKER(comm_hook) {
  torch::set_num_threads(1);
  auto world = gradsync::init({std::chrono::seconds(60), std::nullopt, std::nullopt});
  auto layer = make_layer();
  gradsync::DistributedDataParallel ddp(layer, world);
  const std::string hook = args.at(0);
  if (hook == "allreduce") ddp.register_comm_hook(gradsync::hooks::allreduce());
  if (hook == "fp16") ddp.register_comm_hook(gradsync::hooks::fp16_compress());
  if (hook == "bf16") ddp.register_comm_hook(gradsync::hooks::bf16_compress());
  torch::manual_seed(100 + world->rank());
  const auto x = torch::randn({4, 16}) * (1 + world->rank());
  (ddp.forward(x).pow(2).sum() / 2).backward();
  const auto got = layer->weight.grad();
  const auto want = expected(hook, world->size());
  WORKER_CHECK(torch::equal(got, want), "rank {}: {} hook: max |got - expected| = {}", world->rank(), hook,
               (got - want).abs().max().item<double>());
  // The compressed hooks really compress: their result is not the float32 mean, but close to it.
  const auto mean = expected("none", world->size());
  const double relative = ((got - mean).abs().max() / mean.abs().max()).item<double>();
  const double precision = hook == "fp16" ? 1e-3 : hook == "bf16" ? 1e-2 : 0;
  WORKER_CHECK(hook == "none" || hook == "allreduce" ? relative == 0 : relative > 0 && relative < precision,
               "rank {}: {} hook differs from the float32 mean by {}", world->rank(), hook, relative);
  return 0;
}

class CommHook : public testing::TestWithParam<std::string> {};

TEST_P(CommHook, GradientIsTheHooksFormulaOnGloo) {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(60);
  const auto ranks = t::run_ranks(2, t::worker_argv("comm_hook", {GetParam()}), o);
  for (size_t r = 0; r < ranks.size(); ++r) EXPECT_TRUE(ranks[r].ok()) << "rank " << r << ": " << ranks[r].describe();
}

TEST_P(CommHook, GradientIsTheHooksFormulaOnMpi) {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(60);
  const auto r = t::run_mpi_ranks(2, t::worker_argv("comm_hook", {GetParam()}), o);
  EXPECT_TRUE(r.ok()) << r.describe();
}

INSTANTIATE_TEST_SUITE_P(Hooks, CommHook, testing::Values("none", "allreduce", "fp16", "bf16"),
                         [](const testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(CommHookRegistration, TwiceOrEmptyIsAConfigError) {
  auto world = gradsync::init({std::chrono::seconds(10), std::nullopt, std::nullopt});
  auto layer = make_layer();
  gradsync::DistributedDataParallel ddp(layer, world);
  EXPECT_THROW(ddp.register_comm_hook(nullptr), gradsync::ConfigError);
  ddp.register_comm_hook(gradsync::hooks::allreduce());
  EXPECT_THROW(ddp.register_comm_hook(gradsync::hooks::fp16_compress()), gradsync::ConfigError);
}

}  // namespace
