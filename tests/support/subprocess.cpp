// Implementation notes: children are started by gradsync's own spawner (tools/launch/spawn.h, shared
// with `gradsync launch`), which prepares everything before fork() because the test binary is
// multi-threaded. Children are polled with waitpid(WNOHANG) rather than via SIGCHLD so that no
// process-wide signal handler is installed behind the tests' back.
#include "support/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "launch/mpirun.h"
#include "launch/spawn.h"

namespace gradsync::test {
namespace {

using Clock = std::chrono::steady_clock;

// An unlinked, close-on-exec temp file: it disappears with the last descriptor, and a child started
// concurrently from another thread does not inherit it.
int anonymous_temp_file() {
  std::string path = cli::temp_root() + "/gradsync-out-XXXXXX";
  int fd = mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) {
    throw std::system_error(errno, std::generic_category(), "cannot create a temp file in " + cli::temp_root());
  }
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
cli::EnvMap child_environment(const CommandOptions& opts) {
  cli::EnvMap vars = cli::current_environment();
  for (const auto& name : opts.unset_env) vars.erase(name);
  for (const auto& [name, value] : opts.env) vars[name] = value;
  return vars;
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

  cli::EnvMap env = child_environment(opts);
  // The child's PATH, so that `env PATH=...`-style overrides behave as expected.
  std::optional<std::string> path = cli::find_executable(argv[0], env);
  if (!path) {
    p.reaped_ = true;
    p.result_.exit_code = 127;
    p.result_.err = fmt::format("cannot execute '{}': {}\n", argv[0], std::strerror(ENOENT));
    return p;
  }
  cli::SpawnRequest request;
  request.path = *path;
  request.argv = argv;
  request.env = cli::env_entries(env);
  request.cwd = opts.cwd;
  request.stdout_fd = p.out_fd_;
  request.stderr_fd = p.err_fd_;
  request.null_stdin = true;
  request.kill_with_parent = opts.kill_with_parent;
  cli::Spawned child = cli::spawn(request);
  p.pid_ = child.pid;
  if (child.exec_error != 0) {
    p.wait();  // reaps the child, which has already _exit(127)ed
    p.result_.err += fmt::format("cannot execute '{}': {}\n", argv[0], std::strerror(child.exec_error));
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

std::vector<std::string> launcher_variables(std::vector<std::string> also) {
  std::vector<std::string> names{"RANK", "WORLD_SIZE", "GRADSYNC_STORE_FILE", "MASTER_ADDR", "MASTER_PORT"};
  names.insert(names.end(), also.begin(), also.end());
  return names;
}

CommandOptions job_options(std::chrono::seconds timeout, std::vector<std::string> also_unset) {
  CommandOptions o;
  o.timeout = timeout;
  o.env = {{"OMP_NUM_THREADS", "1"}};
  o.unset_env = launcher_variables(std::move(also_unset));
  return o;
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
  const cli::TempDir dir("gradsync-ranks-");  // removed with its store file when the ranks are done
  const int port = free_port();
  std::vector<Process> procs;
  for (int r = 0; r < world_size; ++r) {
    procs.push_back(Process::start(argv, rank_options(opts, r, world_size, port, dir.file("store"))));
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
  std::vector<ProcessResult> out;
  for (auto& r : results) out.push_back(std::move(*r));
  return out;
}

ProcessResult run_mpi_ranks(int world_size, std::vector<std::string> argv, CommandOptions opts) {
  cli::LaunchOptions launch;  // the product's mpirun command line (tools/launch/mpirun.h), output tagged
  launch.nproc = world_size;
  launch.command = std::move(argv);
  auto cmd = cli::mpirun_argv(launch);
  opts.unset_env.insert(opts.unset_env.end(), {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                               "MASTER_PORT", "GRADSYNC_STORE_FILE"});
  opts.env.insert(opts.env.begin(), {{"OMP_NUM_THREADS", "1"}, {"GRADSYNC_BACKEND", "mpi"}});
  return run(cmd, opts);
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

std::string make_temp_dir(const std::string& prefix) { return cli::make_temp_dir(prefix); }

int free_port() { return cli::free_port(); }

std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> out;
  for (pid_t child; in >> child;) out.push_back(child);
  return out;
}

size_t line_count(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

std::string mapped_file(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range, perms, offset, device, inode, path;
    fields >> range >> perms >> offset >> device >> inode;
    std::getline(fields >> std::ws, path);
    const auto dash = range.find('-');
    if (at >= std::stoull(range.substr(0, dash), nullptr, 16) && at < std::stoull(range.substr(dash + 1), nullptr, 16)) {
      return path;
    }
  }
  return "";
}

uint64_t free_shm_bytes() {
  struct statvfs fs {};
  return ::statvfs("/dev/shm", &fs) == 0 ? static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize : 0;
}

std::vector<std::string> listeners_on(int port) {
  std::vector<std::string> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      if (state == "0A" && local.size() > 5 && std::stoi(local.substr(local.size() - 4), nullptr, 16) == port) {
        out.push_back(local);  // 0A: LISTEN
      }
    }
  }
  return out;
}

}  // namespace gradsync::test
