// Implementation notes: the test binary is multi-threaded (torch thread pools), so between fork() and
// exec the child only makes async-signal-safe calls; everything it needs (argv, envp, the resolved
// executable path) is prepared by the parent beforehand. Children are polled with waitpid(WNOHANG) rather
// than via SIGCHLD so that no process-wide signal handler is installed behind the tests' back.
#include "support/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>

#include <fmt/format.h>

extern char** environ;

namespace gradsync::test {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

std::string temp_root() {
  const char* dir = std::getenv("TMPDIR");
  return (dir != nullptr && *dir != '\0') ? dir : "/tmp";
}

// An unlinked, close-on-exec temp file: it disappears with the last descriptor, and a child started
// concurrently from another thread does not inherit it.
int anonymous_temp_file() {
  std::string path = temp_root() + "/gradsync-out-XXXXXX";
  int fd = mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) throw_errno("cannot create a temp file in " + temp_root());
  unlink(path.c_str());
  return fd;
}

std::string read_all(int fd) {
  std::string data;
  char buf[65536];
  off_t offset = 0;
  for (;;) {
    ssize_t n = pread(fd, buf, sizeof buf, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    data.append(buf, static_cast<size_t>(n));
    offset += n;
  }
  return data;
}

// The child's environment: the current one, minus `unset_env`, plus `env` (later entries win).
std::vector<std::string> child_environment(const CommandOptions& opts) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    auto eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& name : opts.unset_env) vars.erase(name);
  for (const auto& [name, value] : opts.env) vars[name] = value;
  std::vector<std::string> out;
  for (const auto& [name, value] : vars) out.push_back(name + "=" + value);
  return out;
}

std::string lookup(const std::vector<std::string>& env, const std::string& name) {
  for (const auto& entry : env) {
    if (entry.compare(0, name.size() + 1, name + "=") == 0) return entry.substr(name.size() + 1);
  }
  return {};
}

// execvp's PATH search, done in the parent (execvp itself may allocate, which is unsafe after fork in a
// multi-threaded process). Uses the child's PATH so that `env PATH=...`-style overrides behave as expected.
std::optional<std::string> resolve_executable(const std::string& cmd, const std::string& path_env) {
  if (cmd.find('/') != std::string::npos) return cmd;
  std::string search = path_env.empty() ? "/usr/local/bin:/usr/bin:/bin" : path_env;
  size_t begin = 0;
  for (;;) {
    size_t end = search.find(':', begin);
    std::string dir = search.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + cmd;
    struct stat st {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (end == std::string::npos) return std::nullopt;
    begin = end + 1;
  }
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Everything the child needs, prepared before fork().
struct ChildPlan {
  const char* path;
  char* const* argv;
  char* const* envp;
  const char* cwd;  // nullptr: inherit
  int out_fd, err_fd, report_fd;
  bool kill_with_parent;
  pid_t parent;
};

// Runs in the forked child: async-signal-safe calls only. On failure, errno goes to the parent through
// the close-on-exec report pipe (which a successful exec closes, so the parent reads EOF).
[[noreturn]] void exec_child(const ChildPlan& plan) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Ignored signals survive exec; the child must see SIGTERM/SIGINT/SIGPIPE with default behaviour.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  setpgid(0, 0);
  if (plan.kill_with_parent) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != plan.parent) _exit(127);  // the parent died before prctl took effect
  }
  int null_fd = open("/dev/null", O_RDONLY);
  if (null_fd >= 0) dup2(null_fd, 0);
  dup2(plan.out_fd, 1);
  dup2(plan.err_fd, 2);
  int err = 0;
  if (plan.cwd != nullptr && chdir(plan.cwd) != 0) {
    err = errno;
  } else {
    execve(plan.path, plan.argv, plan.envp);
    err = errno;
  }
  ssize_t ignored = write(plan.report_fd, &err, sizeof err);
  (void)ignored;
  _exit(127);
}

// Reads the child's exec report: 0 when exec succeeded, else the errno of the failed step.
int read_exec_report(int fd) {
  int err = 0;
  ssize_t n;
  do {
    n = read(fd, &err, sizeof err);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof err) ? err : 0;
}

