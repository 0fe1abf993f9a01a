// `gradsync launch --nnodes MIN:MAX` on one host (loopback), with sh scripts as ranks: its flags are checked, two
// launchers form one world and restart it whole after a rank fails, out of restarts every launcher says so, and the
// rendezvous listens only where it is asked to and refuses a launcher without the job's token. The rendezvous's
// harder paths: a node joining after a failure gets the job's restart count, the host is in every round however
// many wait, every launcher reads an abort, a node with another -n is refused alone, a configuration error is not
// restarted. The K' rule of a resize (train/checkpointing.h) is tested here too, and that resizes do not drift.
// Three hosts losing one: tests/test_elastic.cpp.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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

// Starts the launcher that serves the rendezvous (the first to bind the port) and returns once it listens.
t::Process start_host(const std::vector<std::string>& argv, int port) {
  auto host = t::Process::start(argv, options());
  for (int i = 0; i < 200 && t::listeners_on(port).empty(); ++i) std::this_thread::sleep_for(50ms);
  return host;
}

void wait_for_file(const std::string& path) {
  for (int i = 0; i < 600 && !std::filesystem::exists(path); ++i) std::this_thread::sleep_for(50ms);
}

// Every line a rank printed to `out` that starts with `prefix`, without the launcher's "[rankN]: ".
std::vector<std::string> lines_with(const std::string& out, const std::string& prefix) {
  std::vector<std::string> found;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (const auto tag = line.find("]: "); line.rfind("[rank", 0) == 0 && tag != std::string::npos) {
      line = line.substr(tag + 3);
    }
    if (line.rfind(prefix, 0) == 0) found.push_back(line);
  }
  return found;
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

// Round 0 fails (restart 1); c starts during round 1, waits, and the host grows the job for it. Round 2's six ranks
// all see TORCHELASTIC_RESTART_COUNT 1, c's too: their store keys include it, so a count of c's own would keep them
// apart. A grow is not a restart.
TEST(ElasticLaunch, ANodeJoiningAfterAFailureGetsTheJobsRestartCount) {
  const int port = t::free_port();
  const auto dir = t::make_temp_dir("gradsync-elastic-join");
  const std::string script = fmt::format(
      "echo \"W=$WORLD_SIZE R=$RANK C=$TORCHELASTIC_RESTART_COUNT\"; "
      "if [ \"$GRADSYNC_ELASTIC_ROUND\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 1; fi; "
      "if [ \"$WORLD_SIZE\" = 6 ]; then exit 0; fi; touch {}/running-$GRADSYNC_ELASTIC_ROUND; sleep 40", dir);
  const auto argv = elastic(port, "2:3", {"--max-restarts", "1", "--", "sh", "-c", script});
  auto a = start_host(argv, port);
  auto b = t::Process::start(argv, options());
  wait_for_file(dir + "/running-1");
  auto c = t::Process::start(argv, options());
  const auto ra = a.wait(), rb = b.wait(), rc = c.wait();
  for (const auto* r : {&ra, &rb, &rc}) ASSERT_TRUE(r->ok()) << r->describe();
  std::set<std::string> six;
  for (const auto* r : {&ra, &rb, &rc}) {
    for (const auto& line : lines_with(r->out, "W=6")) six.insert(line);
  }
  std::set<std::string> expected;
  for (int r = 0; r < 6; ++r) expected.insert(fmt::format("W=6 R={} C=1", r));
  EXPECT_EQ(six, expected) << ra.out << rb.out << rc.out;
  EXPECT_EQ(lines_with(rc.out, "W=6").size(), 2u) << rc.describe();
  EXPECT_NE(rc.err.find("waiting for the next"), std::string::npos) << rc.err;
  EXPECT_NE(ra.err.find("after round 1 ended (grow: a node is waiting to join)"), std::string::npos) << ra.err;
}

// MAX 2: c and d come while a and b run, and wait. When b's rank fails, the next round is the host and one other,
// whoever came first; the host (MASTER_ADDR, node 0) is never left out. Those left out see the job finish.
TEST(ElasticLaunch, MoreNodesWaitingThanRoomTheHostIsInEveryRound) {
  const int port = t::free_port();
  const auto dir = t::make_temp_dir("gradsync-elastic-room");
  const std::string script = fmt::format(
      "echo \"E=$GRADSYNC_ELASTIC_ROUND W=$WORLD_SIZE R=$RANK G=$GROUP_RANK\"; "
      "if [ \"$GRADSYNC_ELASTIC_ROUND\" = 0 ]; then touch {0}/r0-$RANK; "
      "while [ ! -e {0}/fail ]; do sleep 0.1; done; if [ \"$RANK\" = 1 ]; then exit 1; fi; sleep 20; fi", dir);
  std::vector<std::string> argv{GRADSYNC_BIN, "launch", "--nnodes", "1:2", "-n", "1", "--rdzv-endpoint",
                                fmt::format("127.0.0.1:{}", port), "--rdzv-last-call", "1", "--rdzv-timeout", "8",
                                "--max-restarts", "1", "--", "sh", "-c", script};
  auto a = start_host(argv, port);
  std::this_thread::sleep_for(200ms);
  auto b = t::Process::start(argv, options());
  wait_for_file(dir + "/r0-1");
  auto c = t::Process::start(argv, options());
  auto d = t::Process::start(argv, options());
  std::this_thread::sleep_for(3s);  // c and d wait for round 1
  std::ofstream(dir + "/fail").put('1');
  std::vector<t::ProcessResult> results;
  for (auto* p : {&a, &b, &c, &d}) results.push_back(p->wait());
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.describe();
  const auto& ra = results[0];
  EXPECT_EQ(lines_with(ra.out, "E=1 "), std::vector<std::string>{"E=1 W=2 R=0 G=0"}) << ra.describe();
  EXPECT_NE(ra.err.find("round 1: 2 node(s), 2 ranks"), std::string::npos) << ra.err;
  int finished_without = 0;
  for (const auto& r : results) finished_without += r.err.find("finished before this node could join") != std::string::npos;
  EXPECT_EQ(finished_without, 2) << results[1].err << results[2].err << results[3].err;
}

