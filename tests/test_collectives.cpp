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

// Large buffers, random values: every rank draws every rank's input from the same seeds, so it knows the sum
// exactly as one process computes it (x_0 + x_1 + ...: at two ranks the only order there is). Odd lengths leave
// the two halves and the last segments unequal; two allreduces in flight at once must not mix their messages.
GRADSYNC_WORKER(large_allreduce) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  auto& comm = world->comm();
  const int n = world->size();
  auto inputs = [&](int64_t numel, torch::Dtype dtype, uint64_t seed) {
    std::vector<torch::Tensor> all;
    for (int q = 0; q < n; ++q) {
      torch::manual_seed(seed + static_cast<uint64_t>(q));
      all.push_back(torch::randn({numel}, torch::TensorOptions().dtype(dtype)));
    }
    return all;
  };
  auto exact_sum = [](const std::vector<torch::Tensor>& all) {
    auto s = all[0].clone();
    for (size_t q = 1; q < all.size(); ++q) s.add_(all[q]);
    return s;
  };
  const auto floats = inputs(3'000'001, torch::kFloat, 100);  // 12 MB: several segments per half
  const auto doubles = inputs(600'001, torch::kDouble, 200);  // 4.8 MB
  const auto small = inputs(1000, torch::kFloat, 300);        // far below any pipelining
  auto a = floats[static_cast<size_t>(world->rank())].clone();
  auto b = doubles[static_cast<size_t>(world->rank())].clone();
  auto c = small[static_cast<size_t>(world->rank())].clone();
  auto wa = comm.allreduce_sum_async(a);
  auto wb = comm.allreduce_sum_async(b);
  auto wc = comm.allreduce_sum_async(c);
  wa.wait();
  wb.wait();
  wc.wait();
  if (n == 2) {  // bit for bit; at more ranks the ring adds in its own order
    WORKER_CHECK(torch::equal(a, exact_sum(floats)), "float sum differs by {}",
                 (a - exact_sum(floats)).abs().max().item<double>());
    WORKER_CHECK(torch::equal(b, exact_sum(doubles)), "double sum differs");
    WORKER_CHECK(torch::equal(c, exact_sum(small)), "small sum differs");
  } else {
    WORKER_CHECK(torch::allclose(a, exact_sum(floats), 1e-5, 1e-5), "float sum differs");
    WORKER_CHECK(torch::allclose(b, exact_sum(doubles), 1e-12, 1e-12), "double sum differs");
  }
  fmt::print("large allreduce ok on rank {} of {}\n", world->rank(), n);
  return 0;
}

TEST_P(Collectives, LargeAllreducesInFlightTogetherSumExactly) {
  const int n = GetParam();  // a world of one leaves every value as it was
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(90);
  auto results = t::run_ranks(n, t::worker_argv("large_allreduce"), opts);
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("large allreduce ok"), std::string::npos);
  }
}

// args: the element count (10 by default; 4 Mi elements take the two-rank allreduce on Gloo).
GRADSYNC_WORKER(dies_mid_allreduce) {
  auto world = gradsync::init({std::chrono::seconds(20), std::nullopt, std::nullopt});
  auto a = torch::ones({args.empty() ? int64_t{10} : std::stoll(args[0])});
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

namespace {

// The survivors of a rank that exits between two allreduces fail at once, naming themselves and the operation.
void expect_survivors_fail_fast(int world_size, const std::vector<std::string>& args) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(world_size, t::worker_argv("dies_mid_allreduce", args), opts);
  EXPECT_EQ(results[1].exit_code, 7);
  for (int r = 0; r < world_size; ++r) {
    if (r == 1) continue;
    const auto& res = results[static_cast<size_t>(r)];
    EXPECT_FALSE(res.ok());
    EXPECT_FALSE(res.timed_out) << res.describe();
    EXPECT_NE(res.err.find(fmt::format("rank {} of {}: allreduce #2", r, world_size)), std::string::npos)
        << res.describe();
    auto at = res.err.find("failed after ");
    ASSERT_NE(at, std::string::npos) << res.describe();
    EXPECT_LT(std::stod(res.err.substr(at + 13)), 2.0);  // a dead peer is noticed at once, not at the 20 s timeout
  }
}

}  // namespace

TEST(Collectives, PeerExitFailsSurvivorsFastNamingTheirRankAndOperation) { expect_survivors_fail_fast(3, {}); }

TEST(Collectives, PeerExitFailsTheOtherRankFastInALargeTwoRankAllreduce) {
  expect_survivors_fail_fast(2, {std::to_string(4 << 20)});
}
