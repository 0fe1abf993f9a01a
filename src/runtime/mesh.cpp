// The replica x shard mesh of hybrid sharding (see mesh.h).
#include "runtime/mesh.h"

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {

int hosts_of(const World& world) { return std::max(1, world.size() / std::max(1, world.local_size())); }

Mesh make_mesh(World& world, int replicas, bool across_hosts, const std::string& who) {
  const int n = world.size();
  const int r = replicas == 0 ? hosts_of(world) : replicas;
  if (r < 1 || n % r != 0) {
    throw ConfigError(fmt::format("{}: {} replicas for {} ranks; the replica count (FsdpOptions::replicas, "
                                  "train --replicas) must divide the world size (rank = replica x S + shard index, "
                                  "S = N / R)", who, r, n));
  }
  const int s = n / r;
  const int local = world.local_size();
  if (!across_hosts && (s > local || local % s != 0)) {
    throw ConfigError(fmt::format(
        "{}: {} replicas of {} ranks make shard groups of {} ranks, but a host runs {} (its local world size), so a "
        "shard group would span hosts and send every all-gather and reduce-scatter across them; choose a replica "
        "count that is a multiple of the {} host(s), or allow shard groups across hosts (FsdpOptions::"
        "shard_across_hosts, train --shard-across-hosts)", who, r, n, s, local,
        hosts_of(world)));
  }
  Mesh mesh;
  mesh.replicas = r;
  mesh.shard_size = s;
  mesh.replica_index = world.rank() / s;
  mesh.shard_index = world.rank() % s;
  // Two splits, every rank in both, in the same order on every rank.
  mesh.shard = world.comm().split(mesh.replica_index, mesh.shard_index, "shard");
  mesh.replica = world.comm().split(mesh.shard_index, mesh.replica_index, "replica");
  return mesh;
}

}  // namespace gradsync
