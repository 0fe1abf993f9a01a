// Tests for `gradsync launch` (tools/launch/): the ranks' environment, output prefixing, failure
// propagation, signal forwarding, the grace period, and that no process outlives the launcher. They run
// the real CLI (GRADSYNC_BIN) with sh scripts as ranks; every run has its own timeout.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "gradsync/error.h"
#include "launch/launch.h"
#include "launch/spawn.h"
#include "support/subprocess.h"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using gradsync::test::CommandOptions;
using gradsync::test::Process;
using gradsync::test::ProcessResult;
using gradsync::test::process_alive;

std::vector<std::string> launch_args(std::vector<std::string> args) {
  args.insert(args.begin(), {GRADSYNC_BIN, "launch"});
  return args;
}

// The scripts find their scratch directory in $T, so paths never need shell quoting.
CommandOptions options_with_dir(const std::string& dir, std::chrono::milliseconds timeout = 30s) {
  CommandOptions o;
  o.env = {{"T", dir}};
  o.timeout = timeout;
  return o;
}

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at scope exit (launch/spawn.h).
struct TempDir : gradsync::cli::TempDir {
  TempDir() : gradsync::cli::TempDir("gradsync-test-launch") {}
};

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Polls until `done()` or the timeout; the scripts' side effects (files) appear asynchronously.
template <typename F>
bool eventually(F done, std::chrono::milliseconds timeout = 10s) {
  auto until = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

bool all_files_exist(const TempDir& dir, const std::string& stem, int n) {
  for (int r = 0; r < n; ++r) {
    if (!fs::exists(dir.file(stem + std::to_string(r)))) return false;
  }
  return true;
}

// Rank scripts write their pid files to a temp name and rename them, so a file that exists is complete.
pid_t read_pid(const std::string& path) {
  std::ifstream in(path);
  pid_t pid = -1;
  in >> pid;
  return pid;
}

std::vector<pid_t> read_pids(const TempDir& dir, const std::string& stem, int n) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = read_pid(dir.file(stem + std::to_string(r)));
    EXPECT_GT(pid, 0) << "no pid in " << dir.file(stem + std::to_string(r));
    pids.push_back(pid);
  }
  return pids;
}

// A SIGKILLed process disappears asynchronously: allow a moment, not more.
void expect_all_gone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    EXPECT_TRUE(eventually([&] { return !process_alive(pid); }, 2s)) << "process " << pid << " survived";
  }
}

// "[rank<r>]: KEY=VALUE" lines -> per-rank environment; every line must carry a valid rank prefix.
std::map<int, std::map<std::string, std::string>> env_by_rank(const std::string& out, int world_size) {
  std::map<int, std::map<std::string, std::string>> env;
  for (const auto& line : lines_of(out)) {
    int rank = -1;
    int consumed = 0;
    if (std::sscanf(line.c_str(), "[rank%d]: %n", &rank, &consumed) != 1 || consumed == 0) {
      ADD_FAILURE() << "line without a rank prefix: " << line;
      continue;
    }
    EXPECT_TRUE(rank >= 0 && rank < world_size) << line;
    std::string rest = line.substr(static_cast<size_t>(consumed));
    auto eq = rest.find('=');
    if (eq != std::string::npos) env[rank][rest.substr(0, eq)] = rest.substr(eq + 1);
  }
  return env;
}

