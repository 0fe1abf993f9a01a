// The elastic rendezvous (see elastic_rendezvous.h).
#include "launch/elastic_rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "launch/spawn.h"
#include "runtime/store_server.h"
#include "runtime/tcp_probe.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(100);
// No single store request waits longer (a cut link answers nothing): a launcher notices within this.
constexpr auto kMaxRequest = std::chrono::milliseconds(10000);

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// The address this host sends from towards `e` (a UDP connect routes without sending anything).
std::string local_address_towards(const Endpoint& e) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(e.host.c_str(), std::to_string(e.port).c_str(), &hints, &found) != 0 || found == nullptr) {
    throw ConfigError(fmt::format("--rdzv-endpoint {}:{}: the host name cannot be resolved", e.host, e.port));
  }
  std::string address;
  const int fd = socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  char buffer[INET6_ADDRSTRLEN] = {};
  if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&local);
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&local);
    const void* raw = local.ss_family == AF_INET6 ? static_cast<const void*>(&v6->sin6_addr) : &v4->sin_addr;
    if (inet_ntop(local.ss_family, raw, buffer, sizeof buffer) != nullptr) address = buffer;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  if (address.empty()) {
    throw DistributedError(fmt::format("no route from this host to the rendezvous at {}:{}", e.host, e.port));
  }
  return address;
}

std::string node_entry(const ElasticNode& n) {
  return fmt::format("{} {} {} {}", n.address, n.pid, n.nproc, n.host ? 1 : 0);
}

ElasticNode parse_node(const std::string& entry) {
  std::istringstream in(entry);
  ElasticNode n;
  int host = 0;
  in >> n.address >> n.pid >> n.nproc >> host;
  n.host = host != 0;
  return n;
}

std::string names(const std::vector<ElasticNode>& nodes) {
  std::vector<std::string> out;
  for (const auto& n : nodes) out.push_back(n.name());
  return out.empty() ? "none" : fmt::format("{}", fmt::join(out, ", "));
}

}  // namespace

std::string ElasticNode::name() const { return fmt::format("{} (pid {})", address, pid); }

struct ElasticRendezvous::Impl {
  const LaunchOptions& options;
  const Endpoint endpoint;
  std::unique_ptr<StoreServer> server;
  c10::intrusive_ptr<c10d::Store> store;
  ElasticNode me;

  explicit Impl(const LaunchOptions& o) : options(o), endpoint(endpoint_of(o)) {}

  std::string key(int round, const std::string& what) const { return fmt::format("r{}/{}", round, what); }
  // Every request runs on a thread of its own and is waited for `limit` at most: over a cut link c10d's client may
  // wait for an answer forever, and the launcher must still stop its ranks and exit. A request left behind keeps
  // its store alive; the launcher exits soon after (every caller of a failed request gives up).
  template <typename Fn>
  auto bounded(const std::string& what, std::chrono::milliseconds limit, Fn fn) -> decltype(fn(*store)) {
    using Result = decltype(fn(*store));
    auto task = std::make_shared<std::packaged_task<Result()>>([s = store, fn] { return fn(*s); });
    auto result = task->get_future();
    std::thread([task] { (*task)(); }).detach();
    if (result.wait_for(limit) != std::future_status::ready) {
      throw DistributedError(fmt::format("the elastic rendezvous store at {}:{} did not answer {} within {} s",
                                         endpoint.host, endpoint.port, what, limit.count() / 1000.0));
    }
    return result.get();
  }
  std::chrono::milliseconds request_limit() const { return std::min(options.rdzv_timeout, kMaxRequest); }

