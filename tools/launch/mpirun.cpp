// Starting ranks through mpirun (see mpirun.h).
#include "launch/mpirun.h"

#include <unistd.h>

#include "launch/rank_environment.h"

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
  for (auto it = env.begin(); it != env.end();) it = is_torchrun_variable(it->first) ? env.erase(it) : std::next(it);
  env["OMP_NUM_THREADS"] = omp_threads(env, o.nproc);
  env["GRADSYNC_BACKEND"] = "mpi";
  set_restart_variables(env, o);  // which attempt this is: a rank resumes (train --resume) the same way under MPI
  for (const auto& [name, value] : o.extra_env) env[name] = value;
  return env_entries(env);
}

}  // namespace gradsync::cli
