// `gradsync launch`: starts N local ranks with torchrun's environment, forwards their output line by line
// with a rank prefix, and guarantees that a failing rank or a signal stops them all and that no process
// (ranks or their children) outlives the launcher.
//
// Design: one thread, one poll() loop over the ranks' stdout/stderr pipes and a self-pipe fed by signal
// handlers (SIGCHLD wakes the loop; SIGINT/SIGTERM/SIGHUP are forwarded). Each rank is the leader of its
// own process group, so signalling -pgid reaches everything it started. The ranks rendezvous through a
// c10d FileStore in a temp dir, so the launcher itself opens no socket.
#include "launch/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#if __has_include(<linux/close_range.h>)
#include <linux/close_range.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/format.h>


extern char** environ;

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxProcs = 1024;
constexpr size_t kReadChunk = 65536;
// A "line" longer than this is forwarded anyway, so a rank that never prints a newline cannot make the
// launcher buffer without bound.
constexpr size_t kMaxLine = 65536;
// After the last rank is gone, how long to wait for pipe output still in flight (a SIGKILLed grandchild
// may hold a pipe for a moment; one that escaped the process group must not keep us alive).
constexpr auto kDrainTimeout = std::chrono::milliseconds(500);

// ---- small system helpers ------------------------------------------------------------------------

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// Writes everything, retrying on EINTR and waiting if the destination is non-blocking. Output to a closed
// stdout (EPIPE) is dropped: losing output must not kill the ranks.
void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    if (n <= 0) return;
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_all(int fd, const std::string& s) { write_all(fd, s.data(), s.size()); }

template <typename... Args>
void report(fmt::format_string<Args...> format, Args&&... args) {
  write_all(STDERR_FILENO, "gradsync launch: " + fmt::format(format, std::forward<Args>(args)...) + "\n");
}

std::string signal_name(int sig) {
  const char* name = strsignal(sig);
  return name != nullptr ? name : "unknown signal";
}

std::string temp_root() {
  const char* dir = std::getenv("TMPDIR");
  return (dir != nullptr && *dir != '\0') ? dir : "/tmp";
}

// A fresh temp dir holding the FileStore; removed (with the store file) when the launch ends.
class TempDir {
 public:
  TempDir() : path_(temp_root() + "/gradsync-launch-XXXXXX") {
    if (mkdtemp(path_.data()) == nullptr) throw_errno("cannot create a temp dir in " + temp_root());
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Bind 127.0.0.1:0 and read the port back. Racy by nature (someone may take it before rank 0 binds it),
// which is also what torchrun --standalone does.
int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  int saved = errno;
  close(fd);
  errno = saved;
  if (!ok) throw_errno("cannot find a free port on 127.0.0.1");
  return ntohs(addr.sin_port);
}

// ---- validation / parsing ------------------------------------------------------------------------

std::optional<long> parse_long(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0') return std::nullopt;
  return value;
}

int parse_int_in(const std::string& text, const char* option, long lo, long hi, const char* note = "") {
  auto value = parse_long(text);
  if (!value || *value < lo || *value > hi) {
    throw std::invalid_argument(
        fmt::format("{} must be an integer from {} to {}{}, got '{}'", option, lo, hi, note, text));
  }
  return static_cast<int>(*value);
}

std::chrono::milliseconds parse_seconds(const std::string& text, const char* option) {
  char* end = nullptr;
  double seconds = text.empty() ? -1 : std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(seconds) || seconds < 0 || seconds > 86400) {
    throw std::invalid_argument(
        fmt::format("{} must be a number of seconds from 0 to 86400, got '{}'", option, text));
  }
  return std::chrono::milliseconds(static_cast<long>(std::llround(seconds * 1000)));
}

// ---- the ranks' environment ----------------------------------------------------------------------

using EnvMap = std::map<std::string, std::string>;

EnvMap current_environment() {
  EnvMap vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    auto eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return vars;
}

std::string random_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

// torchrun's rule: share the cores between the ranks instead of oversubscribing them N times.
std::string omp_threads(const EnvMap& env, int nproc) {
  if (auto it = env.find("OMP_NUM_THREADS"); it != env.end()) return it->second;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return std::to_string(std::max(1L, cores / nproc));
}

