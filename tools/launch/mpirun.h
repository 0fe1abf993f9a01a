// defines: how `gradsync launch --backend mpi` starts its ranks: one mpirun, with the options this machine needs
// (root, more ranks than cores) and an environment without the torchrun variables (MPI ranks read Open MPI's own).
#pragma once
#include <string>
#include <vector>

#include "launch/launch.h"
#include "launch/spawn.h"

namespace gradsync::cli {

// mpirun -np N [--allow-run-as-root] [--oversubscribe] --bind-to none [--tag-output] CMD... (mpirun from PATH).
std::vector<std::string> mpirun_argv(const LaunchOptions& options);

// This process's environment without the torchrun variables (is_torchrun_variable(): an outer launcher's, which
// would override Open MPI's), with GRADSYNC_BACKEND=mpi, OMP_NUM_THREADS as `gradsync launch` shares the cores
// (omp_threads()), then options.extra_env.
std::vector<std::string> mpirun_environment(const LaunchOptions& options);

}  // namespace gradsync::cli
