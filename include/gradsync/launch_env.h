// defines: LaunchEnv and read_launch_env(), which turn a launcher's environment (torchrun, gradsync launch,
// OpenMPI's mpirun) into validated integers before any socket is opened.
#pragma once
#include <functional>
#include <optional>
#include <string>

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
  int restart_count = 0;    // TORCHELASTIC_RESTART_COUNT: keeps store keys of a restarted job apart
  std::string source;       // "torchrun", "openmpi" or "none" (single process)
};

// Looks a variable up; returns nullopt when unset. The default reads the process environment.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
std::optional<std::string> process_env(const std::string& name);

// Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun) or
// OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (OpenMPI). With none of them set, the result is a
// single-process world. Throws ConfigError naming the variable and its value for anything missing, not an
// integer, or out of range.
LaunchEnv read_launch_env(const EnvLookup& lookup = process_env);

}  // namespace gradsync