// What every rank shares.
EnvMap common_environment(const LaunchOptions& o, int port, const std::string& store_file) {
  EnvMap env = current_environment();
  // Inherited from an outer torchrun this would make Python ranks look for an agent store that does not
  // exist here; without it they use MASTER_ADDR/PORT with rank 0 as the TCPStore server.
  env.erase("TORCHELASTIC_USE_AGENT_STORE");
  env["OMP_NUM_THREADS"] = omp_threads(env, o.nproc);
  env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = env["ROLE_WORLD_SIZE"] = std::to_string(o.nproc);
  env["GROUP_RANK"] = "0";
  env["GROUP_WORLD_SIZE"] = "1";
  env["ROLE_NAME"] = "default";
  env["MASTER_ADDR"] = o.master_addr;
  env["MASTER_PORT"] = std::to_string(port);
  env["TORCHELASTIC_RESTART_COUNT"] = "0";
  env["TORCHELASTIC_MAX_RESTARTS"] = "0";
  env["TORCHELASTIC_RUN_ID"] = random_run_id();
  env["GRADSYNC_STORE_FILE"] = store_file;
  return env;
}

std::vector<std::string> rank_environment(EnvMap env, const LaunchOptions& o, int rank) {
  env["RANK"] = env["LOCAL_RANK"] = env["ROLE_RANK"] = std::to_string(rank);
  for (const auto& [name, value] : o.extra_env) env[name] = value;
  std::vector<std::string> out;
  for (const auto& [name, value] : env) out.push_back(name + "=" + value);
  return out;
}

// execvp's PATH search, done before fork(): the caller may be multi-threaded (torch), where only
// async-signal-safe calls are allowed in the child. Unresolved names are passed on as they are, so that
// execve reports the error (ENOENT) through the usual path.
std::string resolve_executable(const std::string& cmd, const EnvMap& env) {
  if (cmd.find('/') != std::string::npos) return cmd;
  auto it = env.find("PATH");
  std::string search = (it != env.end() && !it->second.empty()) ? it->second : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  for (;;) {
    size_t end = search.find(':', begin);
    std::string dir = search.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + cmd;
    struct stat st {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (end == std::string::npos) return cmd;
    begin = end + 1;
  }
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// ---- signals: self-pipe --------------------------------------------------------------------------

int g_signal_write_fd = -1;  // the handler's only state; launch() is not reentrant (see launch.h)

void on_signal(int sig) {
  int saved = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  ssize_t ignored = write(g_signal_write_fd, &byte, 1);  // non-blocking: a full pipe loses nothing useful
  (void)ignored;
  errno = saved;
}

// Routes SIGINT/SIGTERM/SIGHUP/SIGCHLD into a pipe the poll loop watches, ignores SIGPIPE (a closed stdout
// must not kill the launcher and, through PDEATHSIG, the ranks), and restores everything on destruction.
class SignalPipe {
 public:
  static constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

  SignalPipe() {
    if (pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
    g_signal_write_fd = fds_[1];
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kHandled); ++i) sigaction(kHandled[i], &sa, &old_[i]);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &old_pipe_);
  }
  ~SignalPipe() {
    for (size_t i = 0; i < std::size(kHandled); ++i) sigaction(kHandled[i], &old_[i], nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
    g_signal_write_fd = -1;
    close(fds_[0]);
    close(fds_[1]);
  }
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return fds_[0]; }
  std::vector<int> drain() {
    std::vector<int> signals;
    unsigned char buf[64];
    ssize_t n;
    while ((n = read(fds_[0], buf, sizeof buf)) > 0) signals.insert(signals.end(), buf, buf + n);
    return signals;
  }

 private:
  int fds_[2] = {-1, -1};
  struct sigaction old_[std::size(kHandled)] {};
  struct sigaction old_pipe_ {};
};

// ---- output forwarding ---------------------------------------------------------------------------

// One rank's stdout or stderr: reads the pipe, writes complete lines with the rank prefix, so lines of
// different ranks never interleave mid-line.
class LineForwarder {
 public:
  LineForwarder(int src, int dst, std::string prefix) : src_(src), dst_(dst), prefix_(std::move(prefix)) {}
  LineForwarder(LineForwarder&& o) noexcept
      : src_(std::exchange(o.src_, -1)), dst_(o.dst_), prefix_(std::move(o.prefix_)), pending_(std::move(o.pending_)) {}
  LineForwarder(const LineForwarder&) = delete;
  LineForwarder& operator=(const LineForwarder&) = delete;
  ~LineForwarder() { close_source(); }

  int fd() const { return src_; }
  bool open() const { return src_ >= 0; }

