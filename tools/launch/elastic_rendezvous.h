// defines: ElasticRendezvous, how the launchers of an elastic job (elastic.h) agree on each round's members, over
// one store at the rendezvous endpoint. The launcher that can bind the endpoint's address serves it (StoreServer:
// that address only, the job's GRADSYNC_STORE_TOKEN); every launcher, that one too, is its client. Like torchrun's
// c10d rendezvous, the endpoint's host is the one node the job cannot lose.
//
// Round k, keys under "gradsync-elastic/<rdzv id>/":
//   current               the round a newcomer joins (the host sets it when it joins a round)
//   r<k>/joined           arrival counter; r<k>/node/<i> = "address pid nproc host" of arrival i
//   r<k>/closed           set by the host: "<count> <master port>" (arrivals 0..count-1 are the members) or
//                         "abort <why>"; it closes at MAX arrivals, or MIN plus the last-call wait, or aborts when
//                         fewer than MIN came within the rendezvous timeout
//   r<k>/waiting          arrivals after the close: they wait for round k+1
//   r<k>/end              why the round ended, written once (compare-and-set): "failed: ..." or "grow: ..."
//   r<k>/succeeded, left  members whose ranks all exited 0; members that saw every one succeed and leave
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "launch/elastic.h"

namespace gradsync::cli {

struct ElasticNode {
  std::string address;  // where this node reaches the endpoint from (its address on that network)
  long pid = 0;         // its launcher's
  int nproc = 0;
  bool host = false;    // serves the rendezvous store: node 0 of every round, MASTER_ADDR of its ranks
  std::string name() const;  // "10.0.0.2 (pid 4242)"
  bool operator==(const ElasticNode& o) const { return address == o.address && pid == o.pid; }
};

struct Membership {
  int round = 0;
  std::vector<ElasticNode> nodes;  // node ranks in order: the host first, then by address and pid
  int node_rank = 0;               // this launcher's place in nodes
  int master_port = 0;             // the ranks' store, served by rank 0 at the endpoint's host
};

// Why a round could not form; every launcher in it reports the same words.
struct RendezvousAborted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ElasticRendezvous {
 public:
  // Serves the store when the endpoint's address is this host's, then connects. Throws DistributedError when the
  // store cannot be reached within the rendezvous timeout.
  explicit ElasticRendezvous(const LaunchOptions& options);
  ~ElasticRendezvous();

  bool hosting() const;
  const Endpoint& endpoint() const { return endpoint_; }

  // Joins round `round` (a newcomer: whichever is open, from `current`) and returns once it has closed with this
  // node among its members; an arrival after the close waits for the next round. `previous` (the last round's
  // members, empty for the first) names the lost nodes when the round aborts. Throws RendezvousAborted.
  Membership join(int round, const std::vector<ElasticNode>& previous);

  // Why round `round` ended, "" while it runs. Non-blocking (one request).
  std::string ended(int round);
  // Ends the round with `why` unless it has already ended; returns the end that holds.
  std::string end(int round, const std::string& why);
  // Nodes that came after the round closed (the host restarts the round for them, up to MAX).
  int64_t waiting(int round);

  // This node's ranks all exited 0. Waits until every member's did (true: the job is done) or the round ended
  // otherwise (false: join the next). The host returns only once every other member has seen the end.
  bool finish(const Membership& m);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Endpoint endpoint_;
};

}  // namespace gradsync::cli
