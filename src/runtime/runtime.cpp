// Joining a job (see runtime.h): environment -> Gloo: store -> rendezvous check -> ProcessGroupGloo;
// MPI: MPI_Init -> rank check.
#include "gradsync/runtime.h"

#include <unistd.h>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "gradsync/error.h"
#include "runtime/peers.h"
#include "runtime/rendezvous.h"
#include "runtime/tcp_store.h"
#include "runtime/transport.h"

namespace gradsync {
namespace {

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  if (env.world_size == 1 && env.store_file.empty() && env.master_addr.empty()) {
    return c10::make_intrusive<c10d::HashStore>();  // single process: nothing to meet
  }
  if (!env.store_file.empty()) return c10::make_intrusive<c10d::FileStore>(env.store_file, env.world_size);
  return open_tcp_store(env, timeout);
}

// A FileStore deletes its file when as many processes as it was told have destroyed it. After a failed
// rendezvous those counts disagree (a rank with the wrong WORLD_SIZE, a duplicate), so a failing process could
// delete the file under a peer that has not read it yet, leaving that peer waiting for its timeout instead of
// failing at once with the same message. A failing process therefore never destroys its store.
void keep_store_alive(const c10::intrusive_ptr<c10d::Store>& store) {
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Store>>();  // intentionally never freed
  kept->push_back(store);
}

}  // namespace

World::World(LaunchEnv env, std::shared_ptr<Transport> transport, std::chrono::milliseconds timeout)
    : env_(std::move(env)), timeout_(timeout), comm_(std::move(transport), env_.rank, env_.world_size, timeout) {}

std::shared_ptr<World> init_with_store(c10::intrusive_ptr<c10d::Store> store, const LaunchEnv& env,
                                       std::chrono::milliseconds timeout) {
  const std::string prefix = fmt::format("gradsync/{}", env.restart_count);
  store->setTimeout(timeout);
  c10d::PrefixStore rendezvous_store(prefix + "/rendezvous", store);
  try {
    remember_peers(rendezvous(rendezvous_store,
                              RendezvousInfo{env.rank, env.world_size, host_name(), static_cast<long>(getpid()),
                                             machine_identity()},
                              timeout),
                   env.rank);
  } catch (...) {
    keep_store_alive(store);
    throw;
  }
  LaunchEnv gloo_env = env;
  gloo_env.backend = Backend::Gloo;
  return std::make_shared<World>(gloo_env, make_gloo_transport(store, env, timeout), timeout);
}

std::shared_ptr<World> init(const InitOptions& options) {
  LaunchEnv env = options.env ? *options.env : read_launch_env();
  if (options.backend) env.backend = *options.backend;
  if (env.backend == Backend::Mpi) {
    return std::make_shared<World>(env, make_mpi_transport(env, options.timeout), options.timeout);
  }
  if (env.world_size > 1 && env.store_file.empty() && env.master_addr.empty()) {
    throw ConfigError(fmt::format("rank {} of {}: the gloo backend needs a rendezvous store: set MASTER_ADDR and "
                                  "MASTER_PORT (or run under `gradsync launch`), or use the mpi backend under mpirun",
                                  env.rank, env.world_size));
  }
  auto store = connect_store(env, options.timeout);
  return init_with_store(std::move(store), env, options.timeout);
}

}  // namespace gradsync