  // Reads what is available now (the pipe is non-blocking); closes the source at EOF.
  void read_available() {
    char buf[kReadChunk];
    while (src_ >= 0) {
      ssize_t n = read(src_, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      if (n <= 0) {
        close_source();
        return;
      }
      pending_.append(buf, static_cast<size_t>(n));
      forward_lines();
    }
  }

  // A partial last line still gets its prefix; the added newline keeps the next output on its own line.
  void flush_partial() {
    if (pending_.empty()) return;
    write_all(dst_, prefix_ + pending_ + (prefix_.empty() ? "" : "\n"));
    pending_.clear();
  }

  void close_source() {
    if (src_ >= 0) close(src_);
    src_ = -1;
    flush_partial();
  }

 private:
  void forward_lines() {
    std::string out;
    size_t start = 0;
    for (size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1) {
      out += prefix_;
      out.append(pending_, start, nl + 1 - start);
    }
    pending_.erase(0, start);
    if (pending_.size() >= kMaxLine) {
      out += prefix_ + pending_ + (prefix_.empty() ? "" : "\n");
      pending_.clear();
    }
    write_all(dst_, out);
  }

  int src_;
  int dst_;
  std::string prefix_;
  std::string pending_;
};

// ---- starting a rank -----------------------------------------------------------------------------

// Everything the child needs, prepared before fork().
struct ChildPlan {
  const char* path;
  char* const* argv;
  char* const* envp;
  int out_fd, err_fd, report_fd;
  pid_t launcher;
};

// Runs in the forked child: async-signal-safe calls only. On failure, errno goes to the launcher through
// the close-on-exec report pipe (a successful exec closes it, so the launcher reads EOF).
[[noreturn]] void exec_rank(const ChildPlan& plan) {
  // Our handlers would write into the launcher's self-pipe; ignored signals would survive exec.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Own group: the launcher can signal the rank together with everything it starts, and a Ctrl-C on
  // the terminal reaches only the launcher, which then stops the ranks in order.
  setpgid(0, 0);
  // Nothing survives a SIGKILLed launcher. Re-check the parent: it may have died before prctl.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != plan.launcher) _exit(127);
  dup2(plan.out_fd, STDOUT_FILENO);
  dup2(plan.err_fd, STDERR_FILENO);
#ifdef CLOSE_RANGE_CLOEXEC
  // Descriptors the launcher's caller left open are none of the rank's business.
  syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
#endif
  execve(plan.path, plan.argv, plan.envp);
  int err = errno;
  ssize_t ignored = write(plan.report_fd, &err, sizeof err);
  (void)ignored;
  _exit(127);
}

// 0 when the child's exec succeeded, else its errno.
int read_exec_report(int fd) {
  int err = 0;
  ssize_t n;
  do {
    n = read(fd, &err, sizeof err);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof err) ? err : 0;
}

struct Pipe {
  int read = -1, write = -1;
  Pipe() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw_errno("pipe2");
    read = fds[0];
    write = fds[1];
  }
  ~Pipe() {
    if (read >= 0) close(read);
    if (write >= 0) close(write);
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  int release_read() { return std::exchange(read, -1); }
};

struct Rank {
  int index = 0;
  pid_t pid = -1;  // also the pgid
  bool running = false;
  int status = 0;
  std::optional<LineForwarder> out, err;
};

// Fork/execs one rank. Returns 0 or the exec errno (the child then exits 127 and is reaped as usual).
int spawn_rank(Rank& rank, const std::string& path, std::vector<std::string> argv, std::vector<std::string> env,
               bool prefix) {
  Pipe out, err, exec_report;
  std::vector<char*> c_argv = c_strings(argv);
  std::vector<char*> c_env = c_strings(env);
  ChildPlan plan{path.c_str(), c_argv.data(), c_env.data(), out.write, err.write, exec_report.write, getpid()};
  // Block signals across fork so that our handlers never run in the child before it resets them.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid = fork();
  if (pid == 0) exec_rank(plan);
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    errno = fork_errno;
    throw_errno(fmt::format("cannot start rank {}", rank.index));
  }
  setpgid(pid, pid);  // also from the parent: the group exists whichever side runs first
  rank.pid = pid;
  rank.running = true;
  close(std::exchange(exec_report.write, -1));
  close(std::exchange(out.write, -1));
  close(std::exchange(err.write, -1));
  std::string tag = prefix ? fmt::format("[rank{}]: ", rank.index) : "";
  int out_fd = out.release_read(), err_fd = err.release_read();
  fcntl(out_fd, F_SETFL, O_NONBLOCK);
  fcntl(err_fd, F_SETFL, O_NONBLOCK);
  rank.out.emplace(out_fd, STDOUT_FILENO, tag);
  rank.err.emplace(err_fd, STDERR_FILENO, tag);
  return read_exec_report(exec_report.read);
}

