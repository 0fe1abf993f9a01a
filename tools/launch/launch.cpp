// `gradsync launch`'s supervisor: starts N local ranks with torchrun's environment, forwards their output
// line by line with a rank prefix, and guarantees that a failing rank or a signal stops them all and that no
// process (ranks or their children) outlives the launcher.
//
// Design: one thread, one poll() loop over the ranks' stdout/stderr pipes (LineForwarder) and a self-pipe
// fed by signal handlers (SignalPipe: SIGCHLD wakes the loop; SIGINT/SIGTERM/SIGHUP are forwarded). Each
// rank is the leader of its own process group (spawn()), so signalling -pgid reaches everything it started.
// The ranks rendezvous through a c10d FileStore in a temp dir, so the launcher itself opens no socket.
#include "launch/launch.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <system_error>
#include <utility>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "launch/elastic.h"
#include "launch/line_forwarder.h"
#include "launch/mpirun.h"
#include "launch/rank_environment.h"
#include "launch/signal_pipe.h"
#include "launch/spawn.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

// After the last rank is gone, how long to wait for pipe output still in flight (a SIGKILLed grandchild
// may hold a pipe for a moment; one that escaped the process group must not keep us alive).
constexpr auto kDrainTimeout = std::chrono::milliseconds(500);

template <typename... Args>
void report(fmt::format_string<Args...> format, Args&&... args) {
  report_line(fmt::format(format, std::forward<Args>(args)...));
}

// How often a watch asks whether the round still runs.
constexpr auto kWatchInterval = std::chrono::milliseconds(1000);

