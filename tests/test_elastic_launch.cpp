// `gradsync launch --nnodes MIN:MAX` on one host (loopback), with sh scripts as ranks: its flags are checked, two
// launchers form one world and restart it whole after a rank fails, out of restarts every launcher says so, and the
// rendezvous listens only where it is asked to and refuses a launcher without the job's token. The K' rule of a
// resize (train/checkpointing.h) is tested here too. Three hosts losing one: tests/test_elastic.cpp.
#include <chrono>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/subprocess.h"
#include "train/checkpointing.h"

namespace t = gradsync::test;
using namespace std::chrono_literals;

namespace {

t::CommandOptions options(const std::string& token = "5ca1ab1e") {
  auto o = t::job_options(60s);
  o.env.emplace_back("GRADSYNC_STORE_TOKEN", token);
  return o;
}

std::vector<std::string> elastic(int port, const std::string& nnodes, std::vector<std::string> more) {
  std::vector<std::string> argv{GRADSYNC_BIN, "launch", "--nnodes", nnodes, "-n", "2", "--rdzv-endpoint",
                                fmt::format("127.0.0.1:{}", port), "--rdzv-last-call", "1", "--rdzv-timeout", "8"};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

}  // namespace

TEST(ElasticLaunch, BadFlagsAreRejectedNamingTheValueAndWhatIsAllowed) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--nnodes", "3:2"}, "--nnodes MIN:MAX needs integers 1 <= MIN <= MAX <= 1024, got '3:2'"},
      {{"--nnodes", "0:2"}, "got '0:2'"},
      {{"--nnodes", "1:x"}, "got '1:x'"},
      {{"--nnodes", "1:2", "--node-rank", "1", "--master-port", "29999"}, "--node-rank 1 with --nnodes 1:2"},
      {{"--nnodes", "1:2"}, "--nnodes 1:2 needs --rdzv-endpoint HOST:PORT"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "localhost"}, "--rdzv-endpoint must be HOST:PORT"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:0"}, "got '127.0.0.1:0'"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--backend", "mpi"}, "use the gloo backend"},
      {{"--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "a/b"}, "--rdzv-id must be"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv{GRADSYNC_BIN, "launch"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {"--", "true"});
    const auto r = t::run(argv, options());
    EXPECT_EQ(r.exit_code, 2) << r.describe();
    EXPECT_NE(r.err.find(message), std::string::npos) << r.describe();
  }
}

// Round 0: rank 3 fails once. Round 1: the same two nodes, WORLD_SIZE 4, TORCHELASTIC_RESTART_COUNT 1, every RANK
// once; both launchers exit 0.
TEST(ElasticLaunch, TwoLaunchersFormOneWorldAndARankFailureRestartsItWhole) {
  const int port = t::free_port();
  const std::string script =
      "echo \"R=$RANK W=$WORLD_SIZE G=$GROUP_RANK C=$TORCHELASTIC_RESTART_COUNT ID=$TORCHELASTIC_RUN_ID\"; "
      "if [ \"$RANK\" = 3 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 1; fi; sleep 2";
  const auto argv = elastic(port, "2:2", {"--max-restarts", "1", "--rdzv-id", "job7", "--", "sh", "-c", script});
  auto a = t::Process::start(argv, options());
  auto b = t::Process::start(argv, options());
  const auto ra = a.wait(), rb = b.wait();
  ASSERT_TRUE(ra.ok()) << ra.describe();
  ASSERT_TRUE(rb.ok()) << rb.describe();
  std::set<std::string> second;
  for (const auto* out : {&ra.out, &rb.out}) {
    for (int r = 0; r < 4; ++r) {
      const auto line = fmt::format("R={} W=4 G={} C=1 ID=job7", r, r / 2);
      if (out->find(line) != std::string::npos) second.insert(line);
    }
  }
  EXPECT_EQ(second.size(), 4u) << ra.out << rb.out;
  for (const auto* err : {&ra.err, &rb.err}) {
    EXPECT_NE(err->find("round 1: 2 node(s), 4 ranks"), std::string::npos) << *err;
    EXPECT_NE(err->find("the same nodes; after round 0 ended (failed: node 127.0.0.1"), std::string::npos) << *err;
    EXPECT_NE(err->find("restart 1 of 1"), std::string::npos) << *err;
  }
}

