// defines: joining a job the way torchrun's workers do: LaunchEnv and read_launch_env() (a launcher's variables
// -- torchrun, gradsync launch, OpenMPI's mpirun -- validated before any socket is opened), the backend choice,
// World (this process's place in the job: rank, size, backend, collectives) and init().
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "gradsync/collectives.h"

namespace gradsync {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // empty when a store file is used or in a single-process world
  int master_port = 0;      // 0 when unused
  std::string store_file;   // GRADSYNC_STORE_FILE: a c10d FileStore handed over by `gradsync launch`
  bool agent_store = false; // torchrun's TORCHELASTIC_USE_AGENT_STORE: every rank is a store client
  // Rank 0's TCP store (MASTER_ADDR/MASTER_PORT, when gradsync serves it): GRADSYNC_STORE_TOKEN, the job's secret
  // every key must carry (the same on every rank; unset: none), and GRADSYNC_STORE_BIND, the address to listen on
  // instead of MASTER_ADDR ("0.0.0.0": every interface; unset: MASTER_ADDR's address only).
  std::string store_token;
  std::string store_bind;
  int restart_count = 0;    // TORCHELASTIC_RESTART_COUNT: keeps store keys of a restarted job apart
  std::string source;       // "torchrun", "openmpi", "pmi" (MPICH's mpiexec), "slurm" (srun) or "none"
  // GRADSYNC_BACKEND=gloo|mpi; unset: mpi under mpirun (source "openmpi"), gloo everywhere else. Gloo needs a
  // store (MASTER_ADDR/MASTER_PORT or GRADSYNC_STORE_FILE) for more than one rank; MPI needs none.
  Backend backend = Backend::Gloo;
};

// "gloo" -> Backend::Gloo, "mpi" -> Backend::Mpi; anything else is a ConfigError naming `what` and the choices.
Backend parse_backend(const std::string& name, const std::string& what);

// Looks a variable up; returns nullopt when unset. The default reads the process environment.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
std::optional<std::string> process_env(const std::string& name);

// Reads the first launcher family present: RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (torchrun, gradsync launch),
// OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (Open MPI's mpirun), PMI_RANK/PMI_SIZE with MPI_LOCALRANKID/
// MPI_LOCALNRANKS (MPICH's mpiexec), SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NTASKS_PER_NODE (srun: only
// inside a job step, SLURM_STEP_ID set); then MASTER_ADDR/MASTER_PORT (or GRADSYNC_STORE_FILE) and
// GRADSYNC_BACKEND. The backend defaults to mpi under Open MPI's mpirun, else gloo (which needs MASTER_ADDR/PORT
// for more than one rank). With no rank variable set the result is a single-process world. Throws ConfigError
// naming the variable and its value for anything missing, not an integer, or out of range.
LaunchEnv read_launch_env(const EnvLookup& lookup = process_env);

// GRADSYNC_STORE_TOKEN ("" when unset), the secret every key of a job's store is prefixed with. Throws ConfigError
// when it holds a '/' or white space.
std::string read_store_token(const EnvLookup& lookup = process_env);

// ---- joining a job -------------------------------------------------------------------------------

struct InitOptions {
  // Deadline for the rendezvous and for every collective. PyTorch's default is 30 minutes; tests use seconds.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // The launcher environment; by default read from the process environment with read_launch_env().
  std::optional<LaunchEnv> env;
  // Overrides the environment's backend (LaunchEnv::backend).
  std::optional<Backend> backend;
};

class World {
 public:
  World(LaunchEnv env, std::shared_ptr<Transport> transport, std::chrono::milliseconds timeout);

  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  int local_size() const { return env_.local_world_size; }
  bool is_main() const { return env_.rank == 0; }
  const LaunchEnv& env() const { return env_; }
  Backend backend() const { return env_.backend; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  Collectives& comm() { return comm_; }

 private:
  LaunchEnv env_;
  std::chrono::milliseconds timeout_;
  Collectives comm_;
};

// Reads and validates the environment (ConfigError before any socket is opened). Gloo: connects to the store
// (GRADSYNC_STORE_FILE's FileStore, else a TCPStore at MASTER_ADDR:MASTER_PORT served by rank 0), checks
// that ranks are distinct and agree on the world size (src/runtime/rendezvous.h), then creates a ProcessGroupGloo.
// MPI: initialises MPI (once per process) and checks that MPI's ranks are the environment's.
std::shared_ptr<World> init(const InitOptions& options = {});

// What this gradsync was built against and what it finds at run time (`gradsync --version`).
struct BuildInfo {
  std::string gradsync;               // gradsync's version
  std::string libtorch;               // the libtorch it was built against (TORCH_VERSION)
  std::string mpi;                    // the MPI library's own version line (Open MPI's MPI_Get_library_version)
  std::vector<std::string> backends;  // the collective engines compiled in: "gloo", "mpi"
  bool cuda_compiled = false;         // the libtorch carries CUDA (libtorch_cuda is loaded)
  std::string cuda_runtime;           // its CUDA runtime version, when compiled in
  int cuda_devices = 0;               // CUDA devices visible to this process
};
BuildInfo build_info();
// Several lines, one fact each, as `gradsync --version` prints them.
std::string describe(const BuildInfo& info);

// Gloo on a store the caller made (tests: a FileStore in a temp dir).
std::shared_ptr<World> init_with_store(c10::intrusive_ptr<c10d::Store> store, const LaunchEnv& env,
                                       std::chrono::milliseconds timeout);

}  // namespace gradsync
