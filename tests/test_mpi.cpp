// The mpi backend (src/runtime/mpi_transport.cpp): which backend a launcher's environment selects, the collectives
// exact under mpirun, every engine's training loop equal to one process on the global batch (test_engine.cpp's
// scenario), `gradsync launch --backend mpi`, and failures: a rank that exits stops the job at once, a rank that
// stalls makes the others fail at their timeout naming rank, operation and backend. Parity with PyTorch on this
// backend is in test_parity.cpp and test_sharded_parity.cpp.
#include <cmath>

#include <gtest/gtest.h>

#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "support/env_of.h"
#include "support/error_of.h"
#include "support/subprocess.h"
#include "support/worker.h"

namespace t = gradsync::test;
using gradsync::test::env_of;
using gradsync::Backend;
using gradsync::read_launch_env;

namespace {

const std::map<std::string, std::string> kOpenMpi{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};

t::CommandOptions within(int seconds) {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(seconds);
  return o;
}

}  // namespace

TEST(Backend, MpirunSelectsMpiWithoutAStoreAndTorchrunSelectsGloo) {
  auto mpi = read_launch_env(env_of(kOpenMpi));
  EXPECT_EQ(mpi.backend, Backend::Mpi);
  EXPECT_TRUE(mpi.master_addr.empty());
  auto torchrun = read_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                          {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(torchrun.backend, Backend::Gloo);
  auto chosen = read_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"GRADSYNC_BACKEND", "mpi"}}));
  EXPECT_EQ(chosen.backend, Backend::Mpi);
}

TEST(Backend, GlooUnderMpirunStillNeedsAStoreAndBadNamesAreRefused) {
  auto with_gloo = kOpenMpi;
  with_gloo["GRADSYNC_BACKEND"] = "gloo";
  const std::string no_store = t::error_of<gradsync::ConfigError>([&] { read_launch_env(env_of(with_gloo)); });
  EXPECT_NE(no_store.find("MASTER_ADDR is not set"), std::string::npos) << no_store;
  auto bad = kOpenMpi;
  bad["GRADSYNC_BACKEND"] = "nccl";
  const std::string unknown = t::error_of<gradsync::ConfigError>([&] { read_launch_env(env_of(bad)); });
  EXPECT_NE(unknown.find("GRADSYNC_BACKEND='nccl' is not a backend; expected gloo or mpi"), std::string::npos)
      << unknown;
}

class MpiCollectives : public testing::TestWithParam<int> {};

// The worker of test_collectives.cpp: rank r contributes 2^r, so sum, mean and no reduction differ.
TEST_P(MpiCollectives, SumMeanBroadcastGatherScatterAreExact) {
  const int n = GetParam();
  auto r = t::run_mpi_ranks(n, t::worker_argv("collectives"), within(60));
  ASSERT_TRUE(r.ok()) << r.describe();
  for (int rank = 0; rank < n; ++rank) {
    EXPECT_NE(r.out.find(fmt::format("collectives ok on rank {} of {} (mpi)", rank, n)), std::string::npos) << r.out;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MpiCollectives, testing::Values(1, 2, 3, 4));

// The split worker of test_collectives.cpp: MPI_Comm_split groups, nested, reduce over their members only.
TEST(MpiCollectives, SplitGroupsReduceOverTheirMembersOnly) {
  for (int n : {3, 4}) {
    auto r = t::run_mpi_ranks(n, t::worker_argv("split_groups"), within(60));
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find(fmt::format("split ok on rank {} of {} (mpi)", n - 1, n)), std::string::npos) << r.out;
  }
}

// GRADSYNC_MPI_SHARED_BUCKETS=off on one rank only (rank 1 sets it before init()): every rank must agree on plain
// memory for reduction buffers (the worker checks where they live) and get the same sums; a value that is neither
// on nor off is refused, naming it.
TEST(MpiCollectives, SharedBucketsSwitchedOffOnOneRankGiveTheSameSumsAndBadValuesAreRefused) {
  auto off = within(60);
  off.env = {{"GRADSYNC_TEST_SHARING_OFF_ON_RANK", "1"}};
  auto r = t::run_mpi_ranks(3, t::worker_argv("collectives"), off);
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("collectives ok on rank 2 of 3 (mpi)"), std::string::npos) << r.out;
  auto bad = within(60);
  bad.env = {{"GRADSYNC_MPI_SHARED_BUCKETS", "yes"}};
  auto refused = t::run_mpi_ranks(2, t::worker_argv("collectives"), bad);
  EXPECT_FALSE(refused.ok());
  const std::string said = refused.out + refused.err;
  EXPECT_NE(said.find("GRADSYNC_MPI_SHARED_BUCKETS='yes'; expected on or off"), std::string::npos) << said;
}

GRADSYNC_WORKER(mpi_stalled_peer) {
  gradsync::InitOptions options;
  options.timeout = std::chrono::seconds(2);
  auto world = gradsync::init(options);
  auto a = torch::ones({10});
  world->comm().allreduce(a, gradsync::Reduction::Sum);
  if (world->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));  // stalls, never arrives
  world->comm().allreduce(a, gradsync::Reduction::Sum);
  return 0;
}

TEST(MpiFaults, AStalledRankFailsTheOthersAtTheirTimeoutAndMpirunStopsTheJob) {
  auto r = t::run_mpi_ranks(2, t::worker_argv("mpi_stalled_peer"), within(60));
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_LT(r.seconds, 20.0) << r.describe();  // 2 s timeout, then mpirun ends the stalled rank too
  EXPECT_NE(r.err.find("rank 0 of 2: allreduce #2 (sum), 10 x Float on mpi failed: MPI operation not finished "
                       "after the 2000 ms timeout"), std::string::npos) << r.describe();
}