  int64_t add(const std::string& k, int64_t delta) {
    return bounded("add('" + k + "')", request_limit(), [k, delta](c10d::Store& st) { return st.add(k, delta); });
  }
  int64_t count(const std::string& k) { return add(k, 0); }
  void set(const std::string& k, const std::string& v) {
    bounded("set('" + k + "')", request_limit(), [k, v](c10d::Store& st) { st.set(k, bytes(v)); return 0; });
  }
  std::string compare_set(const std::string& k, const std::string& v) {
    return bounded("compare_set('" + k + "')", request_limit(),
                   [k, v](c10d::Store& st) { return text(st.compareSet(k, {}, bytes(v))); });
  }
  std::optional<std::string> peek(const std::string& k) {
    return bounded("check('" + k + "')", request_limit(), [k](c10d::Store& st) -> std::optional<std::string> {
      if (!st.check({k})) return std::nullopt;
      return text(st.get(k));
    });
  }
  std::string wait_get(const std::string& k, std::chrono::milliseconds timeout) {
    return bounded("wait('" + k + "')", timeout + request_limit(), [k, timeout](c10d::Store& st) {
      st.wait({k}, timeout);
      return text(st.get(k));
    });
  }

  // Arrival i of the round, a member: the host published it once its entry was written.
  ElasticNode node(int round, int64_t i) { return parse_node(wait_get(key(round, fmt::format("node/{}", i)), kMaxRequest)); }

  // The arrivals of round `round` whose entries are written, by arrival number. One counted whose entry is missing is
  // asked again at the next poll; a launcher killed between the two requests is never a member.
  void collect(int round, std::map<int64_t, ElasticNode>& complete) {
    const int64_t counted = count(key(round, "joined"));
    for (int64_t i = 0; i < counted; ++i) {
      if (complete.count(i)) continue;
      if (auto entry = peek(key(round, fmt::format("node/{}", i)))) complete[i] = parse_node(*entry);
    }
  }

  // The host's part: closes round `round` once MAX came, or MIN and the last call since MIN came passed; aborts when
  // MIN did not come within the rendezvous timeout, or at once when the host gives up.
  void close(int round, const RoundStart& start, int64_t mine) {
    if (!start.give_up.empty()) return set(key(round, "closed"), "abort " + start.give_up);
    const auto opened = Clock::now();
    std::optional<Clock::time_point> min_at;
    std::map<int64_t, ElasticNode> complete;
    for (;; std::this_thread::sleep_for(kPoll)) {
      collect(round, complete);
      const auto now = Clock::now();
      const auto came = static_cast<int64_t>(complete.size());
      if (came >= options.min_nodes && !min_at) min_at = now;
      if (came >= options.max_nodes || (min_at && now - *min_at >= options.last_call)) {
        return publish(round, start, complete, mine);
      }
      if (!min_at && now - opened >= options.rdzv_timeout) return abort_below_min(round, complete, start.previous);
    }
  }

  // The members, up to MAX: the host (node 0, MASTER_ADDR), then the last round's members, then newcomers, each in
  // the order they came.
  void publish(int round, const RoundStart& start, const std::map<int64_t, ElasticNode>& complete, int64_t mine) {
    std::vector<int64_t> members{mine};
    const auto was_member = [&](const ElasticNode& n) {
      return std::find(start.previous.begin(), start.previous.end(), n) != start.previous.end();
    };
    for (const bool previous : {true, false}) {
      for (const auto& [i, n] : complete) {
        if (i != mine && was_member(n) == previous && static_cast<int>(members.size()) < options.max_nodes) {
          members.push_back(i);
        }
      }
    }
    const int port = free_port(endpoint.host);
    set(key(round, "closed"), fmt::format("{} {} {}", port, start.restarts, fmt::join(members, " ")));
  }

  void abort_below_min(int round, const std::map<int64_t, ElasticNode>& complete,
                       const std::vector<ElasticNode>& previous) {
    std::vector<ElasticNode> came, lost;
    for (const auto& [i, n] : complete) came.push_back(n);
    for (const auto& n : previous) {
      if (std::find(came.begin(), came.end(), n) == came.end()) lost.push_back(n);
    }
    const auto why = fmt::format(
        "round {}: {} node(s) joined within the rendezvous timeout of {} s, fewer than the minimum {} (--nnodes {}:{}); "
        "joined: {}; lost since the last round: {}", round, came.size(), options.rdzv_timeout.count() / 1000.0,
        options.min_nodes, options.min_nodes, options.max_nodes, names(came), names(lost));
    set(key(round, "closed"), "abort " + why);
  }

