// StoreServer (see store_server.h): the listening socket, the connections and the poll loop; the protocol is
// StoreState's (store_protocol.h).
#include "runtime/store_server.h"

#include <fcntl.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gradsync/error.h"
#include "runtime/store_protocol.h"

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;

struct Connection {
  int fd = -1;
  std::vector<uint8_t> in;   // bytes of requests not yet complete
  std::string out;           // replies not yet sent
  Clock::time_point begun;   // when the incomplete request in `in` began
};

[[noreturn]] void fail(const StoreServerOptions& o, const char* step, int error) {
  throw DistributedError(fmt::format("cannot serve the rendezvous store on {}:{}: {} failed: {} (errno {})", o.host,
                                     o.port, step, std::strerror(error), error));
}

bool is_loopback(const sockaddr* addr) {
  if (addr->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr) >> 24) == 127;
  }
  return addr->sa_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr);
}

// A host name that resolves to loopback here (Debian's /etc/hosts maps the machine's own name to 127.0.1.1) keeps
// ranks on other hosts out: say so, since the address is what the user gave.
void warn_if_loopback_by_name(const StoreServerOptions& o, const sockaddr* addr) {
  const bool literal = o.host == "localhost" || o.host.rfind("127.", 0) == 0 || o.host == "::1";
  if (!literal && is_loopback(addr)) {
    fmt::print(stderr, "gradsync: warning: the rendezvous store listens on {} only: '{}' resolves to a loopback "
                       "address here, which ranks on other hosts cannot reach; give this host's IP address as "
                       "MASTER_ADDR, or GRADSYNC_STORE_BIND=0.0.0.0\n", o.host, o.host);
  }
}

// A listening socket on exactly `host` (resolved, numeric or a name), never on every interface unless `host` is
// the wildcard address itself.
int listen_on(const StoreServerOptions& o) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const auto port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(o.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    throw DistributedError(fmt::format("cannot serve the rendezvous store on {}:{}: cannot resolve '{}': {}", o.host,
                                       o.port, o.host, gai_strerror(rc)));
  }
  const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ::freeaddrinfo(found);
    fail(o, "socket", errno);
  }
  warn_if_loopback_by_name(o, found->ai_addr);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const int bound = ::bind(fd, found->ai_addr, found->ai_addrlen);
  const int error = errno;
  ::freeaddrinfo(found);
  if (bound != 0 || ::listen(fd, 1024) != 0) {
    const int e = bound != 0 ? error : errno;
    ::close(fd);
    fail(o, bound != 0 ? "bind" : "listen", e);
  }
  return fd;
}

uint16_t bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

struct StoreServer::Impl {
  StoreServerOptions options;
  int listener = -1;
  int wake[2] = {-1, -1};
  uint16_t port = 0;
  std::map<uint64_t, Connection> connections;
  uint64_t next_id = 1;
  StoreState state;
  Clock::time_point accept_paused_until;  // after EMFILE: the listener rests briefly
  mutable std::mutex stats_mutex;
  StoreServerStats stats;
  std::thread thread;

  explicit Impl(StoreServerOptions o)
      : options(std::move(o)),
        state(StoreLimits{options.max_key_bytes, options.max_value_bytes, options.max_keys_per_request,
                          options.token.empty() ? "" : "/" + options.token + "/"},
              [this](uint64_t id, const std::string& bytes) { queue(id, bytes); }) {}

  void queue(uint64_t id, const std::string& bytes) {
    auto it = connections.find(id);
    if (it == connections.end()) return;
    it->second.out += bytes;
    flush(it->second);
  }