// The state letter of /proc/<pid>/stat (R, S, T, Z, ...), '?' when it cannot be read.
char process_state(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

std::string signal_name(int sig) {
  const char* name = strsignal(sig);
  return name != nullptr ? name : "unknown signal";
}

struct Rank {
  int index = 0;
  std::string name;  // "rank 3", or "mpirun" when mpirun starts the ranks
  pid_t pid = -1;  // also the pgid
  bool running = false;
  int status = 0;
  std::optional<LineForwarder> out, err;
};

class Launcher {
 public:
  Launcher(const LaunchOptions& options, GroupWatch watch) : options_(options), watch_(std::move(watch)) {}

  // The first failure, as reported ("rank 1 (pid 123) was killed by signal 9 (Killed)"); "" when none.
  const std::string& first_failure() const { return first_failure_; }
  // Stopped by a signal to the launcher (SIGINT, SIGTERM, SIGHUP): a restart would not be wanted.
  bool signalled() const { return launcher_signals_ > 0; }
  // Why the watch stopped the ranks; "" when it did not.
  const std::string& interrupted() const { return interrupted_; }

  int run() {
    int port = options_.master_port != 0 ? options_.master_port : free_port();
    TempDir dir("gradsync-launch-");  // holds the FileStore; removed (with the store file) when the launch ends
    SignalPipe signals;
    signals_ = &signals;
    try {
      start_ranks(common_environment(options_, port, dir.path() + "/store"));
    } catch (...) {
      abandon();  // e.g. fork failed for rank 5: ranks 0-4 must not be left running
      throw;
    }
    while (any_running()) {
      wait_for_events();
      step();
    }
    kill_all_groups();  // grandchildren too: nothing outlives the launch
    drain_outputs();
    signals_ = nullptr;
    return exit_code_.value_or(0);
  }

 private:
  void start_ranks(const EnvMap& common) {
    if (options_.backend == Backend::Mpi) return start_mpirun(common);
    // Unresolved names are passed on as they are, so that execve reports the error (ENOENT) the usual way.
    const std::string path = find_executable(options_.command[0], common).value_or(options_.command[0]);
    ranks_.resize(static_cast<size_t>(options_.nproc));
    for (int r = 0; r < options_.nproc && !exit_code_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      rank.index = r;
      rank.name = fmt::format("rank {}", global_rank(options_, r));
      int err = start_rank(rank, path, options_.command, rank_environment(common, options_, r));
      if (err != 0) on_exec_failure(rank, err, options_.command[0]);
      handle_signals();  // a Ctrl-C during start-up stops the start-up too
      reap_ranks();      // so does a rank that already failed (a rendezvous timed out while hundreds start)
      if (exit_code_ && r + 1 < options_.nproc) report("started {} of {} ranks; starting no more", r + 1, options_.nproc);
    }
  }

  // One mpirun starts every rank (and reports which one failed); it is supervised like a single rank.
  void start_mpirun(const EnvMap& common) {
    auto argv = mpirun_argv(options_);
    const std::string path = find_executable(argv[0], common).value_or(argv[0]);
    ranks_.resize(1);
    ranks_[0].name = "mpirun";
    int err = start_rank(ranks_[0], path, argv, mpirun_environment(options_));
    if (err != 0) on_exec_failure(ranks_[0], err, "mpirun (install openmpi-bin)");
  }

  // Fork/execs one rank. Returns 0 or the exec errno (the child then exits 127 and is reaped as usual).
  int start_rank(Rank& rank, const std::string& path, std::vector<std::string> argv, std::vector<std::string> env) {
    Pipe out, err;
    SpawnRequest request;
    request.path = path;
    request.argv = std::move(argv);
    request.env = std::move(env);
    request.stdout_fd = out.write_fd();
    request.stderr_fd = err.write_fd();
    Spawned child;
    try {
      child = spawn(request);
    } catch (const std::system_error& e) {
      throw std::system_error(e.code(), fmt::format("cannot start {}", rank.name));
    }
    rank.pid = child.pid;
    rank.running = true;
    out.close_write();
    err.close_write();
    // mpirun tags its ranks' lines itself (--tag-output).
    const bool tag_here = options_.prefix_output && options_.backend != Backend::Mpi;
    std::string tag = tag_here ? fmt::format("[rank{}]: ", global_rank(options_, rank.index)) : "";
    rank.out.emplace(out.release_read(), STDOUT_FILENO, tag);
    rank.err.emplace(err.release_read(), STDERR_FILENO, tag);
    return child.exec_error;
  }

  void on_exec_failure(const Rank& rank, int err, const std::string& what) {
    if (first_failure_.empty()) {
      first_failure_ = fmt::format("{}: cannot execute '{}': {}", rank.name, what, std::strerror(err));
    }
    report("{}{}", first_failure_, rank.index > 0 ? "; stopping the other ranks" : "");
    fail(127);
    stop(SIGTERM);
  }

  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
  }

  // Sleeps until output, a signal (SIGCHLD included), or the grace deadline.
  void wait_for_events() {
    std::vector<pollfd> fds{{signals_->read_fd(), POLLIN, 0}};
    for (const Rank& r : ranks_) {
      for (const auto* f : {&r.out, &r.err}) {
        if (*f && (*f)->open()) fds.push_back({(*f)->fd(), POLLIN, 0});
      }
    }
    int timeout_ms = 1000;  // belt and braces: the loop re-checks the ranks at least once a second
    if (kill_at_) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(*kill_at_ - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<long>(left, 0, timeout_ms));
    }
    ::poll(fds.data(), fds.size(), timeout_ms);
  }

  void step() {
    for (Rank& r : ranks_) read_outputs(r);
    handle_signals();
    reap_ranks();
    ask_watch();
    if (kill_at_ && Clock::now() >= *kill_at_) signal_running(SIGKILL);
  }

  void ask_watch() {
    if (!watch_ || exit_code_ || Clock::now() < next_watch_) return;
    next_watch_ = Clock::now() + kWatchInterval;
    if (auto why = watch_(); !why.empty()) {
      interrupted_ = std::move(why);
      fail(0);  // stopping, and no rank's exit from now on is a failure of its own
      stop(SIGTERM);
    }
  }

  static void read_outputs(Rank& r) {
    if (r.out) r.out->read_available();
    if (r.err) r.err->read_available();
  }

  void handle_signals() {
    for (int sig : signals_->drain()) {
      if (sig == SIGCHLD) continue;  // only a wake-up: reap_ranks() checks every rank
      if (++launcher_signals_ > 1) {
        // A second Ctrl-C / SIGTERM means "now": skip the rest of the grace period.
        signal_running(SIGKILL);
        continue;
      }
      report("received signal {} ({}); stopping the ranks", sig, signal_name(sig));
      fail(128 + sig);
      stop(sig);
    }
  }

  void reap_ranks() {
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      if (waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      r.status = status;
      on_rank_exit(r);
    }
  }

  void on_rank_exit(Rank& r) {
    const int status = r.status;
    if (exit_code_) return;  // already stopping: this exit is the expected consequence
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
    read_outputs(r);  // its last words first, then the verdict
    if (const auto stopped = stopped_ranks(); !stopped.empty()) {
      // A stopped rank fails nobody itself: the others time out waiting for it. It is the cause, name it first.
      first_failure_ = fmt::format("{} stopped (SIGSTOP or a debugger), so the others waited for it; ", stopped);
    }
    if (WIFEXITED(status)) {
      first_failure_ += fmt::format("{} (pid {}) exited with code {}", r.name, r.pid, WEXITSTATUS(status));
      fail(WEXITSTATUS(status));
    } else {
      int sig = WTERMSIG(status);
      first_failure_ += fmt::format("{} (pid {}) was killed by signal {} ({})", r.name, r.pid, sig, signal_name(sig));
      fail(128 + sig);
    }
    report("{}; stopping the other ranks", first_failure_);
    stop(SIGTERM);
  }

  // "rank 1 (pid 123) is" / "rank 1 (pid 123) and rank 2 (pid 124) are" for the running ranks in stopped state.
  std::string stopped_ranks() const {
    std::vector<std::string> names;
    for (const Rank& r : ranks_) {
      const char state = r.running ? process_state(r.pid) : '?';
      if (state == 'T' || state == 't') names.push_back(fmt::format("{} (pid {})", r.name, r.pid));
    }
    if (names.empty()) return "";
    return fmt::format("{} {}", fmt::join(names, " and "), names.size() == 1 ? "is" : "are");
  }

  // Only the first failure is the cause: later ones are usually its consequences.
  void fail(int code) {
    if (!exit_code_) exit_code_ = code;
  }

  // Sends `sig` to every running rank's group and starts the grace period (the first one counts).
  void stop(int sig) {
    signal_running(sig);
    if (!kill_at_) kill_at_ = Clock::now() + options_.grace;
  }

  void signal_running(int sig) {
    for (const Rank& r : ranks_) {
      if (!r.running) continue;
      kill(-r.pid, sig);
      if (sig != SIGKILL) kill(-r.pid, SIGCONT);  // a stopped rank handles the signal only once it runs again
    }
  }

  void abandon() {
    kill_all_groups();
    for (Rank& r : ranks_) {
      if (r.running) waitpid(r.pid, nullptr, 0);
      r.running = false;
    }
  }

  void kill_all_groups() {
    for (const Rank& r : ranks_) {
      if (r.pid > 0) kill(-r.pid, SIGKILL);  // ESRCH (group already empty) is the normal case
    }
  }

  // Forwards output still in the pipes. Bounded: a process that escaped its group may hold a pipe forever.
  void drain_outputs() {
    const auto until = Clock::now() + kDrainTimeout;
    for (;;) {
      std::vector<pollfd> fds;
      for (Rank& r : ranks_) {
        read_outputs(r);
        for (const auto* f : {&r.out, &r.err}) {
          if (*f && (*f)->open()) fds.push_back({(*f)->fd(), POLLIN, 0});
        }
      }
      auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()).count();
      if (fds.empty() || left <= 0) break;
      ::poll(fds.data(), fds.size(), static_cast<int>(left));
    }
    for (Rank& r : ranks_) {
      if (r.out) r.out->close_source();
      if (r.err) r.err->close_source();
    }
  }

  const LaunchOptions& options_;
  GroupWatch watch_;
  Clock::time_point next_watch_ = Clock::now() + kWatchInterval;
  std::string interrupted_;
  std::vector<Rank> ranks_;
  SignalPipe* signals_ = nullptr;
  std::optional<Clock::time_point> kill_at_;
  std::optional<int> exit_code_;
  std::string first_failure_;
  int launcher_signals_ = 0;
};

}  // namespace