TEST(MpiFaults, ARankThatExitsStopsTheJobAtOnce) {
  auto r = t::run_mpi_ranks(3, t::worker_argv("dies_mid_allreduce"), within(60));
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_LT(r.seconds, 15.0) << r.describe();  // not the survivors' 20 s timeout
  EXPECT_NE((r.out + r.err).find("Exit code:    7"), std::string::npos) << r.describe();  // mpirun names it
}

// Every rank's own error between collectives (a degenerate batch, a bad file) unwinds through its World: the
// transport is destroyed with an exception in flight, its worker thread detached (it might be stuck in MPI), and
// that thread must not touch the destroyed transport when it wakes. It did, and aborted the rank with "terminate
// called ... std::system_error" instead of its error (1-4 ranks of 4 in every run before the fix).
GRADSYNC_WORKER(mpi_own_error_after_collectives) {
  auto world = gradsync::init();
  auto a = torch::ones({1000});
  for (int i = 0; i < 20; ++i) world->comm().allreduce(a, gradsync::Reduction::Mean);
  throw gradsync::Error(fmt::format("rank {}'s own error", world->rank()));
}

TEST(MpiFaults, EveryRanksOwnErrorIsReportedAndNoRankAborts) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto r = t::run_mpi_ranks(4, t::worker_argv("mpi_own_error_after_collectives"), within(60));
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.timed_out) << r.describe();
    EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.describe();
    EXPECT_EQ(r.err.find("Signal: Aborted"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("failed: rank "), std::string::npos) << r.describe();  // at least the first rank's own
  }
}

// DDP's gradients (bucket views) live in shared memory under mpirun and are the mean over ranks: rank r's input is
// 2^r, so its gradient of sum(w . x) is 2^r and the mean (2^N - 1) / N. Two steps: the buckets are rebuilt between.
GRADSYNC_WORKER(mpi_ddp_shared_grads) {
  auto world = gradsync::init();
  const int n = world->size();
  auto model = torch::nn::Linear(torch::nn::LinearOptions(6, 1).bias(false));
  gradsync::DistributedDataParallel ddp(model, world, gradsync::DdpOptions().gradient_as_bucket_view(true));
  for (int step = 0; step < 2; ++step) {
    ddp.zero_grad();
    ddp.forward(torch::full({1, 6}, std::ldexp(1.0, world->rank()))).sum().backward();
    const auto& grad = model->weight.grad();
    const double mean = (std::ldexp(1.0, n) - 1) / n;
    WORKER_CHECK(torch::allclose(grad, torch::full_like(grad, mean)), "step {}: gradient {} expected {}", step,
                 grad.flatten()[0].item<double>(), mean);
    const std::string file = t::mapped_file(grad.data_ptr());
    WORKER_CHECK(file.find("/dev/shm/gradsync-") == 0, "step {}: .grad is mapped from '{}'", step, file);
  }
  fmt::print("shared gradients ok on rank {}\n", world->rank());
  return 0;
}

TEST(MpiCollectives, DdpGradientsAreTheMeanInSharedMemory) {
  if (t::free_shm_bytes() < (uint64_t{256} << 20)) GTEST_SKIP() << "/dev/shm is nearly full";
  auto r = t::run_mpi_ranks(3, t::worker_argv("mpi_ddp_shared_grads"), within(60));
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("shared gradients ok on rank 2"), std::string::npos) << r.out;
}

class MpiEngineLoop : public testing::TestWithParam<const char*> {};

// test_engine.cpp's loop (ranks from different parameters, K = 2, a rank joining without data) under mpirun.
TEST_P(MpiEngineLoop, EndsWhereOneProcessOnTheGlobalBatchEnds) {
  auto r = t::run_mpi_ranks(3, t::worker_argv("engine_loop", {GetParam()}), within(120));
  ASSERT_TRUE(r.ok()) << r.describe();
}

INSTANTIATE_TEST_SUITE_P(Engines, MpiEngineLoop,
                         testing::Values("ddp", "ddp+early", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "zero1"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (auto& ch : name) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });

TEST(MpiLaunch, RunsTheCommandUnderMpirunWithOpenMpisVariablesOnly) {
  auto o = within(60);
  o.env = {{"RANK", "7"}, {"MASTER_ADDR", "10.9.9.9"}};  // an outer launcher's: must not reach the ranks
  auto r = t::run({GRADSYNC_BIN, "launch", "--backend", "mpi", "-n", "3", "--", "sh", "-c",
                   "echo \"r=$OMPI_COMM_WORLD_RANK n=$OMPI_COMM_WORLD_SIZE b=$GRADSYNC_BACKEND rank=${RANK:-none} "
                   "addr=${MASTER_ADDR:-none}\""}, o);
  ASSERT_TRUE(r.ok()) << r.describe();
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(r.out.find(fmt::format("[1,{}]<stdout>:r={} n=3 b=mpi rank=none addr=none", rank, rank)),
              std::string::npos) << r.out;
  }
}

TEST(MpiLaunch, AFailingRankStopsTheOthersAndTheLauncherReportsIt) {
  auto r = t::run({GRADSYNC_BIN, "launch", "--backend", "mpi", "-n", "2", "--", "sh", "-c",
                   "[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && exit 3; sleep 30"}, within(60));
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_LT(r.seconds, 15.0) << r.describe();
  EXPECT_NE(r.err.find("gradsync launch: mpirun (pid"), std::string::npos) << r.describe();
}
