// defines: launch_elastic(), `gradsync launch --nnodes MIN:MAX`: torchrun's elastic agent for one node. Rounds of
// membership are formed at the rendezvous (elastic_rendezvous.h); a round's ranks run until they all succeed, one
// fails anywhere, or a newcomer waits to join; then every survivor stops its ranks and the next round forms from
// whoever comes, MIN to MAX nodes, and the ranks start again with the new WORLD_SIZE and RANKs (they resume from
// their checkpoint: train --resume).
#pragma once
#include <string>

#include "launch/launch.h"

namespace gradsync::cli {

// --rdzv-endpoint HOST:PORT (or "[v6]:PORT"), or --master-addr:--master-port when it is not given.
struct Endpoint {
  std::string host;
  int port = 0;
};
// Throws ConfigError naming the value when it is not HOST:PORT with a port from 1 to 65535.
Endpoint endpoint_of(const LaunchOptions& options);

// The elastic flags (min_nodes > 0): MIN:MAX in range, an endpoint, gloo, a usable --rdzv-id and timeout. Throws
// ConfigError naming the flag and value.
void validate_elastic(const LaunchOptions& options);

// Runs this node's part of the elastic job until it ends. Returns 0 when every node's ranks succeeded in the same
// round; otherwise non-zero, after a report naming the nodes lost (below MIN nodes, out of restarts, or the
// rendezvous host gone). Membership changes that only add a node do not count as restarts; failures do.
int launch_elastic(const LaunchOptions& options);

}  // namespace gradsync::cli
