// The ranks' environment (see rank_environment.h).
#include "launch/rank_environment.h"

#include <unistd.h>

#include <algorithm>
#include <random>
#include <set>

#include <fmt/format.h>

namespace gradsync::cli {
namespace {

std::string random_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

}  // namespace

// Shares the cores between the ranks instead of oversubscribing them N times.
std::string omp_threads(const EnvMap& env, int nproc) {
  if (auto it = env.find("OMP_NUM_THREADS"); it != env.end()) return it->second;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return std::to_string(std::max(1L, cores / nproc));
}

bool is_torchrun_variable(const std::string& name) {
  static const std::set<std::string> kNames{"RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                            "ROLE_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                                            "MASTER_ADDR", "MASTER_PORT", "GRADSYNC_STORE_FILE"};
  return kNames.count(name) > 0 || name.rfind("TORCHELASTIC_", 0) == 0;
}

void set_restart_variables(EnvMap& env, const LaunchOptions& o) {
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(o.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o.max_restarts);
}

EnvMap common_environment(const LaunchOptions& o, int port, const std::string& store_file) {
  EnvMap env = current_environment();
  // Inherited from an outer torchrun this would make Python ranks look for an agent store that does not
  // exist here; without it they use MASTER_ADDR/PORT with rank 0 as the TCPStore server.
  env.erase("TORCHELASTIC_USE_AGENT_STORE");
  env["OMP_NUM_THREADS"] = omp_threads(env, o.nproc);
  env["WORLD_SIZE"] = env["ROLE_WORLD_SIZE"] = std::to_string(o.nproc * o.nnodes);
  env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc);
  env["GROUP_RANK"] = std::to_string(o.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(o.nnodes);
  env["ROLE_NAME"] = "default";
  env["MASTER_ADDR"] = o.master_addr;
  env["MASTER_PORT"] = std::to_string(port);
  set_restart_variables(env, o);
  env["TORCHELASTIC_RUN_ID"] = random_run_id();
  // One node: a FileStore next to the ranks. Several: rank 0's TCPStore at MASTER_ADDR:MASTER_PORT, which the
  // other launchers' ranks reach.
  if (o.nnodes == 1) {
    env["GRADSYNC_STORE_FILE"] = store_file;
  } else {
    env.erase("GRADSYNC_STORE_FILE");
  }
  return env;
}

std::vector<std::string> rank_environment(EnvMap env, const LaunchOptions& o, int local_rank) {
  env["RANK"] = env["ROLE_RANK"] = std::to_string(global_rank(o, local_rank));
  env["LOCAL_RANK"] = std::to_string(local_rank);
  for (const auto& [name, value] : o.extra_env) env[name] = value;
  return env_entries(env);
}

}  // namespace gradsync::cli