  static void flush(Connection& c) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n <= 0) return;  // EAGAIN: POLLOUT later; an error shows up as a hang-up at the next poll
      c.out.erase(0, static_cast<size_t>(n));
    }
  }

  void count(int64_t StoreServerStats::*field) {
    std::lock_guard<std::mutex> lock(stats_mutex);
    ++(stats.*field);
  }

  void drop(uint64_t id) {
    auto it = connections.find(id);
    if (it == connections.end()) return;
    ::close(it->second.fd);
    connections.erase(it);
    state.disconnect(id);
  }

  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
        accept_paused_until = Clock::now() + std::chrono::milliseconds(100);  // not a busy loop on a full table
      }
      if (fd < 0) return;
      if (connections.size() >= options.max_connections) {
        ::close(fd);
        count(&StoreServerStats::over_capacity);
        continue;
      }
      connections[next_id++].fd = fd;
      count(&StoreServerStats::accepted);
    }
  }

  // Reads what arrived (bounded per round, so one busy client cannot starve the others) and handles it. A client
  // that does not read its replies is dropped once they exceed two of the largest values.
  void receive(uint64_t id) {
    Connection& c = connections.at(id);
    if (c.out.size() > 2 * options.max_value_bytes) {
      count(&StoreServerStats::malformed);
      return drop(id);
    }
    uint8_t buffer[65536];
    for (int round = 0; round < 16; ++round) {
      const ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return drop(id);
      if (n < 0) break;
      if (c.in.empty()) c.begun = Clock::now();
      c.in.insert(c.in.end(), buffer, buffer + n);
      const size_t had = c.in.size();
      const Parse status = state.feed(id, c.in);
      if (status == Parse::Malformed || status == Parse::WrongToken) {
        count(status == Parse::Malformed ? &StoreServerStats::malformed : &StoreServerStats::wrong_token);
        return drop(id);
      }
      if (!c.in.empty() && c.in.size() < had) c.begun = Clock::now();  // a new request began after complete ones
    }
  }

  // Drops connections whose request has been incomplete for too long; returns the poll timeout until the next.
  int expire_slow_requests() {
    const auto now = Clock::now();
    auto next = now + std::chrono::seconds(1);
    std::vector<uint64_t> slow;
    for (const auto& [id, c] : connections) {
      if (c.in.empty()) continue;
      const auto deadline = c.begun + options.request_timeout;
      if (deadline <= now) {
        slow.push_back(id);
      } else {
        next = std::min(next, deadline);
      }
    }
    for (uint64_t id : slow) {
      count(&StoreServerStats::too_slow);
      drop(id);
    }
    return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(next - now).count());
  }

  void run() {
    for (;;) {
      const int timeout_ms = expire_slow_requests();
      const bool accepting = Clock::now() >= accept_paused_until;
      std::vector<pollfd> fds{{wake[0], POLLIN, 0}, {listener, static_cast<short>(accepting ? POLLIN : 0), 0}};
      std::vector<uint64_t> ids;
      for (const auto& [id, c] : connections) {
        fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        ids.push_back(id);
      }
      if (::poll(fds.data(), fds.size(), accepting ? timeout_ms : std::min(timeout_ms, 100)) < 0 && errno != EINTR) {
        fmt::print(stderr, "gradsync: the rendezvous store on {}:{} stopped serving: poll failed: {}\n",
                   options.host, port, std::strerror(errno));
        return;
      }
      if (fds[0].revents != 0) return;  // the destructor
      if (fds[1].revents & POLLIN) accept_all();
      for (size_t i = 0; i < ids.size(); ++i) {
        const short events = fds[i + 2].revents;
        if (events == 0 || connections.count(ids[i]) == 0) continue;
        if (events & POLLOUT) flush(connections.at(ids[i]));
        if (events & (POLLIN | POLLHUP | POLLERR)) receive(ids[i]);
      }
    }
  }
};

// Each c10d client holds two connections: a thousand ranks need more descriptors than the usual soft limit.
void raise_descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

StoreServer::StoreServer(StoreServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  raise_descriptor_limit();
  impl_->listener = listen_on(impl_->options);
  impl_->port = bound_port(impl_->listener);
  if (::pipe2(impl_->wake, O_CLOEXEC) != 0) {
    ::close(impl_->listener);
    fail(impl_->options, "pipe", errno);
  }
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

StoreServer::~StoreServer() {
  const char byte = 0;
  (void)!::write(impl_->wake[1], &byte, 1);
  impl_->thread.join();
  // A connection still in the listen backlog gets a reset when the listener closes, and c10d's TCPStore client
  // reads its callback connection on a thread of its own that lets a reset escape: its process would terminate
  // instead of reporting the store gone. Taken and closed like the others, every connection sees an orderly end.
  for (int fd; (fd = ::accept4(impl_->listener, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) ::close(fd);
  for (auto& [id, c] : impl_->connections) ::close(c.fd);
  ::close(impl_->listener);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

uint16_t StoreServer::port() const { return impl_->port; }

StoreServerStats StoreServer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mutex);
  return impl_->stats;
}

}  // namespace gradsync
