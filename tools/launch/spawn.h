// defines: how gradsync starts a child process, used by `gradsync launch` (launch.cpp) and by the tests'
// Process (tests/support/subprocess.cpp), so that both rely on one implementation:
//   spawn()                 fork + exec in the child's own process group, PR_SET_PDEATHSIG, the exec
//                           failure (errno) reported back through a close-on-exec pipe
//   find_executable()       execvp's PATH lookup, against the *child's* environment
//   current_environment(), env_entries()   an environment as a map, and the envp built from it
//   Pipe                    a close-on-exec pipe for a child's output
//   free_port(), temp_root(), make_temp_dir(), TempDir, self_executable()
// Linux only.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace gradsync::cli {

using EnvMap = std::map<std::string, std::string>;

// This process's environment (environ) as a map, the usual starting point of a child's.
EnvMap current_environment();

// "NAME=value" entries, the form spawn() passes to execve.
std::vector<std::string> env_entries(const EnvMap& env);

// execvp's PATH search (PATH from `env`, the child's environment, default /usr/local/bin:/usr/bin:/bin),
// done by the parent before fork(): execvp may allocate, which is not allowed in the child of a
// multi-threaded process (torch's thread pools). A name containing '/' is returned as it is; nullopt when
// no PATH entry holds an executable regular file of that name.
std::optional<std::string> find_executable(const std::string& name, const EnvMap& env);

// Both ends close-on-exec, so a child started concurrently by another thread does not inherit them (and
// hold the pipe open); spawn() dup2s the child's end onto its stdout/stderr, which clears the flag there.
// The destructor closes whichever ends are still open.
class Pipe {
 public:
  Pipe();  // throws std::system_error
  ~Pipe();
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;

  int read_fd() const { return read_; }
  int write_fd() const { return write_; }
  int release_read();  // the caller owns the read end from now on
  void close_write();  // the parent's copy of the child's end: close it, or EOF never arrives

 private:
  int read_ = -1, write_ = -1;
};

struct SpawnRequest {
  std::string path;               // the executable, e.g. from find_executable()
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> env;   // "NAME=value" entries (env_entries())
  std::string cwd;                // empty: inherit
  int stdout_fd = -1, stderr_fd = -1;  // dup2'ed onto 1 and 2 in the child; the caller keeps and closes them
  bool null_stdin = false;             // stdin from /dev/null instead of inherited
  // PR_SET_PDEATHSIG(SIGKILL): the child dies with its parent, even with a SIGKILLed one. Linux delivers it
  // when the *thread* that forked exits, so use it only from a thread that outlives the child.
  bool kill_with_parent = true;
};

struct Spawned {
  pid_t pid = -1;      // also the child's process group id: kill(-pid, sig) reaches all it started
  int exec_error = 0;  // 0: the exec succeeded; else its errno (or chdir's), and the child exits 127
};

// Forks and execs `request`; returns once the exec has succeeded or failed, so the caller can report a
// failure by name. The child is not reaped here: wait for it (exit 127 after a failed exec) as for any
// other. In the child, before exec: signal dispositions reset to default and the mask emptied (ignored
// signals would survive exec), own process group, descriptors other than 0-2 marked close-on-exec.
// Throws std::system_error when the pipe or fork fails.
Spawned spawn(const SpawnRequest& request);

// Runs argv (argv[0] looked up in PATH) in `dir` ("" = here) with this process's environment plus `env`, its
// stdout and stderr into the file `log`, and waits at most `timeout` (then SIGKILLs its process group). Returns
// the wait status, or nullopt when it timed out. Throws gradsync::Error if `log` cannot be written or argv[0]
// is not found.
std::optional<int> run_logged(const std::vector<std::string>& argv, const std::string& dir, const std::string& log,
                              std::chrono::milliseconds timeout, const EnvMap& env = {});
// The whole text of `path` ("" when it cannot be read): what a run_logged() child wrote to its log.
std::string read_text(const std::string& path);

// A TCP port that was free on `host` (an address of this machine) a moment ago (bind to port 0, read it back,
// close). Racy by nature: someone may take it before the rank that needs it binds it, as with torchrun --standalone.
int free_port(const std::string& host = "127.0.0.1");

// Where temp files and directories go: $TMPDIR, else /tmp.
std::string temp_root();

// A fresh directory temp_root()/<prefix>XXXXXX (mkdtemp); the caller removes it.
std::string make_temp_dir(const std::string& prefix);

// make_temp_dir() removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The running executable (readlink /proc/self/exe), for re-running this program as the ranks. Throws
// gradsync::Error if it cannot be read.
std::string self_executable();

}  // namespace gradsync::cli