void validate(const LaunchOptions& o) {
  if (o.nproc < 1 || o.nproc > kMaxNproc) {
    throw ConfigError(
        fmt::format("-n/--nproc-per-node must be an integer from 1 to {}, got '{}'", kMaxNproc, o.nproc));
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    throw ConfigError(
        fmt::format("--master-port must be an integer from 0 to 65535 (0: pick a free port), got '{}'",
                    o.master_port));
  }
  if (o.nnodes < 1 || o.nnodes > kMaxNproc) {
    throw ConfigError(fmt::format("--nnodes must be an integer from 1 to {}, got '{}'", kMaxNproc, o.nnodes));
  }
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw ConfigError(fmt::format("--node-rank must be an integer from 0 to {} (--nnodes {} launchers), got '{}'",
                                  o.nnodes - 1, o.nnodes, o.node_rank));
  }
  if (o.nnodes > 1 && o.master_port == 0) {
    throw ConfigError(fmt::format("--nnodes {} needs --master-port: every launcher's ranks meet rank 0's store at "
                                  "--master-addr:--master-port, so the port must be chosen, not picked", o.nnodes));
  }
  if (o.nnodes > 1 && o.backend == Backend::Mpi) {
    throw ConfigError("--nnodes with --backend mpi: one mpirun starts every node's ranks; give mpirun its hosts "
                      "(mpirun --host A,B or --hostfile) instead of one launcher per node");
  }
  if (o.master_addr.empty()) {
    throw ConfigError("--master-addr must not be empty; expected a host name or address such as 127.0.0.1");
  }
  if (o.grace.count() < 0) {
    throw ConfigError(fmt::format("--grace-period must be >= 0, got {} ms", o.grace.count()));
  }
  if (o.max_restarts < 0 || o.max_restarts > kMaxRestarts) {
    throw ConfigError(fmt::format("--max-restarts must be an integer from 0 to {}, got '{}'", kMaxRestarts,
                                  o.max_restarts));
  }
  if (o.min_nodes > 0) validate_elastic(o);
  if (o.command.empty() || o.command[0].empty()) {
    throw ConfigError("a command to run is required after '--'");
  }
}

