// defines: the local multi-process launcher behind `gradsync launch` (torchrun --standalone --no_python
// equivalent), reusable by `gradsync train` and `gradsync lab` to start their own ranks. The supervisor is
// launch.cpp, the subcommand launch_command.cpp; how a child is started is spawn.h.
#pragma once
#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/collectives.h"

namespace CLI {
class App;
}

namespace gradsync::cli {

inline constexpr int kMaxNproc = 1024;
inline constexpr int kMaxRestarts = 1000;

struct LaunchOptions {
  int nproc = 1;                           // ranks on this node, 1..kMaxNproc
  int nnodes = 1;                          // launchers forming the job (torchrun's --nnodes), one per node
  int node_rank = 0;                       // this launcher's place: its ranks are node_rank * nproc + local rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                     // 0: pick a free port
  // --nnodes MIN:MAX: an elastic job (tools/launch/elastic.h); min_nodes 0: a fixed --nnodes.
  int min_nodes = 0, max_nodes = 0;
  std::string rdzv_endpoint;               // "host:port" the elastic rendezvous meets at ("": master addr:port)
  std::string rdzv_id = "none";            // the job's name in the rendezvous store (torchrun's --rdzv-id)
  std::chrono::milliseconds rdzv_timeout{600000};  // a round that has not closed by then fails (torchrun's join)
  std::chrono::milliseconds last_call{30000};      // MIN nodes joined: wait this long for more (torchrun's)
  std::chrono::milliseconds grace{5000};   // SIGTERM -> SIGKILL grace period
  int max_restarts = 0;                    // a failed group is started again this many times (torchrun's)
  int restart_count = 0;                   // which start this is (launch() counts): TORCHELASTIC_RESTART_COUNT
  bool prefix_output = true;               // "[rank<r>]: " before every output line
  std::vector<std::string> command;        // argv; argv[0] looked up in PATH
  Backend backend = Backend::Gloo;         // Mpi: one mpirun starts the ranks (tools/launch/mpirun.h)
  std::vector<std::pair<std::string, std::string>> extra_env;  // set last: overrides everything else
};

// The job-wide RANK of this launcher's local rank `local_rank`.
inline int global_rank(const LaunchOptions& o, int local_rank) { return o.node_rank * o.nproc + local_rank; }

// Throws gradsync::ConfigError naming the offending option, its value and what is allowed.
void validate(const LaunchOptions& options);

// How one start of this node's ranks ended.
// A rank's exit status for a configuration error under an elastic launcher (sysexits.h's EX_CONFIG): the same
// command would fail the same way at every restart, so the launcher does not restart it.
constexpr int kExitConfigError = 78;

struct GroupResult {
  int code = 0;               // what launch() would return for it
  std::string first_failure;  // "rank 1 (pid 123) was killed by signal 9 (Killed)"; "" when none failed
  bool signalled = false;     // this launcher got SIGINT/SIGTERM/SIGHUP
  std::string interrupted;    // the watch's answer when it stopped the ranks; "" otherwise
};

// Called about once a second while the ranks run: a non-empty answer (why) stops them as a failure would, without
// being one (the elastic rendezvous ended the round elsewhere).
using GroupWatch = std::function<std::string()>;

// One start of options.nproc ranks, as launch() describes, without restarts.
GroupResult run_group(const LaunchOptions& options, const GroupWatch& watch = {});

// Starts options.nproc ranks, each in its own process group with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*,
// OMP_NUM_THREADS and GRADSYNC_STORE_FILE set, forwards their (prefixed) output, and waits for all of them.
// The first rank to fail (or a SIGINT/SIGTERM/SIGHUP to this process) stops the others: SIGTERM, then
// SIGKILL after the grace period. Returns the exit status the CLI should return: 0 when every rank exited
// 0, the first failing rank's exit code (128 + signal if it was killed), or 128 + signal when this process
// was signalled. With max_restarts R, a failed group (not a signalled launcher) is started again, up to R times,
// with TORCHELASTIC_RESTART_COUNT = the attempt; after the last the first failure is reported and its exit
// status returned. Every rank's process group is SIGKILLed before returning, so no process outlives it.
// Installs temporary handlers for SIGINT/SIGTERM/SIGHUP/SIGCHLD/SIGPIPE (restored on return): call it
// from one thread at a time, from a thread that outlives the ranks (ranks use PR_SET_PDEATHSIG).
// Throws gradsync::ConfigError for invalid options (see validate()), std::system_error if a rank cannot be
// started (fork or pipe failure; a command that cannot be executed is a failing rank, exit status 127).
// With options.min_nodes > 0 the launch is elastic instead (launch_elastic(), tools/launch/elastic.h).
int launch(const LaunchOptions& options);

// "gradsync launch: <line>" on stderr: how every launcher reports.
void report_line(const std::string& line);

// `gradsync launch`: adds the subcommand to `root`; its callback stores the exit status in `exit_code`.
void add_launch_command(CLI::App& root, int& exit_code);

// An exception's message; libtorch's without their C++ backtrace (which helps nobody running the CLI).
std::string error_text(const std::exception& e);

// How a gradsync process reports the error it exits with: "gradsync: error: <what>" on stderr, libtorch's errors
// without their C++ backtrace (which helps nobody running the CLI).
void print_error(const std::exception& e);

}  // namespace gradsync::cli
