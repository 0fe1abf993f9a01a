// defines: open_tcp_store(), the store of a Gloo job that meets at MASTER_ADDR:MASTER_PORT (ranks started by hand,
// several hosts, torchrun). Where gradsync serves it (rank 0, unless torchrun's agent does), the server is
// StoreServer (store_server.h): the given address only, the job's token, bounded requests. Every rank -- rank 0
// too -- talks to it as a c10d TCPStore client, so torchrun's own store serves gradsync's ranks just as well. Every
// store error names the store, who serves it, the operation and the key, instead of c10d's bare "Broken pipe".
#pragma once
#include <chrono>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "gradsync/runtime.h"

namespace gradsync {

// Throws DistributedError naming host:port when the store cannot be served (a port in use) or reached in time.
c10::intrusive_ptr<c10d::Store> open_tcp_store(const LaunchEnv& env, std::chrono::milliseconds timeout);

}  // namespace gradsync
