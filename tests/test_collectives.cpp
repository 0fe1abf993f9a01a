// Collectives at world sizes 1-4 with inputs that tell sum, mean and "no reduction happened" apart: rank r
// contributes 2^r, so the sum is 2^N-1, the mean (2^N-1)/N, and an unreduced value 2^r differs from both for
// every N >= 2.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "gradsync/runtime.h"
#include "runtime/shared_segment.h"
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

// Reduction buffers (DDP's buckets): zeros, summed whole and in parts at the same offset on every rank, again and
// again; on MPI with several ranks (and sharing not switched off) they must be shared memory, else plain memory.
void check_reduction_buffers(gradsync::Collectives& comm) {
  const int r = comm.rank();
  const int n = comm.size();
  const double sum = pow2(n) - 1;
  auto bucket = comm.reduction_buffer(1037, torch::kFloat);
  expect_all(bucket, 0, "a new reduction buffer");
  for (int round = 1; round <= 2; ++round) {
    bucket.fill_(round * pow2(r));
    comm.allreduce_sum_async(bucket).wait();
    expect_all(bucket, round * sum, "reduction buffer allreduce");
  }
  auto part = bucket.narrow(0, 101, 333);
  part.fill_(3 * pow2(r));
  comm.allreduce_sum_async(part).wait();
  expect_all(part, 3 * sum, "allreduce of a part of a reduction buffer");
  expect_all(bucket.narrow(0, 0, 101), 2 * sum, "the rest of the buffer, untouched");
  auto wide = comm.reduction_buffer(77, torch::kDouble);
  wide.fill_(pow2(r));
  comm.allreduce_sum_async(wide).wait();
  expect_all(wide, sum, "float64 reduction buffer allreduce");
  const std::string file = t::mapped_file(bucket.data_ptr());
  // Shared unless some rank switched it off (GRADSYNC_TEST_SHARING_OFF_ON_RANK: one rank did, see test_mpi.cpp),
  // or /dev/shm is nearly full (the transport then falls back, rightly).
  const char* sharing = std::getenv("GRADSYNC_MPI_SHARED_BUCKETS");
  const bool off = (sharing && std::string(sharing) == "off") || std::getenv("GRADSYNC_TEST_SHARING_OFF_ON_RANK");
  const bool shared = comm.backend() == gradsync::Backend::Mpi && n > 1 && !off;
  if (shared && t::free_shm_bytes() < (uint64_t{256} << 20)) return;
  WORKER_CHECK((file.find("/dev/shm/gradsync-") == 0) == shared, "reduction buffer mapped from '{}' on {} with {} "
               "rank(s); expected shared memory: {}", file, gradsync::to_string(comm.backend()), n, shared);
  WORKER_CHECK(!shared || file.find("(deleted)") != std::string::npos, "{} still has a name in /dev/shm", file);
}

}  // namespace

GRADSYNC_WORKER(collectives) {
  const char* off_on = std::getenv("GRADSYNC_TEST_SHARING_OFF_ON_RANK");
  const char* this_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (off_on && this_rank && std::string(off_on) == this_rank) setenv("GRADSYNC_MPI_SHARED_BUCKETS", "off", 1);
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

  check_reduction_buffers(comm);
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

namespace {

// A sub-group's collectives over its members only: member world rank q contributes 2^q, so the group's sum is the
// sum of its members' powers and differs from the world's and from any other group's.
void check_group(gradsync::Collectives& g, const std::vector<int>& expected_members, int world_rank) {
  WORKER_CHECK(g.world_ranks() == expected_members, "members {} expected {}", fmt::join(g.world_ranks(), ","),
               fmt::join(expected_members, ","));
  const int index = static_cast<int>(std::find(expected_members.begin(), expected_members.end(), world_rank) -
                                     expected_members.begin());
  WORKER_CHECK(g.rank() == index && g.size() == static_cast<int>(expected_members.size()), "rank {} of {} in {}",
               g.rank(), g.size(), fmt::join(expected_members, ","));
  double sum = 0;
  for (int q : expected_members) sum += pow2(q);
  auto a = torch::full({300}, pow2(world_rank));
  g.allreduce(a, Reduction::Sum);
  expect_all(a, sum, "group allreduce sum");
  auto m = torch::full({300}, pow2(world_rank));
  g.allreduce(m, Reduction::Mean);
  expect_all(m, sum / g.size(), "group allreduce mean", 1e-6);
  auto gathered = torch::empty({g.size() * 2});
  g.allgather_flat(torch::full({2}, pow2(world_rank)), gathered);
  for (int i = 0; i < g.size(); ++i) {
    expect_all(gathered.narrow(0, i * 2, 2), pow2(expected_members[static_cast<size_t>(i)]), "group allgather chunk");
  }
  auto input = torch::empty({g.size() * 3});  // chunk j holds (j+1) 2^q: member j receives (j+1) * sum
  for (int j = 0; j < g.size(); ++j) input.narrow(0, j * 3, 3).fill_((j + 1) * pow2(world_rank));
  auto out = torch::empty({3});
  g.reduce_scatter(input, out, Reduction::Sum);
  expect_all(out, (g.rank() + 1) * sum, "group reduce_scatter sum");
  auto b = torch::full({4}, pow2(world_rank));
  g.broadcast(b, g.size() - 1);
  expect_all(b, pow2(expected_members.back()), "group broadcast from its last member");
}

}  // namespace

// The world split by parity, members ordered by a key that reverses world order; each half split again into
// singletons and pairs; the world's own collectives keep working in between (each group its own channel).
GRADSYNC_WORKER(split_groups) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  auto& comm = world->comm();
  const int r = world->rank(), n = world->size();
  auto half = comm.split(r % 2, n - r, "parity");
  std::vector<int> members;
  for (int q = n - 1; q >= 0; --q) {
    if (q % 2 == r % 2) members.push_back(q);
  }
  check_group(*half, members, r);
  auto w = torch::full({5}, pow2(r));
  comm.allreduce(w, Reduction::Sum);
  expect_all(w, pow2(n) - 1, "world allreduce between splits");
  auto quarter = half->split(r / 2, r, "pair");  // by key r: ascending world rank inside each half
  std::vector<int> inner;
  for (int q = 0; q < n; ++q) {
    if (q % 2 == r % 2 && q / 2 == r / 2) inner.push_back(q);
  }
  check_group(*quarter, inner, r);
  check_group(*half, members, r);  // the outer group still works after its own split
  check_reduction_buffers(*half);  // on MPI a group inside one host keeps DDP's buckets in shared memory
  comm.barrier();
  fmt::print("split ok on rank {} of {} ({})\n", r, n, gradsync::to_string(world->backend()));
  return 0;
}