  // The host, after an abort: serves the store until every other arrival has read it, and at least `others` (the
  // last round's members, told to give up before they may have joined), or for one request's limit.
  void await_readers(int round, int64_t others) {
    const auto deadline = Clock::now() + kMaxRequest;
    const auto readers = [&] { return std::max(count(key(round, "joined")) - 1, others); };
    while (count(key(round, "seen")) < readers() && Clock::now() < deadline) std::this_thread::sleep_for(kPoll);
  }

  // A node that is not a member: true once round `round` has ended (join the next), false when its members all
  // finished. No timeout: a full round may run for as long as the job does.
  bool wait_for_next(int round, int64_t members) {
    for (;; std::this_thread::sleep_for(std::chrono::seconds(1))) {
      if (peek(key(round, "end"))) return true;
      if (count(key(round, "succeeded")) >= members) {
        add(key(round, "left"), 1);  // the host stops serving once everyone has seen the end
        return false;
      }
    }
  }

  // A client's check before its first round: the job's nodes all run the host's -n.
  void check_nproc() {
    const int host_nproc = std::stoi(wait_get("nproc", options.rdzv_timeout));
    if (host_nproc != options.nproc) {
      throw RendezvousAborted(fmt::format("this node ({}) runs -n {} and the rendezvous host {} -n {}: every node of "
                                          "an elastic job runs the same number of ranks", me.name(), options.nproc,
                                          endpoint.host, host_nproc));
    }
  }
};

ElasticRendezvous::ElasticRendezvous(const LaunchOptions& options)
    : impl_(std::make_unique<Impl>(options)), endpoint_(impl_->endpoint) {
  const std::string secret = read_store_token();
  try {
    StoreServerOptions server;
    server.host = endpoint_.host;
    server.port = static_cast<uint16_t>(endpoint_.port);
    server.token = secret;
    impl_->server = std::make_unique<StoreServer>(server);
  } catch (const DistributedError&) {
    // Not this host's address (or another launcher here serves it already): a client only.
  }
  const auto timeout = std::min<std::chrono::milliseconds>(options.rdzv_timeout, kMaxRequest);
  const auto deadline = Clock::now() + options.rdzv_timeout;
  if (const auto error = wait_until_accepting(endpoint_.host, endpoint_.port, deadline); !error.empty()) {
    throw DistributedError(fmt::format("cannot reach the elastic rendezvous at {}:{} within {} s: {} (the launcher "
                                       "serving it runs where --rdzv-endpoint's address is)", endpoint_.host,
                                       endpoint_.port, options.rdzv_timeout.count() / 1000.0, error));
  }
  c10d::TCPStoreOptions client;
  client.port = static_cast<uint16_t>(endpoint_.port);
  client.isServer = false;
  client.waitWorkers = false;
  client.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(endpoint_.host, client);
  if (!secret.empty()) store = c10::make_intrusive<c10d::PrefixStore>(secret, store);
  impl_->store = c10::make_intrusive<c10d::PrefixStore>("gradsync-elastic/" + options.rdzv_id, store);
  impl_->me = {local_address_towards(endpoint_), static_cast<long>(::getpid()), options.nproc, hosting()};
  if (hosting()) {
    impl_->me.address = endpoint_.host;  // the address the others reach it by
    impl_->set("nproc", std::to_string(options.nproc));
  }
}

ElasticRendezvous::~ElasticRendezvous() = default;

bool ElasticRendezvous::hosting() const { return impl_->server != nullptr; }

