// The fault suite's job-level cases (ctest label `faults`): a rank frozen with SIGSTOP is named by the survivors
// and the launcher; starting a thousand-rank job stops at the first failure within the timeout; rank 0's store of a
// hand-started job listens on loopback only and drops a stray client while the job trains on. Checkpoint and
// resume faults are in test_resume.cpp and test_checkpoint.cpp, the store's own in test_store_server.cpp.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/fault_record.h"
#include "support/subprocess.h"

namespace t = gradsync::test;
using Clock = std::chrono::steady_clock;

namespace {

t::CommandOptions options(std::chrono::seconds timeout = std::chrono::seconds(120)) {
  return t::job_options(timeout, {"GRADSYNC_BACKEND"});
}



// Processes whose command line contains `marker` (an argument unique to one test).
int processes_with(const std::string& marker) {
  int found = 0;
  DIR* proc = ::opendir("/proc");
  while (const dirent* e = ::readdir(proc)) {
    std::ifstream in(std::string("/proc/") + e->d_name + "/cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    found += cmdline.find(marker) != std::string::npos && std::to_string(::getpid()) != e->d_name;
  }
  ::closedir(proc);
  return found;
}


}  // namespace

TEST(FaultsJob, ARankFrozenWithSigstopIsNamedByTheSurvivorsAndTheLauncher) {
  const auto dir = t::make_temp_dir("gradsync-stop-");
  auto job = t::Process::start({GRADSYNC_BIN, "train", "--model", "mlp:8-16-4", "--data", "synthetic:4001",
                                "--global-batch", "12", "--world-size", "3", "--steps", "1000000", "--timeout", "5",
                                "--log", dir + "/log"},
                               options());
  while (t::line_count(dir + "/log") < 20 && !job.poll()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto ranks = t::children_of(job.pid());
  ASSERT_EQ(ranks.size(), 3u);
  ::kill(ranks[1], SIGSTOP);
  const auto stopped = Clock::now();
  const auto r = job.wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - stopped).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(seconds, 5 * 1.1 + 3) << "the process-group timeout + 10%, and the launcher's reaction (2 cores, shared)";
  const auto named = fmt::format("rank 1 (pid {} on this host) is stopped (SIGSTOP or a debugger)", ranks[1]);
  EXPECT_NE(r.err.find("rank 0 of 3: allreduce"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(fmt::format("gradsync launch: rank 1 (pid {}) is stopped (SIGSTOP or a debugger), so the "
                                   "others waited for it", ranks[1])), std::string::npos) << r.err;
  int orphans = 0;
  for (pid_t pid : ranks) orphans += t::process_alive(pid);
  EXPECT_EQ(orphans, 0);
  const bool clean = r.err.find(named) != std::string::npos && r.exit_code != 0;
  t::record_faults({1, clean ? 1 : 0, r.timed_out ? 1 : 0, orphans, 0, 0, 0, 0});
  fmt::print("faults: SIGSTOP of rank 1 detected in {:.1f} s (timeout 5 s), named by survivors and launcher, "
             "0 orphans\n", seconds);
}

TEST(FaultsJob, StartingAThousandRanksStopsAtTheFirstFailureWithinTheTimeout) {
  const auto start = Clock::now();
  const auto r = t::run({GRADSYNC_BIN, "train", "--model", "mlp:8-4-2", "--data", "synthetic:4002", "--global-batch",
                         "1000", "--world-size", "1000", "--steps", "1", "--timeout", "3"},
                        options());
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("of 1000 ranks; starting no more"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("rendezvous timed out after 3000 ms"), std::string::npos) << r.describe();
  // Start-up is this machine's: every rank loads libtorch (0.5 s of CPU each), and the ranks started before the
  // first one times out share 2 cores (80-odd of them: 14-19 s before the first failure on a slow day).
  EXPECT_LT(seconds, 3 + 5 + 30) << "timeout + grace period + start-up of the ranks already running";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int left = processes_with("synthetic:4002");
  EXPECT_EQ(left, 0);
  const bool clean = r.err.find("starting no more") != std::string::npos && r.exit_code != 0;
  t::record_faults({1, clean ? 1 : 0, r.timed_out ? 1 : 0, left, 0, 0, 0, 0});
  fmt::print("faults: 1000-rank start stopped after {:.1f} s (timeout 3 s), 0 processes left\n", seconds);
}

// Rank 0, which serves the store, is not there (never started, or exited first): the late rank says so.
TEST(FaultsJob, ARankWithoutTheStoresRankZeroNamesTheStoreAndWhoServesIt) {
  auto o = options();
  const int port = t::free_port();
  o.env = {{"OMP_NUM_THREADS", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
           {"MASTER_PORT", std::to_string(port)}};
  const auto start = Clock::now();
  const auto r = t::run({GRADSYNC_BIN, "train", "--model", "mlp:8-4-2", "--data", "synthetic:64", "--global-batch",
                         "8", "--steps", "1", "--timeout", "3"}, o);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const bool named = r.err.find(fmt::format("rank 1 of 2: cannot connect to the rendezvous store at 127.0.0.1:{} "
                                            "(served by rank 0)", port)) != std::string::npos;
  EXPECT_TRUE(named) << r.describe();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(seconds, 3 + 2);
  t::record_faults({1, named ? 1 : 0, r.timed_out ? 1 : 0, 0, 0, 0, 0, 0});
}

TEST(FaultsJob, AHandStartedJobsStoreListensOnLoopbackOnlyAndDropsAStrayClient) {
  const auto dir = t::make_temp_dir("gradsync-store-");
  const int port = t::free_port();
  std::vector<t::Process> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    auto o = options();
    o.env = {{"OMP_NUM_THREADS", "1"}, {"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"},
             {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
             {"GRADSYNC_STORE_TOKEN", "0123abcd"}};
    ranks.push_back(t::Process::start({GRADSYNC_BIN, "train", "--model", "mlp:8-16-4", "--data", "synthetic:512",
                                       "--global-batch", "8", "--steps", "100000000", "--timeout", "20", "--quiet",
                                       "--log", dir + "/log" + std::to_string(rank)},
                                      o));
  }
  while (t::line_count(dir + "/log0") < 5 && !ranks[0].poll()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(t::listeners_on(port), std::vector<std::string>{fmt::format("0100007F:{:04X}", port)});
  // A client without the token: the store drops it at its first key; the job trains on undisturbed.
  const auto stray = t::run({GRADSYNC_PYTHON, "-c",
                             "import sys, datetime, torch.distributed as d\n"
                             "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, "
                             "timeout=datetime.timedelta(seconds=30))\n"
                             "try:\n  s.set('gradsync/0/pg/x', 'evil'); s.get('gradsync/0/pg/x')\n"
                             "except Exception as e:\n  print('dropped:', e); sys.exit(0)\n"
                             "sys.exit(1)\n",
                             std::to_string(port)});
  EXPECT_TRUE(stray.ok() && stray.out.find("dropped:") != std::string::npos) << stray.describe();
  const size_t before = t::line_count(dir + "/log0");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const bool training = !ranks[0].poll() && !ranks[1].poll() && t::line_count(dir + "/log0") > before;
  EXPECT_TRUE(training) << "the job must train on";
  for (auto& r : ranks) {
    r.signal(SIGTERM);
    const auto done = r.wait();
    EXPECT_EQ(done.term_signal, SIGTERM) << done.describe();  // stopped here, not failed
  }
  t::record_faults({1, stray.ok() && training ? 1 : 0, 0, 0, 0, 0, 0, 0});
}
