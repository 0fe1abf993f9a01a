// defines: rendezvous(), the check every rank passes through the store before a process group exists.
// libtorch 1.13 detects neither two processes with the same RANK (the allreduce silently uses whichever
// registered last) nor ranks that disagree on WORLD_SIZE (a cryptic Gloo address error); this does.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace gradsync {

struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  std::string host;  // for messages: which machine/process registered a rank
  long pid = 0;
  // Where `pid` means something: this machine's boot id and pid namespace ("" when unknown). Two processes compare
  // pids only when these match (containers sharing a host name do not).
  std::string machine;
};

// Registers this process and waits until world_size processes have arrived, then checks that the ranks are
// exactly 0..world_size-1 and that everyone agrees on world_size. On a duplicate rank, a disagreeing world
// size or ranks missing at the deadline, throws DistributedError naming the ranks (and their hosts/pids);
// every process that sees the same arrivals throws the same message. Returns every rank's entry, by rank.
std::vector<RendezvousInfo> rendezvous(c10d::Store& store, const RendezvousInfo& me, std::chrono::milliseconds timeout);

}  // namespace gradsync