GroupResult run_group(const LaunchOptions& options, const GroupWatch& watch) {
  Launcher launcher(options, watch);
  GroupResult result;
  result.code = launcher.run();
  result.first_failure = launcher.first_failure();
  result.signalled = launcher.signalled();
  result.interrupted = launcher.interrupted();
  return result;
}

// Like torchrun's elastic agent: a failed group is stopped whole and started again, with
// TORCHELASTIC_RESTART_COUNT telling the ranks which attempt this is (they resume from their checkpoint).
int launch(const LaunchOptions& options) {
  validate(options);
  if (options.min_nodes > 0) return launch_elastic(options);
  std::string first_failure;
  int first_code = 0;
  for (int attempt = 0;; ++attempt) {
    LaunchOptions attempt_options = options;
    attempt_options.restart_count = attempt;
    const GroupResult group = run_group(attempt_options);
    // A signal to the launcher means stop; a command that cannot be executed will not run the next time either.
    if (group.code == 0 || group.code == 127 || group.signalled) return group.code;
    if (first_failure.empty()) {
      first_failure = group.first_failure;
      first_code = group.code;
    }
    if (attempt == options.max_restarts) {
      if (options.max_restarts > 0) {
        report("giving up after {} restart(s); the first failure: {}", options.max_restarts, first_failure);
      }
      return first_code;
    }
    report("restarting the group ({} of {})", attempt + 1, options.max_restarts);
  }
}

void report_line(const std::string& line) { write_all(STDERR_FILENO, "gradsync launch: " + line + "\n"); }

std::string error_text(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  return torch_error ? torch_error->what_without_backtrace() : e.what();
}

void print_error(const std::exception& e) {
  fmt::print(stderr, "gradsync: error: {}\n", error_text(e));
  std::fflush(stderr);
}

}  // namespace gradsync::cli