std::string tail(const std::string& s, size_t max_bytes) {
  if (s.size() <= max_bytes) return s;
  return "[...]" + s.substr(s.size() - max_bytes);
}

}  // namespace

bool ProcessResult::ok() const { return !timed_out && term_signal == 0 && exit_code == 0; }

std::string ProcessResult::describe() const {
  std::string status;
  if (timed_out) {
    status = fmt::format("timed out after {:.1f} s", seconds);
  } else if (term_signal != 0) {
    status = fmt::format("signal {} ({}) after {:.2f} s", term_signal, strsignal(term_signal), seconds);
  } else {
    status = fmt::format("exit {} after {:.2f} s", exit_code, seconds);
  }
  constexpr size_t kTail = 4000;
  return fmt::format("{}\n--- stdout ---\n{}\n--- stderr ---\n{}", status, tail(out, kTail),
                     tail(err, kTail));
}

Process Process::start(std::vector<std::string> argv, CommandOptions opts) {
  if (argv.empty()) throw std::invalid_argument("Process::start: empty argv");
  Process p;
  p.started_ = Clock::now();
  p.timeout_ = opts.timeout;
  p.deadline_ = p.started_ + opts.timeout;
  p.out_fd_ = anonymous_temp_file();
  p.err_fd_ = anonymous_temp_file();

  std::vector<std::string> env = child_environment(opts);
  std::optional<std::string> path = resolve_executable(argv[0], lookup(env, "PATH"));
  if (!path) {
    p.reaped_ = true;
    p.result_.exit_code = 127;
    p.result_.err = fmt::format("cannot execute '{}': {}\n", argv[0], std::strerror(ENOENT));
    return p;
  }
  std::vector<char*> c_argv = c_strings(argv);
  std::vector<char*> c_env = c_strings(env);
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) throw_errno("pipe2");
  ChildPlan plan{path->c_str(), c_argv.data(), c_env.data(), opts.cwd.empty() ? nullptr : opts.cwd.c_str(),
                 p.out_fd_,     p.err_fd_,     report[1],    opts.kill_with_parent, getpid()};
  pid_t pid = fork();
  if (pid < 0) {
    int saved = errno;
    close(report[0]);
    close(report[1]);
    errno = saved;
    throw_errno("fork");
  }
  if (pid == 0) exec_child(plan);
  // Also set the group from the parent: whichever side runs first, the group exists before anyone
  // signals it.
  setpgid(pid, pid);
  close(report[1]);
  int exec_error = read_exec_report(report[0]);
  close(report[0]);
  p.pid_ = pid;
  if (exec_error != 0) {
    p.wait();  // reaps the child, which has already _exit(127)ed
    p.result_.err += fmt::format("cannot execute '{}': {}\n", argv[0], std::strerror(exec_error));
  }
  return p;
}

Process::Process(Process&& other) noexcept { *this = std::move(other); }

Process& Process::operator=(Process&& other) noexcept {
  if (this == &other) return *this;
  release();
  pid_ = std::exchange(other.pid_, -1);
  out_fd_ = std::exchange(other.out_fd_, -1);
  err_fd_ = std::exchange(other.err_fd_, -1);
  reaped_ = std::exchange(other.reaped_, true);
  collected_ = std::exchange(other.collected_, true);
  started_ = other.started_;
  deadline_ = other.deadline_;
  timeout_ = other.timeout_;
  result_ = std::move(other.result_);
  return *this;
}

Process::~Process() { release(); }

void Process::release() noexcept {
  if (pid_ > 0 && !reaped_) {
    kill(-pid_, SIGKILL);
    while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  if (out_fd_ >= 0) close(out_fd_);
  if (err_fd_ >= 0) close(err_fd_);
  out_fd_ = err_fd_ = -1;
  pid_ = -1;
}

pid_t Process::pid() const { return pid_; }

void Process::signal(int sig) {
  // Once reaped, the pid may be reused: never signal it again.
  if (pid_ > 0 && !reaped_) kill(-pid_, sig);
}

void Process::reap(int status) {
  reaped_ = true;
  result_.seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  if (WIFEXITED(status)) result_.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result_.term_signal = WTERMSIG(status);
}

bool Process::poll() {
  if (reaped_) return true;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) reap(status);
  return reaped_;
}

