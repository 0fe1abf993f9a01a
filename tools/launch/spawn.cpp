// Starting child processes (see spawn.h). The callers are multi-threaded (torch thread pools), so between
// fork() and exec the child makes async-signal-safe calls only: everything it needs (path, argv, envp,
// descriptors) is prepared by the parent beforehand, in a ChildPlan.
#include "launch/spawn.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
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

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "gradsync/error.h"

extern char** environ;

namespace gradsync::cli {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
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
  bool null_stdin, kill_with_parent;
  pid_t parent;
};

// Ignored signals survive exec, and handlers the parent installed (the launcher's write into its
// self-pipe) must never run in the child: every disposition back to default, then nothing blocked.
void reset_signals() {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
}

void redirect_io(const ChildPlan& plan) {
  if (plan.null_stdin) {
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
  }
  dup2(plan.out_fd, STDOUT_FILENO);
  dup2(plan.err_fd, STDERR_FILENO);
#ifdef CLOSE_RANGE_CLOEXEC
  // Descriptors the caller left open (without O_CLOEXEC) are none of the child's business.
  syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
#endif
}

// Runs in the forked child: async-signal-safe calls only. On failure, errno goes to the parent through
// the close-on-exec report pipe (a successful exec closes it, so the parent reads EOF).
[[noreturn]] void exec_child(const ChildPlan& plan) {
  reset_signals();
  // Own group: the parent can signal the child together with everything it starts, and a Ctrl-C on the
  // terminal reaches only the parent, which then stops its children in order.
  setpgid(0, 0);
  if (plan.kill_with_parent) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != plan.parent) _exit(127);  // the parent died before prctl took effect
  }
  redirect_io(plan);
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

// 0 when the child's exec succeeded (EOF), else the errno it reported.
int read_exec_report(int fd) {
  int err = 0;
  ssize_t n;
  do {
    n = read(fd, &err, sizeof err);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof err) ? err : 0;
}

}  // namespace

EnvMap current_environment() {
  EnvMap vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    auto eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return vars;
}

std::vector<std::string> env_entries(const EnvMap& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [name, value] : env) out.push_back(name + "=" + value);
  return out;
}

std::optional<std::string> find_executable(const std::string& name, const EnvMap& env) {
  if (name.find('/') != std::string::npos) return name;
  auto it = env.find("PATH");
  std::string search = (it != env.end() && !it->second.empty()) ? it->second : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  for (;;) {
    size_t end = search.find(':', begin);
    std::string dir = search.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    struct stat st {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    if (end == std::string::npos) return std::nullopt;
    begin = end + 1;
  }
}

Pipe::Pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw_errno("pipe2");
  read_ = fds[0];
  write_ = fds[1];
}

Pipe::~Pipe() {
  if (read_ >= 0) close(read_);
  close_write();
}

int Pipe::release_read() { return std::exchange(read_, -1); }

void Pipe::close_write() {
  if (write_ >= 0) close(std::exchange(write_, -1));
}

Spawned spawn(const SpawnRequest& request) {
  std::vector<std::string> argv = request.argv, env = request.env;  // c_strings() needs mutable storage
  std::vector<char*> c_argv = c_strings(argv), c_env = c_strings(env);
  Pipe report;
  ChildPlan plan{request.path.c_str(), c_argv.data(), c_env.data(),
                 request.cwd.empty() ? nullptr : request.cwd.c_str(),
                 request.stdout_fd, request.stderr_fd, report.write_fd(),
                 request.null_stdin, request.kill_with_parent, getpid()};
  // Block signals across fork so that the parent's handlers never run in the child before it resets them.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid = fork();
  if (pid == 0) exec_child(plan);
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    errno = fork_errno;
    throw_errno("fork");
  }
  // Also from the parent: whichever side runs first, the group exists before anyone signals it.
  setpgid(pid, pid);
  report.close_write();
  return Spawned{pid, read_exec_report(report.read_fd())};
}

int free_port(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int err = getaddrinfo(host.c_str(), "0", &hints, &found); err != 0 || found == nullptr) {
    throw std::system_error(std::make_error_code(std::errc::invalid_argument),
                            fmt::format("cannot find a free port on {}: {}", host, gai_strerror(err)));
  }
  int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  bool ok = fd >= 0 && bind(fd, found->ai_addr, found->ai_addrlen) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  int saved = errno;
  freeaddrinfo(found);
  if (fd >= 0) close(fd);
  errno = saved;
  if (!ok) throw_errno(fmt::format("cannot find a free port on {}", host));
  const auto* v4 = reinterpret_cast<const sockaddr_in*>(&addr);
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr);
  return ntohs(addr.ss_family == AF_INET6 ? v6->sin6_port : v4->sin_port);
}

std::string temp_root() {
  const char* dir = std::getenv("TMPDIR");
  return (dir != nullptr && *dir != '\0') ? dir : "/tmp";
}

std::string make_temp_dir(const std::string& prefix) {
  std::string path = temp_root() + "/" + prefix + "XXXXXX";
  if (mkdtemp(path.data()) == nullptr) throw_errno("cannot create a temp dir " + path);
  return path;
}

TempDir::TempDir(const std::string& prefix) : path_(make_temp_dir(prefix)) {}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string self_executable() {
  std::error_code ec;
  std::filesystem::path path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error(fmt::format("cannot read /proc/self/exe (this program's path, to re-run it): {}", ec.message()));
  return path.string();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::optional<int> run_logged(const std::vector<std::string>& argv, const std::string& dir, const std::string& log,
                              std::chrono::milliseconds timeout, const EnvMap& env) {
  EnvMap child_env = current_environment();
  for (const auto& [name, value] : env) child_env[name] = value;
  const auto path = find_executable(argv.at(0), child_env);
  if (!path) throw Error(fmt::format("'{}' is not installed (not found in PATH)", argv[0]));
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(fmt::format("cannot write {}: {}", log, std::strerror(errno)));
  SpawnRequest request;
  request.path = *path;
  request.argv = argv;
  request.env = env_entries(child_env);
  request.cwd = dir;
  request.stdout_fd = request.stderr_fd = fd;
  request.null_stdin = true;
  Spawned child;
  try {
    child = spawn(request);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(child.pid, &status, WNOHANG);
    if (done == child.pid) return status;
    if (done < 0 && errno != EINTR) return std::nullopt;
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(-child.pid, SIGKILL);
      while (waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
      }
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace gradsync::cli