TEST(ElasticLaunch, OutOfRestartsEveryLauncherExitsNonZeroWithTheFailure) {
  const int port = t::free_port();
  const auto argv = elastic(port, "2:2", {"--max-restarts", "1", "--", "sh", "-c",
                                          "if [ \"$RANK\" = 2 ]; then exit 3; fi; sleep 1"});
  auto a = t::Process::start(argv, options());
  auto b = t::Process::start(argv, options());
  for (const auto& r : {a.wait(), b.wait()}) {
    EXPECT_NE(r.exit_code, 0) << r.describe();
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find("giving up after 1 restart(s): round 1 ended (failed: node 127.0.0.1"), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("rank 2 (pid"), std::string::npos) << r.err;
  }
}

// The rendezvous listens on 127.0.0.1 only; a launcher with another token is dropped at its first key and gives up,
// and the one left, below MIN, names who joined.
TEST(ElasticLaunch, TheRendezvousListensWhereAskedAndRefusesAnotherToken) {
  const int port = t::free_port();
  const auto argv = elastic(port, "2:2", {"--", "true"});
  auto a = t::Process::start(argv, options());
  std::vector<std::string> listening;
  for (int i = 0; i < 200 && listening.empty(); ++i) {
    std::this_thread::sleep_for(50ms);
    listening = t::listeners_on(port);
  }
  EXPECT_EQ(listening, std::vector<std::string>{fmt::format("0100007F:{:04X}", port)});
  const auto stranger = t::run(argv, options("another-token"));
  EXPECT_NE(stranger.exit_code, 0) << stranger.describe();
  EXPECT_NE(stranger.err.find("the elastic job cannot go on without the rendezvous host"), std::string::npos)
      << stranger.describe();
  const auto ra = a.wait();
  EXPECT_NE(ra.exit_code, 0) << ra.describe();
  EXPECT_NE(ra.err.find("round 0: 1 node(s) joined within the rendezvous timeout of 8 s, fewer than the minimum 2"),
            std::string::npos) << ra.err;
}

// K' keeps B and each rank's micro-batch no larger: K N / N' when that splits B, else the next K' that does.
TEST(ElasticLaunch, TheMicroBatchCountAfterAResizeKeepsTheGlobalBatch) {
  using gradsync::cli::accumulate_after_resize;
  EXPECT_EQ(accumulate_after_resize(2, 6, 4, 24), 3);   // K N / N' = 3: micro-batch 2 as before
  EXPECT_EQ(accumulate_after_resize(3, 4, 6, 24), 2);
  EXPECT_EQ(accumulate_after_resize(1, 4, 4, 32), 1);   // the same size: the same K
  EXPECT_EQ(accumulate_after_resize(1, 4, 2, 32), 2);
  EXPECT_EQ(accumulate_after_resize(1, 2, 4, 32), 1);   // growing: K' >= 1, the micro-batch halves
  EXPECT_EQ(accumulate_after_resize(2, 6, 4, 36), 3);   // 4 x 3 = 12 divides 36
  EXPECT_EQ(accumulate_after_resize(2, 6, 4, 48), 3);   // 12 divides 48: micro-batch 4 as before
  EXPECT_EQ(accumulate_after_resize(1, 3, 2, 30), 3);   // K N / N' = 1.5: 2 x 2 = 4 does not divide 30; 2 x 3 does
  EXPECT_EQ(accumulate_after_resize(4, 4, 3, 48), 8);   // 16/3: 3 x 6 = 18 and 3 x 7 do not divide 48; 3 x 8 does
  EXPECT_EQ(accumulate_after_resize(2, 6, 4, 30), 0);   // 4 does not divide 30: no K'
}