ProcessResult Process::wait() {
  auto interval = std::chrono::milliseconds(1);
  while (!poll()) {
    auto now = Clock::now();
    if (now >= deadline_) {
      kill(-pid_, SIGKILL);
      int status = 0;
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      reap(status);
      result_.timed_out = true;
      break;
    }
    // Short sleeps first (most test commands are quick), then back off to keep polling cheap.
    std::this_thread::sleep_for(std::min<Clock::duration>(interval, deadline_ - now));
    interval = std::min(interval * 2, std::chrono::milliseconds(20));
  }
  if (!collected_) {
    collected_ = true;
    if (out_fd_ >= 0) result_.out = read_all(out_fd_) + result_.out;
    if (err_fd_ >= 0) result_.err = read_all(err_fd_) + result_.err;
  }
  return result_;
}

ProcessResult run(std::vector<std::string> argv, CommandOptions opts) {
  return Process::start(std::move(argv), std::move(opts)).wait();
}

namespace {

CommandOptions rank_options(const CommandOptions& base, int rank, int world_size, int port,
                            const std::string& store_file) {
  CommandOptions o = base;
  o.env = {{"RANK", std::to_string(rank)},
           {"WORLD_SIZE", std::to_string(world_size)},
           {"LOCAL_RANK", std::to_string(rank)},
           {"LOCAL_WORLD_SIZE", std::to_string(world_size)},
           {"MASTER_ADDR", "127.0.0.1"},
           {"MASTER_PORT", std::to_string(port)},
           {"GRADSYNC_STORE_FILE", store_file},
           {"OMP_NUM_THREADS", "1"}};
  o.env.insert(o.env.end(), base.env.begin(), base.env.end());  // the caller's entries win
  return o;
}

// SIGKILLs a still-running rank and collects it.
ProcessResult kill_and_collect(Process& p, bool timed_out) {
  p.signal(SIGKILL);
  ProcessResult r = p.wait();
  r.timed_out = r.timed_out || timed_out;
  return r;
}

}  // namespace

std::vector<ProcessResult> run_ranks(int world_size, std::vector<std::string> argv, CommandOptions opts) {
  if (world_size < 1) throw std::invalid_argument(fmt::format("run_ranks: world_size {} < 1", world_size));
  const std::string dir = make_temp_dir("gradsync-ranks-");
  const int port = free_port();
  std::vector<Process> procs;
  for (int r = 0; r < world_size; ++r) {
    procs.push_back(Process::start(argv, rank_options(opts, r, world_size, port, dir + "/store")));
  }
  const auto deadline = Clock::now() + opts.timeout;
  std::optional<Clock::time_point> stop_at;  // set by the first failure: the others get 5 s
  std::vector<std::optional<ProcessResult>> results(world_size);
  for (;;) {
    bool all_done = true;
    for (int r = 0; r < world_size; ++r) {
      if (results[r]) continue;
      if (!procs[r].poll()) {
        all_done = false;
        continue;
      }
      results[r] = procs[r].wait();
      if (!results[r]->ok() && !stop_at) stop_at = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    }
    if (all_done) break;
    auto now = Clock::now();
    bool past_deadline = now >= deadline;
    if (past_deadline || (stop_at && now >= *stop_at)) {
      for (int r = 0; r < world_size; ++r) {
        if (!results[r]) results[r] = kill_and_collect(procs[r], past_deadline);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  std::vector<ProcessResult> out;
  for (auto& r : results) out.push_back(std::move(*r));
  return out;
}

bool process_alive(pid_t pid) {
  if (pid <= 0) return false;
  std::ifstream stat_file(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!stat_file || !std::getline(stat_file, stat)) return false;
  // Format: "pid (comm) state ...": comm may contain spaces and parentheses, so find the last ')'.
  auto close_paren = stat.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= stat.size()) return false;
  char state = stat[close_paren + 2];
  return state != 'Z' && state != 'X' && state != 'x';
}

std::string make_temp_dir(const std::string& prefix) {
  std::string path = temp_root() + "/" + prefix + "XXXXXX";
  if (mkdtemp(path.data()) == nullptr) throw_errno("cannot create a temp dir " + path);
  return path;
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    throw_errno("cannot find a free port on 127.0.0.1");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace gradsync::test
