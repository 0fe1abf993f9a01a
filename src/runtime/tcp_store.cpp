// The TCP store of a Gloo job (see tcp_store.h).
#include "runtime/tcp_store.h"

#include <atomic>
#include <algorithm>
#include <memory>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "gradsync/error.h"
#include "runtime/store_server.h"
#include "runtime/tcp_probe.h"
#include "torch_compat.h"

namespace gradsync {
namespace {

// Forwards to the client store and keeps the server (rank 0) alive as long as any user of the store. A failure
// becomes a DistributedError that says which store, served by whom, and what was asked of it.
class NamedStore : public compat::OwnStore {
 public:
  NamedStore(c10::intrusive_ptr<c10d::Store> inner, std::shared_ptr<StoreServer> server, std::string where, int rank)
      : OwnStore(inner->getTimeout()), server_(std::move(server)), inner_(std::move(inner)), where_(std::move(where)),
        rank_(rank) {}

  // c10d's client, destroyed after its server is gone, can throw from its destructor ("Connection reset by peer")
  // and so terminate the process instead of letting this rank report the store's failure; it is then left to exit.
  ~NamedStore() override {
    if (server_gone_) (void)inner_.release();
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    guarded("set", key, [&] { inner_->set(key, value); });
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& current,
                                  const std::vector<uint8_t>& desired) override {
    return guarded("compare_set", key, [&] { return inner_->compareSet(key, current, desired); });
  }
  std::vector<uint8_t> get(const std::string& key) override {
    return guarded("get", key, [&] { return inner_->get(key); });
  }
  int64_t add(const std::string& key, int64_t value) override {
    return guarded("add", key, [&] { return inner_->add(key, value); });
  }
  bool deleteKey(const std::string& key) override {
    return guarded("delete_key", key, [&] { return inner_->deleteKey(key); });
  }
  bool check(const std::vector<std::string>& keys) override {
    return guarded("check", first(keys), [&] { return inner_->check(keys); });
  }
  int64_t getNumKeys() override {
    return guarded("num_keys", "", [&] { return inner_->getNumKeys(); });
  }
  void wait(const std::vector<std::string>& keys) override {
    guarded("wait", first(keys), [&] { inner_->wait(keys); });
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    guarded("wait", first(keys), [&] { inner_->wait(keys, timeout); });
  }
  void setTimeout(const std::chrono::milliseconds& timeout) override {
    Store::setTimeout(timeout);
    inner_->setTimeout(timeout);
  }
  // Another client on the same store, the server kept alive by both.
  c10::intrusive_ptr<c10d::Store> clone_store() override {
    return guarded("clone", "", [&] {
      return c10::make_intrusive<NamedStore>(compat::clone_of(inner_), server_, where_, rank_);
    });
  }
  void watchKey(const std::string& key, c10d::WatchKeyCallback callback) override {
    guarded("watch_key", key, [&] { inner_->watchKey(key, std::move(callback)); });
  }

 private:
  static std::string first(const std::vector<std::string>& keys) { return keys.empty() ? "" : keys.front(); }

  template <typename Fn>
  auto guarded(const char* op, const std::string& key, Fn&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const c10::Error& e) {
      fail(op, key, e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(op, key, e.what());
    }
  }

  [[noreturn]] void fail(const char* op, const std::string& key, const std::string& what) {
    const bool gone = what.find("Broken pipe") != std::string::npos ||
                      what.find("Connection reset") != std::string::npos ||
                      what.find("Connection refused") != std::string::npos ||
                      what.find("Connection closed by peer") != std::string::npos;
    if (gone) server_gone_ = true;
    throw DistributedError(fmt::format(
        "rank {}: the rendezvous store at {} failed in {}('{}'): {}{}", rank_, where_, op, key, what,
        gone ? "; rank 0, which serves the store, has exited or failed (its own error, or the launcher's report, "
               "says why)" : ""));
  }

  std::shared_ptr<StoreServer> server_;  // first: destroyed after this rank's own client
  c10::intrusive_ptr<c10d::Store> inner_;
  std::string where_;
  int rank_;
  std::atomic<bool> server_gone_{false};  // set by whichever thread saw the failure
};

}  // namespace

c10::intrusive_ptr<c10d::Store> open_tcp_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const bool serve = env.rank == 0 && !env.agent_store;
  const std::string where = fmt::format("{}:{} ({})", env.master_addr, env.master_port,
                                        serve ? "served by this rank" : env.agent_store ? "served by torchrun's agent"
                                                                                          : "served by rank 0");
  std::shared_ptr<StoreServer> server;
  if (serve) {
    StoreServerOptions options;
    options.host = env.store_bind.empty() ? env.master_addr : env.store_bind;
    options.port = static_cast<uint16_t>(env.master_port);
    options.token = env.store_token;
    options.request_timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(10));
    server = std::make_shared<StoreServer>(options);  // throws naming host:port (a port in use)
  }
  // gradsync waits for the server itself, then gives c10d's client what is left of the timeout: 2.x's client
  // retries with a back-off of its own past the timeout asked for (3 s became 5 to 8 s) and logs every attempt
  // with a backtrace.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (const auto error = wait_until_accepting(env.master_addr, env.master_port, deadline); !error.empty()) {
    throw DistributedError(fmt::format("rank {} of {}: cannot connect to the rendezvous store at {} within {} ms: {} "
                                       "(the store's server has not started, has exited, or MASTER_ADDR/MASTER_PORT "
                                       "do not point to it)", env.rank, env.world_size, where, timeout.count(), error));
  }
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  options.isServer = false;
  options.numWorkers = env.world_size;
  options.waitWorkers = false;  // gradsync's rendezvous waits, and names the ranks that never came
  options.timeout = timeout;  // every later request's timeout too
  c10::intrusive_ptr<c10d::Store> client;
  try {
    client = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    throw DistributedError(fmt::format(
        "rank {} of {}: cannot connect to the rendezvous store at {}: {} (the store's server has not started, has "
        "exited, or MASTER_ADDR/MASTER_PORT do not point to it)", env.rank, env.world_size, where,
        c10_error ? c10_error->what_without_backtrace() : e.what()));
  }
  if (!env.store_token.empty()) client = c10::make_intrusive<c10d::PrefixStore>(env.store_token, client);
  return c10::make_intrusive<NamedStore>(client, std::move(server), where, env.rank);
}

}  // namespace gradsync
