// defines: Mesh, a job's N ranks as R replicas of S shards (N = R * S) for hybrid sharding, and make_mesh(). The
// layout is fixed: rank = replica * S + shard index. A host's ranks are consecutive (torchrun numbers them
// node_rank * nproc_per_node + local_rank, mpirun by slot), so S ranks of one host form a shard group, and the R
// ranks holding the same shard index, one per replica, form a replica group:
//
//   N = 4, R = 2, S = 2     shard groups {0, 1} {2, 3}      replica groups {0, 2} {1, 3}
//
// Both are sub-groups of the world (Collectives::split): the same operations, declared reductions and errors.
#pragma once
#include <memory>
#include <string>

#include "gradsync/collectives.h"
#include "gradsync/runtime.h"

namespace gradsync {

struct Mesh {
  int replicas = 1;    // R
  int shard_size = 1;  // S
  int replica_index = 0, shard_index = 0;  // this rank's: rank = replica_index * S + shard_index
  std::shared_ptr<Collectives> shard;    // the S ranks of this rank's replica
  std::shared_ptr<Collectives> replica;  // the R ranks of this rank's shard index
};

// The number of hosts in the job as its launcher describes it: world size / local world size.
int hosts_of(const World& world);

// Collective over the world. `replicas` 0 means one per host (hosts_of). ConfigError, naming `who` and the values,
// when R < 1 or R does not divide N, or when a shard group would hold ranks of two hosts (S does not divide the
// local world size) and `across_hosts` does not allow it.
Mesh make_mesh(World& world, int replicas, bool across_hosts, const std::string& who);

}  // namespace gradsync
