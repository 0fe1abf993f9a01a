// defines: the job's peers as the rendezvous saw them (rank, host, pid), and what this process can tell about them
// when a collective times out: a peer on this host that is stopped (SIGSTOP, a debugger) or gone is named, so the
// survivors' errors say which rank did not arrive instead of only that one did not.
#pragma once
#include <string>
#include <vector>

#include "runtime/rendezvous.h"

namespace gradsync {

// "<boot id>/<pid namespace inode>" of this process: what makes a peer's pid comparable with /proc here.
std::string machine_identity();

// After a successful rendezvous: every rank's entry (indexed by rank). Replaces the previous job's.
void remember_peers(std::vector<RendezvousInfo> peers, int self_rank);

// "; rank 1 (pid 123 on this host) is stopped (SIGSTOP or a debugger)" for each peer on this machine (same boot
// id and pid namespace) that is stopped, a zombie or gone; "" when none is (or the peers are elsewhere).
std::string describe_stalled_peers();

}  // namespace gradsync
