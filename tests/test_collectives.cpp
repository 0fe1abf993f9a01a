// Collectives at world sizes 1-4 with inputs that tell sum, mean and "no reduction happened" apart: rank r
// contributes 2^r, so the sum is 2^N-1, the mean (2^N-1)/N, and an unreduced value 2^r differs from both for
// every N >= 2.
#include <cmath>

#include <gtest/gtest.h>

#include "gradsync/runtime.h"
#include "support/subprocess.h"
#include "support/worker.h"

using gradsync::Reduction;
namespace t = gradsync::test;

namespace {

double pow2(int r) { return std::ldexp(1.0, r); }

void expect_all(const torch::Tensor& t, double value, const char* what, double rtol = 0) {
  auto expected = torch::full_like(t, value);
  // Sums of powers of two are exact in float; a mean multiplies by 1/N first, so allow rounding there.
  WORKER_CHECK(torch::allclose(t, expected, rtol, rtol > 0 ? 1e-7 : 0), "{}: got {} expected {}", what,
               t.flatten()[0].item<double>(), value);
}

}  // namespace

GRADSYNC_WORKER(collectives) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  auto& comm = world->comm();
  const int r = world->rank();
  const int n = world->size();
  const double sum = pow2(n) - 1;

  auto a = torch::full({1000}, pow2(r));
  comm.allreduce(a, Reduction::Sum);
  expect_all(a, sum, "allreduce sum");

  auto m = torch::full({1000}, pow2(r));
  comm.allreduce(m, Reduction::Mean);
  expect_all(m, sum / n, "allreduce mean", 1e-6);

  auto b = torch::full({7}, pow2(r));
  comm.broadcast(b, n - 1);
  expect_all(b, pow2(n - 1), "broadcast from the last rank");

  auto gathered = torch::empty({n * 3});
  comm.allgather_flat(torch::full({3}, pow2(r)), gathered);
  for (int q = 0; q < n; ++q) expect_all(gathered.narrow(0, q * 3, 3), pow2(q), "allgather chunk");

  // Chunk j of rank r's input holds (j+1) * 2^r, so rank j's reduce-scatter output is (j+1) * (2^N-1).
  auto input = torch::empty({n * 5});
  for (int j = 0; j < n; ++j) input.narrow(0, j * 5, 5).fill_((j + 1) * pow2(r));
  auto out = torch::empty({5});
  comm.reduce_scatter(input, out, Reduction::Sum);
  expect_all(out, (r + 1) * sum, "reduce_scatter sum");
  comm.reduce_scatter(input, out, Reduction::Mean);
  expect_all(out, (r + 1) * sum / n, "reduce_scatter mean", 1e-6);

  auto strings = comm.allgather_strings(std::string(static_cast<size_t>(r + 1), 'x'));
  for (int q = 0; q < n; ++q) WORKER_CHECK(strings[static_cast<size_t>(q)].size() == static_cast<size_t>(q + 1), "");

  comm.barrier();
  fmt::print("collectives ok on rank {} of {} ({})\n", r, n, gradsync::to_string(world->backend()));
  return 0;
}

class Collectives : public testing::TestWithParam<int> {};

TEST_P(Collectives, SumMeanBroadcastGatherScatterAreExact) {
  const int n = GetParam();
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(n, t::worker_argv("collectives"), opts);
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("collectives ok"), std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, testing::Values(1, 2, 3, 4));

GRADSYNC_WORKER(dies_mid_allreduce) {
  auto world = gradsync::init({std::chrono::seconds(20), std::nullopt, std::nullopt});
  auto a = torch::ones({10});
  world->comm().allreduce(a, Reduction::Sum);
  if (world->rank() == 1) std::_Exit(7);
  const auto start = std::chrono::steady_clock::now();
  try {
    world->comm().allreduce(a, Reduction::Sum);
  } catch (const std::exception&) {
    fmt::print(stderr, "failed after {:.3f} s\n",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    throw;
  }
  return 0;
}

TEST(Collectives, PeerExitFailsSurvivorsFastNamingTheirRankAndOperation) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(3, t::worker_argv("dies_mid_allreduce"), opts);
  EXPECT_EQ(results[1].exit_code, 7);
  for (int r : {0, 2}) {
    const auto& res = results[static_cast<size_t>(r)];
    EXPECT_FALSE(res.ok());
    EXPECT_FALSE(res.timed_out) << res.describe();
    EXPECT_NE(res.err.find(fmt::format("rank {} of 3: allreduce #2", r)), std::string::npos) << res.describe();
    auto at = res.err.find("failed after ");
    ASSERT_NE(at, std::string::npos) << res.describe();
    EXPECT_LT(std::stod(res.err.substr(at + 13)), 2.0);  // a dead peer is noticed at once, not at the 20 s timeout
  }
}
