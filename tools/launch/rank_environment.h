// defines: the environment `gradsync launch` gives its ranks, torchrun's (--standalone) variables plus
// GRADSYNC_STORE_FILE.
#pragma once
#include <string>
#include <vector>

#include "launch/launch.h"
#include "launch/spawn.h"

namespace gradsync::cli {

// The variables common_environment() and rank_environment() set that name a torchrun-style job (RANK, WORLD_SIZE,
// MASTER_ADDR, ...; TORCHELASTIC_* by prefix): what a launcher handing its ranks to mpirun must not pass on.
bool is_torchrun_variable(const std::string& name);

// torchrun's rule: OMP_NUM_THREADS as given in `env`, else the cores shared between `nproc` ranks.
std::string omp_threads(const EnvMap& env, int nproc);

// TORCHELASTIC_RESTART_COUNT (options.restart_count: which start of the group this is) and
// TORCHELASTIC_MAX_RESTARTS (options.max_restarts), as torchrun's elastic agent sets them.
void set_restart_variables(EnvMap& env, const LaunchOptions& options);

// What every rank of this launcher shares: this process's environment with WORLD_SIZE (nnodes * nproc),
// LOCAL_WORLD_SIZE, ROLE_WORLD_SIZE,
// GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT (= `port`), TORCHELASTIC_* (one random
// run id, set_restart_variables()), OMP_NUM_THREADS (kept if set, else the cores shared between the ranks) and
// GRADSYNC_STORE_FILE (= `store_file`, one node only) set.
EnvMap common_environment(const LaunchOptions& options, int port, const std::string& store_file);

// `common` plus LOCAL_RANK (= `local_rank`), RANK and ROLE_RANK (node_rank * nproc + local_rank), then
// options.extra_env, as execve entries.
std::vector<std::string> rank_environment(EnvMap common, const LaunchOptions& options, int local_rank);

}  // namespace gradsync::cli