Membership ElasticRendezvous::join(int round, const RoundStart& start) {
  auto& s = *impl_;
  const auto& o = s.options;
  if (round < 0) {  // a client's first round: whichever is open
    s.check_nproc();
    round = std::stoi(s.wait_get("current", o.rdzv_timeout));
  }
  for (;; ++round) {
    if (hosting()) {
      s.set("current", std::to_string(round));
      s.set(s.key(round, "open"), "1");
    }
    const int64_t arrival = s.add(s.key(round, "joined"), 1) - 1;
    s.set(s.key(round, fmt::format("node/{}", arrival)), node_entry(s.me));
    if (hosting()) {
      s.close(round, start, arrival);
    } else {  // the host may still be stopping its ranks; its wait for MIN starts when it opens the round
      s.wait_get(s.key(round, "open"), o.rdzv_timeout + kMaxRequest);
    }
    const std::string closed = s.wait_get(s.key(round, "closed"), o.rdzv_timeout + o.last_call + kMaxRequest);
    if (closed.rfind("abort ", 0) == 0) {
      if (hosting()) {  // below MIN, the nodes that did not come are lost: wait only for those that came
        s.await_readers(round, start.give_up.empty() ? 0 : static_cast<int64_t>(start.previous.size()) - 1);
      } else {
        s.add(s.key(round, "seen"), 1);
      }
      throw RendezvousAborted(closed.substr(6));
    }
    Membership m;
    m.round = round;
    std::istringstream in(closed);
    in >> m.master_port >> m.restarts;
    std::vector<int64_t> members{std::istream_iterator<int64_t>(in), std::istream_iterator<int64_t>()};
    if (std::find(members.begin(), members.end(), arrival) == members.end()) {
      s.add(s.key(round, "waiting"), 1);
      report_line(fmt::format("round {} is already running with {} node(s); waiting for the next", round,
                              members.size()));
      if (!s.wait_for_next(round, static_cast<int64_t>(members.size()))) return m;  // the job finished without us
      continue;
    }
    for (const int64_t i : members) m.nodes.push_back(s.node(round, i));
    std::sort(m.nodes.begin(), m.nodes.end(), [](const ElasticNode& a, const ElasticNode& b) {
      return std::make_tuple(!a.host, a.address, a.pid) < std::make_tuple(!b.host, b.address, b.pid);
    });
    m.node_rank = static_cast<int>(std::find(m.nodes.begin(), m.nodes.end(), s.me) - m.nodes.begin());
    return m;
  }
}

std::string ElasticRendezvous::ended(int round) { return impl_->peek(impl_->key(round, "end")).value_or(""); }

std::string ElasticRendezvous::end(int round, const std::string& why) {
  return impl_->compare_set(impl_->key(round, "end"), why);
}

int64_t ElasticRendezvous::waiting(int round) { return impl_->count(impl_->key(round, "waiting")); }

bool ElasticRendezvous::finish(const Membership& m) {
  auto& s = *impl_;
  s.add(s.key(m.round, "succeeded"), 1);
  const auto members = static_cast<int64_t>(m.nodes.size());
  const auto deadline = Clock::now() + s.options.rdzv_timeout;
  for (;; std::this_thread::sleep_for(kPoll)) {
    if (s.count(s.key(m.round, "succeeded")) == members) break;
    if (!ended(m.round).empty()) return false;
    if (Clock::now() >= deadline) {
      throw DistributedError(fmt::format("round {}: this node's ranks finished, the others' did not within {} s",
                                         m.round, s.options.rdzv_timeout.count() / 1000.0));
    }
  }
  if (!hosting()) {
    s.add(s.key(m.round, "left"), 1);  // the last request: the host may stop serving after it
    return true;
  }
  // Members poll every 100 ms, waiting nodes every second: one request's limit is time enough for the living.
  const auto until = std::min(deadline, Clock::now() + kMaxRequest);
  const auto readers = [&] { return members - 1 + s.count(s.key(m.round, "waiting")); };
  while (s.count(s.key(m.round, "left")) < readers() && Clock::now() < until) std::this_thread::sleep_for(kPoll);
  return true;
}

}  // namespace gradsync::cli
