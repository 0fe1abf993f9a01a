// Starting ranks through mpirun (see mpirun.h).
#include "launch/mpirun.h"

#include <unistd.h>

#include <algorithm>

namespace gradsync::cli {

std::vector<std::string> mpirun_argv(const LaunchOptions& o) {
  std::vector<std::string> argv{"mpirun", "-np", std::to_string(o.nproc)};
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");  // Open MPI refuses root without it
  if (o.nproc > sysconf(_SC_NPROCESSORS_ONLN)) argv.push_back("--oversubscribe");  // else: "not enough slots"
  // Unbound, as `gradsync launch` leaves Gloo ranks: each rank's transport thread may use any core.
  argv.insert(argv.end(), {"--bind-to", "none"});
  if (o.prefix_output) argv.push_back("--tag-output");  // "[1,<rank>]<stdout>:" before every line
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  return argv;
}

std::vector<std::string> mpirun_environment(const LaunchOptions& o) {
  EnvMap env = current_environment();
  for (auto it = env.begin(); it != env.end();) {
    const std::string& name = it->first;
    const bool torchrun = name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" ||
                          name == "LOCAL_WORLD_SIZE" || name == "MASTER_ADDR" || name == "MASTER_PORT" ||
                          name == "GROUP_RANK" || name == "ROLE_RANK" || name == "ROLE_WORLD_SIZE" ||
                          name == "GRADSYNC_STORE_FILE" || name.rfind("TORCHELASTIC_", 0) == 0;
    it = torchrun ? env.erase(it) : std::next(it);
  }
  if (!env.count("OMP_NUM_THREADS")) {
    env["OMP_NUM_THREADS"] = std::to_string(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN) / o.nproc));
  }
  env["GRADSYNC_BACKEND"] = "mpi";
  for (const auto& [name, value] : o.extra_env) env[name] = value;
  return env_entries(env);
}

}  // namespace gradsync::cli
