// Runtime tests: the launcher environment is validated before any socket, and the rendezvous catches what
// libtorch 1.13 does not (duplicate ranks, disagreeing world sizes, missing ranks), naming the ranks.
#include <map>

#include <gtest/gtest.h>

#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "support/env_of.h"
#include "support/error_of.h"
#include "support/subprocess.h"
#include "support/worker.h"

using gradsync::ConfigError;
using gradsync::LaunchEnv;
using gradsync::read_launch_env;
namespace t = gradsync::test;
using gradsync::test::env_of;

namespace {

std::string error_of(std::map<std::string, std::string> vars) {
  try {
    read_launch_env(env_of(std::move(vars)));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const std::map<std::string, std::string> kValid{{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "1"},
                                                 {"LOCAL_WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"},
                                                 {"MASTER_PORT", "29511"}};

std::map<std::string, std::string> with(std::map<std::string, std::string> base, const std::string& key,
                                        const std::string& value) {
  base[key] = value;
  return base;
}

std::map<std::string, std::string> without(std::map<std::string, std::string> base, const std::string& key) {
  base.erase(key);
  return base;
}

}  // namespace

TEST(LaunchEnv, ReadsTorchrunVariables) {
  auto e = read_launch_env(env_of(kValid));
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29511);
  EXPECT_EQ(e.source, "torchrun");
}

TEST(LaunchEnv, ReadsOpenMpiVariables) {
  auto e = read_launch_env(env_of({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                   {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.source, "openmpi");
}

TEST(LaunchEnv, ReadsMpichPmiAndSlurmVariables) {
  auto pmi = read_launch_env(env_of({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"},
                                     {"MPI_LOCALNRANKS", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(pmi.source, "pmi");
  EXPECT_EQ(pmi.rank, 3);
  EXPECT_EQ(pmi.world_size, 4);
  EXPECT_EQ(pmi.local_rank, 1);
  EXPECT_EQ(pmi.local_world_size, 2);
  EXPECT_EQ(pmi.backend, gradsync::Backend::Gloo);
  const std::map<std::string, std::string> slurm{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                                 {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "4"},
                                                 {"SLURM_STEP_ID", "0"}, {"MASTER_ADDR", "node1"},
                                                 {"MASTER_PORT", "29500"}};
  auto s = read_launch_env(env_of(slurm));
  EXPECT_EQ(s.source, "slurm");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.master_addr, "node1");
  // A batch script's own SLURM_PROCID is no rank: without a job step it is a single process.
  auto batch = slurm;
  batch.erase("SLURM_STEP_ID");
  EXPECT_EQ(read_launch_env(env_of(batch)).source, "none");
  // torchrun inside an allocation: its variables win.
  auto inner = slurm;
  inner.insert({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(read_launch_env(env_of(inner)).source, "torchrun");
  const std::string msg = gradsync::test::error_of<gradsync::ConfigError>(
      [&] { read_launch_env(env_of({{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})); });
  EXPECT_NE(msg.find("PMI_RANK=4"), std::string::npos) << msg;
}

TEST(LaunchEnv, StoreFileReplacesMasterAddress) {
  auto e = read_launch_env(env_of(with(without(without(kValid, "MASTER_ADDR"), "MASTER_PORT"),
                                       "GRADSYNC_STORE_FILE", "/tmp/x/store")));
  EXPECT_EQ(e.store_file, "/tmp/x/store");
}

TEST(LaunchEnv, NoLauncherMeansSingleProcess) {
  auto e = read_launch_env(env_of({}));
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.source, "none");
}

TEST(LaunchEnv, MissingVariablesAreNamed) {
  EXPECT_NE(error_of(without(kValid, "WORLD_SIZE")).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(error_of(without(kValid, "RANK")).find("RANK is not set"), std::string::npos);
  EXPECT_NE(error_of(without(kValid, "MASTER_PORT")).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(error_of(without(kValid, "MASTER_ADDR")).find("MASTER_ADDR is not set"), std::string::npos);
}

TEST(LaunchEnv, NonIntegersAreNamedWithTheirValue) {
  EXPECT_NE(error_of(with(kValid, "RANK", "abc")).find("RANK='abc' is not an integer"), std::string::npos);
  EXPECT_NE(error_of(with(kValid, "WORLD_SIZE", "3x")).find("WORLD_SIZE='3x'"), std::string::npos);
  EXPECT_NE(error_of(with(kValid, "MASTER_PORT", "")).find("MASTER_PORT=''"), std::string::npos);
  EXPECT_NE(error_of(with(kValid, "LOCAL_RANK", "1.5")).find("LOCAL_RANK='1.5'"), std::string::npos);
}

TEST(LaunchEnv, OutOfRangeGivesBothValues) {
  auto msg = error_of(with(kValid, "RANK", "3"));
  EXPECT_NE(msg.find("RANK=3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("WORLD_SIZE=3"), std::string::npos) << msg;
  msg = error_of(with(kValid, "RANK", "-1"));
  EXPECT_NE(msg.find("RANK=-1"), std::string::npos) << msg;
  EXPECT_NE(error_of(with(kValid, "WORLD_SIZE", "0")).find("WORLD_SIZE=0"), std::string::npos);
  EXPECT_NE(error_of(with(kValid, "MASTER_PORT", "70000")).find("MASTER_PORT=70000"), std::string::npos);
  EXPECT_NE(error_of(with(kValid, "LOCAL_RANK", "5")).find("LOCAL_RANK=5"), std::string::npos);
}

// ---- multi-process: real ranks over a FileStore ---------------------------------------------------------

GRADSYNC_WORKER(init_and_allreduce) {
  // Time is measured inside the process: start-up of a loaded machine must not count against the deadline.
  const auto start = std::chrono::steady_clock::now();
  try {
    auto world = gradsync::init({std::chrono::milliseconds(std::stoi(args.at(0))), std::nullopt, std::nullopt});
    auto t = torch::full({4}, std::pow(2.0, world->rank()));
    world->comm().allreduce(t, gradsync::Reduction::Sum);
    fmt::print("rank {} of {} sum {}\n", world->rank(), world->size(), t[0].item<double>());
    return 0;
  } catch (const std::exception&) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print(stderr, "failed after {:.3f} s\n", seconds);
    throw;
  }
}

// Two `gradsync launch` processes, --nnodes 2, two ranks each, on loopback: one world of 4 (sum of 2^r = 15).
TEST(MultiNodeLaunch, TwoLaunchersOfTwoRanksFormOneWorldOfFour) {
  const int port = t::free_port();
  std::vector<t::Process> launchers;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv{GRADSYNC_BIN, "launch", "--nnodes", "2", "--node_rank", std::to_string(node),
                                  "--nproc_per_node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                  std::to_string(port), "--"};
    const auto worker = t::worker_argv("init_and_allreduce", {"30000"});
    argv.insert(argv.end(), worker.begin(), worker.end());
    t::CommandOptions opts;
    opts.timeout = std::chrono::seconds(60);
    opts.env = {{"OMP_NUM_THREADS", "1"}};
    launchers.push_back(t::Process::start(argv, opts));
  }
  std::string out;
  for (int node = 0; node < 2; ++node) {
    const auto r = launchers[static_cast<size_t>(node)].wait();
    ASSERT_TRUE(r.ok()) << "launcher " << node << ": " << r.describe();
    out += r.out;
  }
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(out.find(fmt::format("[rank{}]: rank {} of 4 sum 15", rank, rank)), std::string::npos) << out;
  }
}

namespace {

// Two launchers of two ranks on loopback (--nnodes 2) running `gradsync train ARGS`; their outputs, node 0's first.
std::vector<t::ProcessResult> train_on_two_nodes(const std::vector<std::string>& args) {
  const int port = t::free_port();
  std::vector<t::Process> launchers;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv{GRADSYNC_BIN, "launch", "--nnodes", "2", "--node-rank", std::to_string(node), "-n",
                                  "2", "--master-addr", "127.0.0.1", "--master-port", std::to_string(port), "--",
                                  GRADSYNC_BIN, "train", "--model", "mlp:8-16-4", "--data", "synthetic:64",
                                  "--global-batch", "16", "--steps", "2", "--timeout", "20"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto opts = t::job_options(std::chrono::seconds(60), {"GRADSYNC_BACKEND"});
    launchers.push_back(t::Process::start(argv, opts));
  }
  std::vector<t::ProcessResult> results;
  for (auto& l : launchers) results.push_back(l.wait());
  return results;
}

}  // namespace

// Hybrid sharding's default mesh is a shard group per host (the launchers' --nnodes); a shard group spanning the
// two hosts is refused on every rank, naming the option that allows it, and runs when allowed.
TEST(MultiNodeLaunch, HsdpTakesAShardGroupPerHostAndRefusesOneSpanningHostsUnlessAllowed) {
  const auto mesh = train_on_two_nodes({"--strategy", "hsdp"});
  for (const auto& r : mesh) ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(mesh[0].out.find("2 replica(s) of 2 rank(s)"), std::string::npos) << mesh[0].out;
  const auto spanning = train_on_two_nodes({"--strategy", "hsdp", "--replicas", "1"});
  for (int node = 0; node < 2; ++node) {
    const auto& r = spanning[static_cast<size_t>(node)];
    EXPECT_FALSE(r.ok() || r.timed_out) << r.describe();
    EXPECT_NE(r.err.find("1 replicas of 4 ranks make shard groups of 4 ranks, but a host runs 2"), std::string::npos)
        << r.describe();
    EXPECT_NE(r.err.find("train --shard-across-hosts"), std::string::npos) << r.describe();
  }
  const auto allowed = train_on_two_nodes({"--strategy", "hsdp", "--replicas", "1", "--shard-across-hosts"});
  for (const auto& r : allowed) ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(allowed[0].out.find("1 replica(s) of 4 rank(s)"), std::string::npos) << allowed[0].out;
}

TEST(MultiNodeLaunch, BadNodeFlagsAreRefusedNamingThem) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(30);
  const auto no_port = t::run({GRADSYNC_BIN, "launch", "--nnodes", "2", "-n", "1", "--", "true"}, opts);
  EXPECT_EQ(no_port.exit_code, 2);
  EXPECT_NE(no_port.err.find("--nnodes 2 needs --master-port"), std::string::npos) << no_port.err;
  const auto bad_rank = t::run({GRADSYNC_BIN, "launch", "--nnodes", "2", "--node-rank", "2", "--master-port", "1234",
                                "--", "true"}, opts);
  EXPECT_EQ(bad_rank.exit_code, 2);
  EXPECT_NE(bad_rank.err.find("--node-rank must be an integer from 0 to 1"), std::string::npos) << bad_rank.err;
}

namespace {

// Starts one process per entry of `ranks` with that RANK (duplicates allowed) and the given WORLD_SIZEs.
std::vector<t::ProcessResult> start_job(const std::vector<int>& ranks, const std::vector<int>& world_sizes,
                                        int timeout_ms) {
  const std::string dir = t::make_temp_dir("gradsync-rdzv");
  std::vector<t::Process> procs;
  for (size_t i = 0; i < ranks.size(); ++i) {
    t::CommandOptions opts;
    opts.timeout = std::chrono::milliseconds(timeout_ms + 20000);
    opts.env = {{"RANK", std::to_string(ranks[i])}, {"WORLD_SIZE", std::to_string(world_sizes[i])},
                {"GRADSYNC_STORE_FILE", dir + "/store"}, {"OMP_NUM_THREADS", "1"}};
    opts.unset_env = {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
    procs.push_back(t::Process::start(t::worker_argv("init_and_allreduce", {std::to_string(timeout_ms)}), opts));
  }
  std::vector<t::ProcessResult> out;
  for (auto& p : procs) out.push_back(p.wait());
  return out;
}

}  // namespace

TEST(Rendezvous, DistinctRanksJoinAndReduce) {
  auto results = start_job({2, 0, 1}, {3, 3, 3}, 20000);
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("of 3 sum 7"), std::string::npos) << r.out;
  }
}

TEST(Rendezvous, DuplicateRankFailsEveryProcessNamingTheRank) {
  auto results = start_job({0, 1, 1}, {3, 3, 3}, 20000);
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find("rank 1 registered twice"), std::string::npos) << r.describe();
  }
}

TEST(Rendezvous, TwoProcessesWithTheSameRankBothFail) {
  auto results = start_job({1, 1}, {2, 2}, 20000);
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.err.find("rank 1 registered twice"), std::string::npos) << r.describe();
  }
}

TEST(Rendezvous, DisagreeingWorldSizeFailsNamingBothValues) {
  auto results = start_job({0, 1, 2}, {3, 2, 3}, 20000);
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.err.find("disagree on WORLD_SIZE"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("WORLD_SIZE=2"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("WORLD_SIZE=3"), std::string::npos) << r.describe();
  }
}

TEST(Rendezvous, MissingRankTimesOutNamingIt) {
  auto results = start_job({0, 1}, {3, 3}, 2000);
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.err.find("missing rank(s) 2"), std::string::npos) << r.describe();
    auto at = r.err.find("failed after ");
    ASSERT_NE(at, std::string::npos) << r.describe();
    const double seconds = std::stod(r.err.substr(at + 13));
    EXPECT_GE(seconds, 2.0);
    EXPECT_LT(seconds, 2.0 + 1.0);  // the rendezvous timeout + 1 s
  }
}

TEST(Rendezvous, BadEnvironmentFailsFastNamingTheVariable) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(20);
  opts.env = {{"RANK", "abc"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29999"}};
  opts.unset_env = {"GRADSYNC_STORE_FILE"};
  auto r = t::run(t::worker_argv("init_and_allreduce", {"5000"}), opts);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.err.find("RANK='abc' is not an integer"), std::string::npos) << r.describe();
  opts.env = {{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29999"}};
  r = t::run(t::worker_argv("init_and_allreduce", {"5000"}), opts);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.err.find("RANK=2 is out of range for WORLD_SIZE=2"), std::string::npos) << r.describe();
}

TEST(Rendezvous, TcpStoreFromMasterAddressWorks) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(40);
  opts.unset_env = {"GRADSYNC_STORE_FILE"};
  opts.env = {{"GRADSYNC_STORE_FILE", ""}};
  auto results = t::run_ranks(2, t::worker_argv("init_and_allreduce", {"20000"}), opts);
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("of 2 sum 3"), std::string::npos) << r.out;
  }
}