TEST_P(Collectives, SplitGroupsReduceOverTheirMembersOnly) {
  const int n = GetParam();
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(n, t::worker_argv("split_groups"), opts);
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("split ok"), std::string::npos);
  }
}

// The in-place sum of shared slots, its ranks played one after another in one process: 3 slots, a length that is
// no multiple of the shares' cache-line cut, an offset into the slots, slot k holding k + 1 + i / 1000 at element i
// (so a share summed twice, missed, or read from the wrong element shows).
TEST(SharedSegment, EveryRanksShareSumsEverySlotInRankOrder) {
  const std::string name = fmt::format("/gradsync-test-{}", getpid());
  auto segment = gradsync::SharedSegment::create(name, 1 << 16, 3);
  gradsync::SharedSegment::unlink(name);
  const int64_t count = 5003;
  const size_t offset = 256;
  auto slot = [&](int k) {
    return torch::from_blob(static_cast<char*>(segment->slot(k)) + offset, {count}, torch::kFloat);
  };
  const auto ramp = torch::arange(count, torch::kFloat) / 1000;
  for (int k = 0; k < 3; ++k) slot(k).copy_(ramp + (k + 1));
  const auto before = torch::from_blob(segment->slot(0), {64}, torch::kFloat).clone();
  for (int rank = 0; rank < 3; ++rank) {
    segment->sum_share(offset, count, gradsync::SharedSegment::Element::Float32, rank);
  }
  const auto expected = ((ramp + 1) + (ramp + 2)) + (ramp + 3);
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(torch::equal(slot(k), expected)) << "slot " << k;
  EXPECT_TRUE(torch::equal(torch::from_blob(segment->slot(0), {64}, torch::kFloat), before)) << "before the offset";
}

TEST(SharedSegment, ANameThatExistsOrIsMissingIsAnError) {
  const std::string name = fmt::format("/gradsync-test-twice-{}", getpid());
  auto first = gradsync::SharedSegment::create(name, 4096, 2);
  EXPECT_THROW(gradsync::SharedSegment::create(name, 4096, 2), std::system_error);
  EXPECT_THROW(gradsync::SharedSegment::open(name, 8192, 2), std::system_error);  // smaller than asked
  gradsync::SharedSegment::unlink(name);
  EXPECT_THROW(gradsync::SharedSegment::open(name, 4096, 2), std::system_error);
}

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

// Four ranks split by parity (members in reverse world order); world rank 3 exits: its partner's group allreduce
// fails at once, naming its world rank, its place in the group and the group's members.
GRADSYNC_WORKER(dies_in_group) {
  auto world = gradsync::init({std::chrono::seconds(20), std::nullopt, std::nullopt});
  const int r = world->rank();
  auto half = world->comm().split(r % 2, world->size() - r, "parity");
  if (r == 3) std::_Exit(7);
  auto a = torch::ones({10});
  half->allreduce(a, Reduction::Sum);
  return 0;
}

TEST(Collectives, PeerExitInASubGroupNamesWorldRankAndGroup) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(4, t::worker_argv("dies_in_group"), opts);
  EXPECT_EQ(results[3].exit_code, 7);
  const auto& partner = results[1];
  EXPECT_FALSE(partner.ok());
  EXPECT_FALSE(partner.timed_out) << partner.describe();
  EXPECT_NE(partner.err.find("rank 1 (1 of 2 in the parity group of world ranks 3,1): allreduce #"),
            std::string::npos) << partner.describe();
}

TEST(Collectives, PeerExitFailsTheOtherRankFastInALargeTwoRankAllreduce) {
  expect_survivors_fail_fast(2, {std::to_string(4 << 20)});
}