// Fewer than MIN: the client reads the host's abort, the same words, not a lost store.
TEST(ElasticLaunch, BelowMinEveryLauncherReadsTheAbort) {
  const int port = t::free_port();
  std::vector<std::string> argv{GRADSYNC_BIN, "launch", "--nnodes", "3:3", "-n", "1", "--rdzv-endpoint",
                                fmt::format("127.0.0.1:{}", port), "--rdzv-timeout", "3", "--", "true"};
  auto a = start_host(argv, port);
  auto b = t::Process::start(argv, options());
  for (const auto& r : {a.wait(), b.wait()}) {
    EXPECT_EQ(r.exit_code, 1) << r.describe();
    EXPECT_NE(r.err.find("round 0: 2 node(s) joined within the rendezvous timeout of 3 s, fewer than the minimum 3"),
              std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("cannot go on without the rendezvous host"), std::string::npos) << r.err;
  }
}

// A node with another -n is refused before it joins a round; the job goes on without it.
TEST(ElasticLaunch, ANodeWithAnotherRankCountIsRefusedAlone) {
  const int port = t::free_port();
  auto argv = elastic(port, "1:2", {"--", "true"});
  argv[9] = "3";  // --rdzv-last-call 3: time for the other node to be refused
  auto a = start_host(argv, port);
  argv[5] = "1";  // -n 1
  const auto rb = t::run(argv, options());
  EXPECT_EQ(rb.exit_code, 1) << rb.describe();
  EXPECT_NE(rb.err.find("runs -n 1 and the rendezvous host 127.0.0.1 -n 2: every node of an elastic job runs the same "
                        "number of ranks"), std::string::npos) << rb.err;
  const auto ra = a.wait();
  EXPECT_TRUE(ra.ok()) << ra.describe();
  EXPECT_NE(ra.err.find("round 0: 1 node(s), 2 ranks"), std::string::npos) << ra.err;
}

// A rank's configuration error (exit 78) would come back at every restart: no second round, whatever is left.
TEST(ElasticLaunch, AConfigurationErrorIsNotRestarted) {
  const int port = t::free_port();
  const auto argv = elastic(port, "2:2", {"--max-restarts", "3", "--", "sh", "-c",
                                          "if [ \"$RANK\" = 1 ]; then exit 78; fi; sleep 5"});
  auto a = start_host(argv, port);
  auto b = t::Process::start(argv, options());
  for (const auto& r : {a.wait(), b.wait()}) {
    EXPECT_EQ(r.exit_code, 1) << r.describe();
    EXPECT_NE(r.err.find("not restarting: round 0 ended (failed (not restartable): node 127.0.0.1"), std::string::npos)
        << r.err;
    EXPECT_EQ(r.err.find("round 1:"), std::string::npos) << r.err;
  }
}

// Resizes keep the micro-batch the run started with: 3 ranks x 1 (micro-batch 10 of 30) -> 2 ranks x 3 (5: 2 x 2
// does not split 30) -> 3 ranks x 1 again, not the 3 x 2 that K and N of the last checkpoint would give.
TEST(ElasticLaunch, ResizesDoNotDriftFromTheMicroBatchTheRunStartedWith) {
  const auto dir = t::make_temp_dir("gradsync-resize-drift");
  const auto train = [&](int ranks, int steps) {
    return t::run({GRADSYNC_BIN, "train", "--strategy", "local", "--replay-ranks", std::to_string(ranks), "--model",
                   "mlp:8-6-4", "--data", "synthetic:120", "--global-batch", "30", "--accumulate", "1", "--steps",
                   std::to_string(steps), "--checkpoint-dir", dir + "/ck", "--checkpoint-every", "1", "--resume",
                   "--log", dir + "/train.log", "--quiet"}, t::job_options(120s));
  };
  for (const auto& [ranks, steps] : std::vector<std::pair<int, int>>{{3, 1}, {2, 2}, {3, 3}}) {
    const auto r = train(ranks, steps);
    ASSERT_TRUE(r.ok()) << r.describe();
  }
  std::ifstream log(dir + "/train.log");
  std::vector<std::pair<int64_t, int64_t>> seen;  // (world size, K) per step
  for (std::string line; std::getline(log, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("step")) seen.emplace_back(j["world_size"].get<int64_t>(), j["accumulate"].get<int64_t>());
  }
  EXPECT_EQ(seen, (std::vector<std::pair<int64_t, int64_t>>{{3, 1}, {2, 3}, {3, 1}}));
}
