// Test support: start real processes (the `gradsync` CLI, multi-rank programs) with a hard deadline,
// capture their output and make sure nothing outlives the test. POSIX (Linux) only.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace gradsync::test {

struct CommandOptions {
  // Added/overridden on top of the current environment; a later entry wins over an earlier one.
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> unset_env;  // removed from the child's environment (applied before `env`)
  std::chrono::milliseconds timeout{60000};  // hard deadline: the child's process group is SIGKILLed then
  std::string cwd;                           // empty: inherit
  // PR_SET_PDEATHSIG(SIGKILL) in the child, so a crashed or timed-out test binary leaves no process
  // behind. Linux delivers it when the *thread* that started the child exits: keep the default only if
  // the starting thread outlives the child (true for start() + wait() in the same thread).
  bool kill_with_parent = true;
};

// The variables a launcher (`gradsync launch`, torchrun, mpirun) sets for its ranks, and `also`: what a job a test
// starts must not inherit from a test binary that is itself run as a rank, or the job would join that one.
std::vector<std::string> launcher_variables(std::vector<std::string> also = {});
// A gradsync job as the tests start one: `timeout`, one compute thread per rank (OMP_NUM_THREADS=1: ranks share
// the cores), launcher_variables(also_unset) removed.
CommandOptions job_options(std::chrono::seconds timeout, std::vector<std::string> also_unset = {});

struct ProcessResult {
  int exit_code = -1;  // valid when exited normally (127 when the command could not be executed)
  int term_signal = 0;  // non-zero when killed by a signal
  bool timed_out = false;
  std::string out, err;  // captured stdout / stderr
  double seconds = 0;
  bool ok() const;  // exited normally with 0 and not timed out
  // "exit 3" / "signal 9 (Killed)" / "timed out after 60 s", then the tails of out and err: for test
  // failure messages, e.g. ASSERT_TRUE(r.ok()) << r.describe();
  std::string describe() const;
};

// A started child in its own process group (pgid == pid); stdin is /dev/null, stdout/stderr go to
// unlinked temp files, so any number of concurrent children can write without ever blocking.
class Process {
 public:
  // argv[0] is resolved through PATH (the child's PATH when `opts.env` overrides it). If it cannot be
  // executed, start() does not throw: wait() reports exit 127 with "cannot execute '...': <reason>" in
  // `err`, like a shell would.
  static Process start(std::vector<std::string> argv, CommandOptions opts = {});

  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process();  // SIGKILLs the child's process group and reaps the child if that was not done yet

  pid_t pid() const;      // -1 if the command could not be executed
  void signal(int sig);   // to the child's whole process group; no-op once the child has been reaped
  bool poll();            // non-blocking: true once the child has exited (it is then reaped)
  ProcessResult wait();   // waits until exit or the deadline (then SIGKILLs the group), reads outputs
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }

 private:
  Process() = default;
  void reap(int status);
  void release() noexcept;

  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  bool reaped_ = false, collected_ = false;
  std::chrono::steady_clock::time_point started_, deadline_;
  std::chrono::milliseconds timeout_{0};
  ProcessResult result_;
};

ProcessResult run(std::vector<std::string> argv, CommandOptions opts = {});  // start + wait

// Starts world_size copies concurrently with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), GRADSYNC_STORE_FILE (a fresh path in a fresh temp dir,
// file not created; the dir is removed afterwards) and OMP_NUM_THREADS=1 set (entries of `opts.env`
// override these); waits for all with one shared deadline; when one fails, the others are given 5 s,
// then SIGKILLed. Results are indexed by rank.
std::vector<ProcessResult> run_ranks(int world_size, std::vector<std::string> argv, CommandOptions opts);

// Runs argv as world_size MPI ranks under one `mpirun` (the command line `gradsync launch --backend mpi` uses:
// root allowed, oversubscribed past the cores, unbound, output tagged "[1,<rank>]<stdout>:"), with OMP_NUM_THREADS=1 and GRADSYNC_BACKEND=mpi and without the torchrun variables; one
// result for the whole job (mpirun's exit status: non-zero when any rank failed).
ProcessResult run_mpi_ranks(int world_size, std::vector<std::string> argv, CommandOptions opts);

bool process_alive(pid_t pid);  // true if /proc/<pid> exists and is not a zombie
std::string make_temp_dir(const std::string& prefix);  // a fresh directory under $TMPDIR or /tmp
int free_port();  // a TCP port that was free on 127.0.0.1 a moment ago (bind to port 0, read, close)
std::vector<pid_t> children_of(pid_t pid);  // its child processes (/proc/<pid>/task/<pid>/children)
size_t line_count(const std::string& path);  // lines in a file (0 when it does not exist): a log's progress
// The file this process maps at `address` (/proc/self/maps; "/dev/shm/name (deleted)" once unlinked), "" when the
// memory there is anonymous.
std::string mapped_file(const void* address);
uint64_t free_shm_bytes();  // what /dev/shm has free (statvfs), 0 when it cannot tell
// Local addresses ("0100007F:1F90": 127.0.0.1:8080, in /proc/net's hex) of the sockets listening on `port`, from
// /proc/net/tcp and /proc/net/tcp6.
std::vector<std::string> listeners_on(int port);

}  // namespace gradsync::test