bool is_number(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

TEST(Launch, EveryRankGetsTorchrunEnvironment) {
  CommandOptions o;
  o.timeout = 30s;
  o.unset_env = {"OMP_NUM_THREADS"};
  o.env = {{"TORCHELASTIC_USE_AGENT_STORE", "True"}};  // an outer torchrun's leftover must not leak
  ProcessResult r = gradsync::test::run(launch_args({"-n", "3", "--", "env"}), o);
  ASSERT_TRUE(r.ok()) << r.describe();

  auto env = env_by_rank(r.out, 3);
  ASSERT_EQ(env.size(), 3u) << r.describe();
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const std::string omp = std::to_string(std::max(1L, cores / 3));
  for (int rank = 0; rank < 3; ++rank) {
    auto& e = env[rank];
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(e["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_TRUE(is_number(e["MASTER_PORT"])) << e["MASTER_PORT"];
    EXPECT_GT(std::atoi(e["MASTER_PORT"].c_str()), 0);
    EXPECT_EQ(e["OMP_NUM_THREADS"], omp);
    EXPECT_EQ(e["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(e["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_FALSE(e["TORCHELASTIC_RUN_ID"].empty());
    EXPECT_EQ(e.count("TORCHELASTIC_USE_AGENT_STORE"), 0u);
    EXPECT_FALSE(e["GRADSYNC_STORE_FILE"].empty());
    // Shared by all ranks: one rendezvous.
    EXPECT_EQ(e["MASTER_PORT"], env[0]["MASTER_PORT"]);
    EXPECT_EQ(e["GRADSYNC_STORE_FILE"], env[0]["GRADSYNC_STORE_FILE"]);
    EXPECT_EQ(e["TORCHELASTIC_RUN_ID"], env[0]["TORCHELASTIC_RUN_ID"]);
  }
  // The store lives in a temp dir of the launcher's, removed at exit.
  fs::path store = env[0]["GRADSYNC_STORE_FILE"];
  EXPECT_EQ(store.filename(), "store");
  EXPECT_FALSE(fs::exists(store.parent_path())) << store;
}

TEST(Launch, ExplicitPortAndInheritedOmpThreadsArePassedThrough) {
  int port = gradsync::test::free_port();
  CommandOptions o;
  o.timeout = 30s;
  o.env = {{"OMP_NUM_THREADS", "7"}};
  ProcessResult r = gradsync::test::run(
      launch_args({"-n", "2", "--master-port", std::to_string(port), "--master-addr", "localhost", "--", "env"}), o);
  ASSERT_TRUE(r.ok()) << r.describe();
  auto env = env_by_rank(r.out, 2);
  ASSERT_EQ(env.size(), 2u) << r.describe();
  for (auto& [rank, e] : env) {
    EXPECT_EQ(e["MASTER_PORT"], std::to_string(port));
    EXPECT_EQ(e["MASTER_ADDR"], "localhost");
    EXPECT_EQ(e["OMP_NUM_THREADS"], "7");
  }
}

TEST(Launch, PrefixesStdoutAndStderrLinesWithTheRank) {
  CommandOptions o;
  o.timeout = 30s;
  const std::string script = R"(echo "line1-$RANK"; echo "err-$RANK" >&2; printf "partial-$RANK")";
  ProcessResult r = gradsync::test::run(launch_args({"-n", "2", "--", "sh", "-c", script}), o);
  ASSERT_TRUE(r.ok()) << r.describe();
  for (int rank = 0; rank < 2; ++rank) {
    std::string p = "[rank" + std::to_string(rank) + "]: ";
    std::string s = std::to_string(rank);
    EXPECT_NE(r.out.find(p + "line1-" + s + "\n"), std::string::npos) << r.describe();
    EXPECT_NE(r.out.find(p + "partial-" + s + "\n"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find(p + "err-" + s + "\n"), std::string::npos) << r.describe();
    EXPECT_EQ(r.out.find("err-" + s), std::string::npos) << "stderr leaked into stdout";
  }

  ProcessResult raw = gradsync::test::run(launch_args({"--no-prefix", "-n", "1", "--", "sh", "-c", script}), o);
  ASSERT_TRUE(raw.ok()) << raw.describe();
  EXPECT_EQ(raw.out, "line1-0\npartial-0");
  EXPECT_EQ(raw.err, "err-0\n");
}

TEST(Launch, HeavyOutputArrivesIntactAndInOrder) {
  CommandOptions o;
  o.timeout = 60s;
  const int lines = 20000;
  ProcessResult r =
      gradsync::test::run(launch_args({"-n", "4", "--", "seq", "1", std::to_string(lines)}), o);
  ASSERT_TRUE(r.ok()) << r.describe();
  std::map<int, int> last;  // rank -> last number seen
  for (const auto& line : lines_of(r.out)) {
    int rank = -1, value = -1;
    ASSERT_EQ(std::sscanf(line.c_str(), "[rank%d]: %d", &rank, &value), 2) << line;
    ASSERT_EQ(value, last[rank] + 1) << "rank " << rank << " lost or reordered a line";
    last[rank] = value;
  }
  ASSERT_EQ(last.size(), 4u);
  for (auto& [rank, value] : last) EXPECT_EQ(value, lines) << "rank " << rank;
}

TEST(Launch, FailingRankStopsTheOthersAndLeavesNoProcess) {
  TempDir dir;
  // Each rank records its shell's pid and that of a child `sleep`; rank 1 fails once all are up.
  const std::string script = R"(
    sleep 60 & echo $! > "$T/tmpc.$RANK" && mv "$T/tmpc.$RANK" "$T/child.$RANK"; echo $$ > "$T/tmp.$RANK" && mv "$T/tmp.$RANK" "$T/pid.$RANK"
    if [ "$RANK" = 1 ]; then
      while [ ! -e "$T/pid.0" ] || [ ! -e "$T/pid.2" ]; do sleep 0.05; done
      exit 3
    fi
    wait)";
  ProcessResult r = gradsync::test::run(launch_args({"-n", "3", "--", "sh", "-c", script}), options_with_dir(dir.path()));
  EXPECT_EQ(r.exit_code, 3) << r.describe();
  EXPECT_FALSE(r.timed_out);
  EXPECT_LT(r.seconds, 10) << r.describe();
  EXPECT_NE(r.err.find("rank 1 (pid "), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("exited with code 3; stopping the other ranks"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err.find("rank 0 (pid"), std::string::npos) << "only the first failure is the cause\n"
                                                           << r.describe();
  expect_all_gone(read_pids(dir, "pid.", 3));
  expect_all_gone(read_pids(dir, "child.", 3));
}

TEST(Launch, RankKilledBySignalIsReported) {
  CommandOptions o;
  o.timeout = 30s;
  const std::string script = R"(if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60)";
  ProcessResult r = gradsync::test::run(launch_args({"-n", "2", "--", "sh", "-c", script}), o);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.describe();
  EXPECT_LT(r.seconds, 10) << r.describe();
  EXPECT_NE(r.err.find("rank 0 (pid "), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("was killed by signal 9 (Killed)"), std::string::npos) << r.describe();
}

TEST(Launch, SigtermToTheLauncherIsForwardedToEveryRank) {
  TempDir dir;
  const std::string script = R"(
    trap 'echo term > "$T/term.$RANK"; exit 143' TERM
    echo $$ > "$T/tmp.$RANK" && mv "$T/tmp.$RANK" "$T/pid.$RANK"
    while true; do sleep 0.05; done)";
  Process p = Process::start(launch_args({"-n", "3", "--", "sh", "-c", script}), options_with_dir(dir.path()));
  ASSERT_TRUE(eventually([&] { return all_files_exist(dir, "pid.", 3); })) << p.wait().describe();
  std::this_thread::sleep_for(100ms);  // the pid file is written after `trap`, but be generous
  p.signal(SIGTERM);  // the launcher's own group: the ranks only get it if the launcher forwards it
  ProcessResult r = p.wait();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.describe();
  EXPECT_NE(r.err.find("received signal 15"), std::string::npos) << r.describe();
  EXPECT_TRUE(all_files_exist(dir, "term.", 3)) << "a rank did not see SIGTERM\n" << r.describe();
  expect_all_gone(read_pids(dir, "pid.", 3));
}

TEST(Launch, RanksDieWithASigkilledLauncher) {
  TempDir dir;
  // `exec`: the recorded pid is the rank process itself, which carries PR_SET_PDEATHSIG.
  const std::string script = R"(echo $$ > "$T/tmp.$RANK" && mv "$T/tmp.$RANK" "$T/pid.$RANK"; exec sleep 60)";
  CommandOptions o = options_with_dir(dir.path());
  o.env.emplace_back("TMPDIR", dir.path());  // a SIGKILLed launcher cannot remove its temp dir
  Process p = Process::start(launch_args({"-n", "2", "--", "sh", "-c", script}), o);
  ASSERT_TRUE(eventually([&] { return all_files_exist(dir, "pid.", 2); })) << p.wait().describe();
  std::vector<pid_t> pids = read_pids(dir, "pid.", 2);
  p.signal(SIGKILL);
  ProcessResult r = p.wait();
  EXPECT_EQ(r.term_signal, SIGKILL) << r.describe();
  expect_all_gone(pids);
}

TEST(Launch, BackgroundGrandchildIsGoneAfterTheLauncherEnds) {
  TempDir dir;
  const std::string script = R"(sleep 300 & echo $! > "$T/gc.$RANK"; echo started)";
  ProcessResult r = gradsync::test::run(launch_args({"-n", "2", "--", "sh", "-c", script}), options_with_dir(dir.path()));
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_LT(r.seconds, 10) << "a grandchild holding the output pipe kept the launcher alive\n" << r.describe();
  expect_all_gone(read_pids(dir, "gc.", 2));
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  // Rank 0 ignores SIGTERM (and so does its `sleep`, inheriting the disposition); rank 1 fails.
  const std::string script = R"(
    if [ "$RANK" = 0 ]; then
      trap '' TERM; echo $$ > "$T/tmp.0" && mv "$T/tmp.0" "$T/pid.0"; while true; do sleep 0.05; done
    fi
    while [ ! -e "$T/pid.0" ]; do sleep 0.05; done
    exit 5)";
  ProcessResult r = gradsync::test::run(launch_args({"-n", "2", "--grace-period", "1", "--", "sh", "-c", script}),
                                        options_with_dir(dir.path()));
  EXPECT_EQ(r.exit_code, 5) << r.describe();
  EXPECT_GE(r.seconds, 0.9) << "rank 0 was killed before the grace period ended\n" << r.describe();
  EXPECT_LT(r.seconds, 8) << r.describe();
  expect_all_gone(read_pids(dir, "pid.", 1));
}

TEST(Launch, InvalidProcessCountsAreRejectedClearly) {
  for (std::string n : {"0", "-1", "abc", "1025", "2x", ""}) {
    SCOPED_TRACE("-n '" + n + "'");
    CommandOptions o;
    o.timeout = 30s;
    ProcessResult r = gradsync::test::run(launch_args({"-n", n, "--", "true"}), o);
    EXPECT_FALSE(r.ok()) << r.describe();
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.err.find("-n/--nproc-per-node must be an integer from 1 to 1024, got '" + n + "'"),
              std::string::npos)
        << r.describe();
  }
}

TEST(Launch, InvalidPortIsRejectedClearly) {
  CommandOptions o;
  o.timeout = 30s;
  ProcessResult r = gradsync::test::run(launch_args({"--master-port", "70000", "--", "true"}), o);
  EXPECT_FALSE(r.ok()) << r.describe();
  EXPECT_NE(r.err.find("--master-port must be an integer from 0 to 65535"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("'70000'"), std::string::npos) << r.describe();
}

TEST(Launch, MissingCommandIsRejectedClearly) {
  CommandOptions o;
  o.timeout = 30s;
  for (auto args : {std::vector<std::string>{"-n", "2"}, std::vector<std::string>{"-n", "2", "--"}}) {
    ProcessResult r = gradsync::test::run(launch_args(args), o);
    EXPECT_FALSE(r.ok()) << r.describe();
    EXPECT_NE(r.err.find("a command to run is required"), std::string::npos) << r.describe();
  }
}

TEST(Launch, NonexistentCommandIsReported) {
  CommandOptions o;
  o.timeout = 30s;
  ProcessResult r = gradsync::test::run(launch_args({"-n", "2", "--", "gradsync-no-such-command"}), o);
  EXPECT_EQ(r.exit_code, 127) << r.describe();
  EXPECT_NE(r.err.find("rank 0: cannot execute 'gradsync-no-such-command': No such file or directory"),
            std::string::npos)
      << r.describe();

  ProcessResult not_exec = gradsync::test::run(launch_args({"-n", "1", "--", "/etc/hostname"}), o);
  EXPECT_NE(not_exec.exit_code, 0) << not_exec.describe();
  EXPECT_NE(not_exec.err.find("cannot execute '/etc/hostname'"), std::string::npos) << not_exec.describe();
}

TEST(Launch, AllRanksSucceedingExitsZero) {
  CommandOptions o;
  o.timeout = 30s;
  ProcessResult r = gradsync::test::run(launch_args({"-n", "4", "--", "sh", "-c", "sleep 0.$RANK"}), o);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(r.err.empty()) << r.describe();
}

// The in-process API that `gradsync train` uses.
TEST(Launch, LibraryApiValidatesAndRuns) {
  gradsync::cli::LaunchOptions o;
  o.command = {"sh", "-c", R"(test "$GRADSYNC_TEST_VALUE" = "v$WORLD_SIZE" && exit $((RANK + 10)))"};
  o.nproc = 0;
  EXPECT_THROW(gradsync::cli::validate(o), gradsync::ConfigError);
  o.nproc = 2;
  o.master_port = 65536;
  EXPECT_THROW(gradsync::cli::validate(o), gradsync::ConfigError);
  o.master_port = 0;
  EXPECT_THROW(gradsync::cli::validate({}), gradsync::ConfigError);  // no command
  // extra_env reaches the rank (else `test` fails with 1); the rank's exit code becomes the result.
  o.extra_env = {{"GRADSYNC_TEST_VALUE", "v1"}};
  o.nproc = 1;
  EXPECT_EQ(gradsync::cli::launch(o), 10);
  o.command = {"true"};
  EXPECT_EQ(gradsync::cli::launch(o), 0);
}

}  // namespace
