// Parsing and validation of the launcher environment (LaunchEnv in runtime.h). No sockets are touched here, so a
// bad environment fails within milliseconds with a message naming the variable.
#include "gradsync/runtime.h"

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

// Which variables a launcher family uses, so one parser serves torchrun and mpirun.
struct VariableNames {
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};
constexpr VariableNames kTorchrun{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr VariableNames kOpenMpi{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE"};
// MPICH's Hydra (mpiexec) and Intel MPI: the PMI variables.
constexpr VariableNames kPmi{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
// srun's tasks (only inside a job step: a batch script's own SLURM_PROCID=0 is not a rank of SLURM_NTASKS).
constexpr VariableNames kSlurm{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};

int parse_int(const std::string& name, const std::string& value, const char* expected) {
  int out = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, out);
  if (value.empty() || ec != std::errc() || ptr != end) {
    throw ConfigError(fmt::format("environment variable {}='{}' is not an integer; expected {}", name, value,
                                  expected));
  }
  return out;
}

int required_int(const EnvLookup& env, const char* name, const char* expected) {
  auto value = env(name);
  if (!value) {
    throw ConfigError(fmt::format("environment variable {} is not set; expected {} (set by torchrun, "
                                  "`gradsync launch`, mpirun, mpiexec or srun)", name, expected));
  }
  return parse_int(name, *value, expected);
}

int optional_int(const EnvLookup& env, const char* name, int fallback, const char* expected) {
  auto value = env(name);
  return value ? parse_int(name, *value, expected) : fallback;
}

void check_ranks(const VariableNames& names, const LaunchEnv& e) {
  if (e.world_size < 1) {
    throw ConfigError(fmt::format("{}={} is out of range; expected an integer >= 1", names.world_size,
                                  e.world_size));
  }
  if (e.rank < 0 || e.rank >= e.world_size) {
    throw ConfigError(fmt::format("{}={} is out of range for {}={}; expected 0 <= {} < {}", names.rank, e.rank,
                                  names.world_size, e.world_size, names.rank, e.world_size));
  }
  if (e.local_world_size < 1 || e.local_world_size > e.world_size) {
    throw ConfigError(fmt::format("{}={} is out of range; expected 1 <= {} <= {}={}", names.local_world_size,
                                  e.local_world_size, names.local_world_size, names.world_size, e.world_size));
  }
  if (e.local_rank < 0 || e.local_rank >= e.local_world_size) {
    throw ConfigError(fmt::format("{}={} is out of range for {}={}; expected 0 <= {} < {}", names.local_rank,
                                  e.local_rank, names.local_world_size, e.local_world_size, names.local_rank,
                                  e.local_world_size));
  }
}

// Where the rendezvous store lives: a FileStore path from `gradsync launch`, else MASTER_ADDR:MASTER_PORT.
void read_store_location(const EnvLookup& env, LaunchEnv& e) {
  if (auto file = env("GRADSYNC_STORE_FILE"); file && !file->empty()) {
    e.store_file = *file;
    return;
  }
  auto addr = env("MASTER_ADDR");
  if (!addr || addr->empty()) {
    throw ConfigError("environment variable MASTER_ADDR is not set; expected the host of rank 0's store "
                      "(e.g. 127.0.0.1; under srun or mpiexec export MASTER_ADDR and MASTER_PORT), or run under "
                      "`gradsync launch`");
  }
  e.master_addr = *addr;
  e.master_port = required_int(env, "MASTER_PORT", "a TCP port 1..65535");
  if (e.master_port < 1 || e.master_port > 65535) {
    throw ConfigError(fmt::format("MASTER_PORT={} is out of range; expected 1..65535", e.master_port));
  }
}

Backend read_backend(const EnvLookup& env, const char* source) {
  if (auto value = env("GRADSYNC_BACKEND"); value && !value->empty()) {
    return parse_backend(*value, "environment variable GRADSYNC_BACKEND");
  }
  return std::string(source) == "openmpi" ? Backend::Mpi : Backend::Gloo;
}

LaunchEnv read_family(const EnvLookup& env, const VariableNames& names, const char* source) {
  LaunchEnv e;
  e.source = source;
  e.world_size = required_int(env, names.world_size, "the number of ranks, an integer >= 1");
  e.rank = required_int(env, names.rank, "this process's rank, 0 <= RANK < WORLD_SIZE");
  // Single-host launches may omit the local variables; the global ones are then the local ones.
  e.local_world_size = optional_int(env, names.local_world_size, e.world_size, "an integer >= 1");
  e.local_rank = optional_int(env, names.local_rank, e.rank, "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE");
  check_ranks(names, e);
  e.backend = read_backend(env, source);
  // MPI needs no store; a store given anyway (torchrun's variables under mpirun) is still read and checked.
  if (e.backend == Backend::Gloo || env("MASTER_ADDR") || env("GRADSYNC_STORE_FILE")) read_store_location(env, e);
  auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  e.agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  e.restart_count = optional_int(env, "TORCHELASTIC_RESTART_COUNT", 0, "an integer >= 0");
  e.store_token = read_store_token(env);
  e.store_bind = env("GRADSYNC_STORE_BIND").value_or("");
  return e;
}

}  // namespace

std::string read_store_token(const EnvLookup& env) {
  auto token = env("GRADSYNC_STORE_TOKEN").value_or("");
  // The token becomes a key prefix of the store: a '/' would reach into another job's keys.
  if (token.find_first_of("/ \t\n") != std::string::npos) {
    throw ConfigError("GRADSYNC_STORE_TOKEN must not contain '/' or white space; use e.g. 32 hex digits");
  }
  return token;
}

Backend parse_backend(const std::string& name, const std::string& what) {
  if (name == "gloo") return Backend::Gloo;
  if (name == "mpi") return Backend::Mpi;
  throw ConfigError(fmt::format("{}='{}' is not a backend; expected gloo or mpi", what, name));
}

std::optional<std::string> process_env(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

// In order: a launcher's own variables win over the scheduler's that surround it (torchrun or mpirun inside a
// SLURM allocation).
LaunchEnv read_launch_env(const EnvLookup& env) {
  if (env(kTorchrun.rank) || env(kTorchrun.world_size)) return read_family(env, kTorchrun, "torchrun");
  if (env(kOpenMpi.rank) || env(kOpenMpi.world_size)) return read_family(env, kOpenMpi, "openmpi");
  if (env(kPmi.rank) || env(kPmi.world_size)) return read_family(env, kPmi, "pmi");
  if ((env(kSlurm.rank) || env(kSlurm.world_size)) && (env("SLURM_STEP_ID") || env("SLURM_STEPID"))) {
    return read_family(env, kSlurm, "slurm");
  }
  LaunchEnv single;
  single.source = "none";
  single.backend = read_backend(env, "none");
  return single;
}

}  // namespace gradsync
