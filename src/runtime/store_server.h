// defines: StoreServer, the rendezvous store rank 0 serves for a Gloo job in place of libtorch 1.13's TCPStore
// server. It speaks c10d's TCPStore protocol, so every client stays c10d's own (gradsync's ranks, Python's
// torch.distributed.TCPStore, and -- the other way round -- gradsync ranks under torchrun's store), and adds what
// that server lacks:
//   - it listens only on the address it is given (MASTER_ADDR: 127.0.0.1 is loopback only), never on every
//     interface unless that is what it was given;
//   - with a token, every key must start with "/<token>/" (the clients wrap their store in a PrefixStore of the
//     token): a stray connection is dropped at its first key, before any value is read;
//   - lengths are checked when they arrive, before anything is allocated (a key over 4 KiB, a value over 64 MiB,
//     more than 4096 keys in one request: dropped), and nothing is buffered beyond the bytes actually received;
//   - one thread and non-blocking sockets: a client that stalls mid-request (slowloris) or never reads holds up
//     nobody, and is dropped once its request has been incomplete for request_timeout; the destructor returns at
//     once whatever the clients do.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace gradsync {

struct StoreServerOptions {
  std::string host = "127.0.0.1";  // the address to listen on, as given ("0.0.0.0" or "::": every interface)
  uint16_t port = 0;               // 0: a free port (see port())
  std::string token;               // "": any key; otherwise keys must start with "/<token>/"
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = size_t{64} << 20;
  size_t max_keys_per_request = 4096;
  size_t max_connections = 4096;
  std::chrono::milliseconds request_timeout{10000};  // a begun request must be complete within this
};

// Why connections were dropped (for tests and diagnostics).
struct StoreServerStats {
  int64_t accepted = 0;
  int64_t malformed = 0;    // unknown query type, oversized length, missing key on GET
  int64_t wrong_token = 0;  // a key outside the token's prefix
  int64_t too_slow = 0;     // a request incomplete after request_timeout
  int64_t over_capacity = 0;
};

class StoreServer {
 public:
  // Binds and listens, then serves from a thread of its own. Throws DistributedError naming host:port and the
  // errno when the address cannot be resolved or bound (a port in use).
  explicit StoreServer(StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  uint16_t port() const;
  StoreServerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync
