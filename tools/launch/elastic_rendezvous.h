// defines: ElasticRendezvous, how the launchers of an elastic job (elastic.h) agree on each round's members, over
// one store at the rendezvous endpoint. The launcher that can bind the endpoint's address serves it (StoreServer:
// that address only, the job's GRADSYNC_STORE_TOKEN); every launcher, that one too, is its client. Like torchrun's
// c10d rendezvous, the endpoint's host is the one node the job cannot lose.
//
// Keys under "gradsync-elastic/<rdzv id>/":
//   nproc                 the host's -n: a launcher with another is refused before it joins any round
//   current               the round a newcomer joins (the host sets it when it joins a round)
//   r<k>/open             set by the host as it joins round k: a client's wait for the close counts from here
//   r<k>/joined           arrival counter; r<k>/node/<i> = "address pid nproc host" of arrival i, written after its
//                         number is taken (an arrival whose entry never appears is never a member)
//   r<k>/closed           set by the host: "<master port> <restarts> <i> <j> ..." (the arrivals that are members:
//                         the host, then the last round's members, then newcomers, up to MAX) or "abort <why>"; it
//                         closes at MAX arrivals, or MIN plus the last-call wait after MIN came, or aborts when MIN
//                         did not come within the rendezvous timeout, or when the host gives up (out of restarts)
//   r<k>/seen             arrivals that read an abort: the host serves the store until they all did (bounded)
//   r<k>/waiting          arrivals that are not members: they wait for round k+1
//   r<k>/end              why the round ended, written once (compare-and-set): "failed: ..." or "grow: ..."
//   r<k>/succeeded, left  members whose ranks all exited 0; members and waiters that saw every one succeed
// The host is in every round, so its count of failures is the job's: it sends it in `closed` (every node's
// TORCHELASTIC_RESTART_COUNT) and alone decides to give up.
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
  int restarts = 0;                // failed rounds before this one, as the host counts them
};

// What a launcher brings to a round. Only the host's restarts and give_up are used.
struct RoundStart {
  std::vector<ElasticNode> previous;  // the last round's members (empty for the first): they are preferred, and
                                      // those that do not come are named when the round aborts
  int restarts = 0;
  std::string give_up;                // non-empty: the host aborts the round with these words
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
  // node among its members; a node that is not one waits for the next round, and gets no nodes when the job
  // finished meanwhile. Throws RendezvousAborted with the host's words (every arrival reads them).
  Membership join(int round, const RoundStart& start);

  // Why round `round` ended, "" while it runs. Non-blocking (one request).
  std::string ended(int round);
  // Ends the round with `why` unless it has already ended; returns the end that holds.
  std::string end(int round, const std::string& why);
  // Nodes that are not members of the round (the host restarts the round for them, up to MAX).
  int64_t waiting(int round);

  // This node's ranks all exited 0. Waits until every member's did (true: the job is done) or the round ended
  // otherwise (false: join the next). The host returns only once every other member, and every node waiting, has seen the end (bounded).
  bool finish(const Membership& m);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Endpoint endpoint_;
};

}  // namespace gradsync::cli