// ---- the launcher --------------------------------------------------------------------------------

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : options_(options) {}

  int run() {
    int port = options_.master_port != 0 ? options_.master_port : pick_free_port();
    TempDir dir;
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
    const std::string path = resolve_executable(options_.command[0], common);
    ranks_.resize(static_cast<size_t>(options_.nproc));
    for (int r = 0; r < options_.nproc && !exit_code_; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      rank.index = r;
      int err = spawn_rank(rank, path, options_.command, rank_environment(common, options_, r),
                           options_.prefix_output);
      if (err != 0) on_exec_failure(rank, err);
      handle_signals();  // a Ctrl-C during start-up stops the start-up too
    }
  }

  void on_exec_failure(const Rank& rank, int err) {
    report("rank {}: cannot execute '{}': {}{}", rank.index, options_.command[0], std::strerror(err),
           rank.index > 0 ? "; stopping the other ranks" : "");
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
    if (kill_at_ && Clock::now() >= *kill_at_) signal_running(SIGKILL);
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
    if (WIFEXITED(status)) {
      report("rank {} (pid {}) exited with code {}; stopping the other ranks", r.index, r.pid,
             WEXITSTATUS(status));
      fail(WEXITSTATUS(status));
    } else {
      int sig = WTERMSIG(status);
      report("rank {} (pid {}) was killed by signal {} ({}); stopping the other ranks", r.index, r.pid, sig,
             signal_name(sig));
      fail(128 + sig);
    }
    stop(SIGTERM);
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
      if (r.running) kill(-r.pid, sig);
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
  std::vector<Rank> ranks_;
  SignalPipe* signals_ = nullptr;
  std::optional<Clock::time_point> kill_at_;
  std::optional<int> exit_code_;
  int launcher_signals_ = 0;
};

// ---- CLI -----------------------------------------------------------------------------------------

constexpr const char* kUsage = "usage: gradsync launch -n N [--master-addr A] [--master-port P] "
                               "[--grace-period SECONDS] [--no-prefix] -- CMD [ARGS...]";

struct CliArgs {
  std::string nproc = "1";
  std::string master_addr = "127.0.0.1";
  std::string master_port = "0";
  std::string grace = "5";
  bool no_prefix = false;
  std::vector<std::string> command;
};

LaunchOptions to_options(const CliArgs& a) {
  LaunchOptions o;
  o.nproc = parse_int_in(a.nproc, "-n/--nproc-per-node", 1, kMaxProcs);
  o.master_addr = a.master_addr;
  o.master_port = parse_int_in(a.master_port, "--master-port", 0, 65535, " (0: pick a free port)");
  o.grace = parse_seconds(a.grace, "--grace-period");
  o.prefix_output = !a.no_prefix;
  o.command = a.command;
  validate(o);
  return o;
}

}  // namespace

void validate(const LaunchOptions& o) {
  if (o.nproc < 1 || o.nproc > kMaxProcs) {
    throw std::invalid_argument(
        fmt::format("-n/--nproc-per-node must be an integer from 1 to {}, got '{}'", kMaxProcs, o.nproc));
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    throw std::invalid_argument(
        fmt::format("--master-port must be an integer from 0 to 65535 (0: pick a free port), got '{}'",
                    o.master_port));
  }
  if (o.master_addr.empty()) throw std::invalid_argument("--master-addr must not be empty");
  if (o.grace.count() < 0) {
    throw std::invalid_argument(fmt::format("--grace-period must be >= 0, got {} ms", o.grace.count()));
  }
  if (o.command.empty() || o.command[0].empty()) {
    throw std::invalid_argument("a command to run is required after '--'");
  }
}

int launch(const LaunchOptions& options) {
  validate(options);
  return Launcher(options).run();
}

void add_launch_command(CLI::App& root, int& exit_code) {
  auto args = std::make_shared<CliArgs>();
  CLI::App* sub = root.add_subcommand(
      "launch",
      "Run CMD as N local ranks (torchrun --standalone --nproc_per_node N --no_python): sets RANK, WORLD_SIZE, "
      "LOCAL_RANK, MASTER_ADDR/PORT, GRADSYNC_STORE_FILE, ...; prefixes output with [rank<r>]; stops all ranks "
      "when one fails and exits with its status. Put `--` before CMD.");
  sub->add_option("-n,--nproc-per-node", args->nproc, "number of ranks, 1..1024 (default 1)");
  sub->add_option("--master-addr", args->master_addr, "MASTER_ADDR for the ranks (default 127.0.0.1)");
  sub->add_option("--master-port", args->master_port, "MASTER_PORT for the ranks, 0..65535 (default 0: a free port)");
  sub->add_option("--grace-period", args->grace, "seconds between SIGTERM and SIGKILL when stopping (default 5)");
  sub->add_flag("--no-prefix", args->no_prefix, "do not prefix output lines with [rank<r>]");
  sub->add_option("command", args->command, "the command to run (after --) and its arguments");
  sub->callback([args, &exit_code] {
    LaunchOptions options;
    try {
      options = to_options(*args);
    } catch (const std::invalid_argument& e) {
      fmt::print(stderr, "gradsync launch: error: {}\n{}\n", e.what(), kUsage);
      exit_code = 2;
      return;
    }
    exit_code = launch(options);
  });
}

}  // namespace gradsync::cli
