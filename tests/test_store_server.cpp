// Tests for src/runtime/store_server.h and tcp_store.h: c10d's own TCPStore clients (libtorch's and Python's) are
// served; the server listens only where it is told; stray, malicious and stalled clients are dropped without
// memory growth or delay for the others; store failures name the store and who serves it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "gradsync/error.h"
#include "runtime/store_server.h"
#include "runtime/tcp_store.h"
#include "support/error_of.h"
#include "support/fault_record.h"
#include "support/subprocess.h"

namespace t = gradsync::test;
using gradsync::StoreServer;
using gradsync::StoreServerOptions;
using Clock = std::chrono::steady_clock;

namespace {

c10::intrusive_ptr<c10d::TCPStore> client(uint16_t port, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

// A raw connection, for what no c10d client would send.
int raw_connect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// true once the server has closed the connection (recv returns 0), within `limit`.
bool closed_within(int fd, std::chrono::milliseconds limit) {
  timeval tv{static_cast<time_t>(limit.count() / 1000), static_cast<suseconds_t>(limit.count() % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char c;
  const bool closed = ::recv(fd, &c, 1, 0) == 0;
  ::close(fd);
  return closed;
}

int64_t resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}


}  // namespace

TEST(StoreServer, ServesLibtorchsTcpStoreClientsEveryOperation) {
  StoreServer server(StoreServerOptions{});
  auto a = client(server.port());
  auto b = client(server.port());
  a->set("x", bytes("1"));
  EXPECT_EQ(text(b->get("x")), "1");
  EXPECT_EQ(a->add("n", 5), 5);
  EXPECT_EQ(b->add("n", -2), 3);
  EXPECT_TRUE(b->check({"x", "n"}));
  EXPECT_FALSE(b->check({"x", "missing"}));
  EXPECT_EQ(text(a->compareSet("x", bytes("1"), bytes("2"))), "2");
  EXPECT_EQ(text(a->compareSet("x", bytes("1"), bytes("3"))), "2");
  EXPECT_EQ(b->getNumKeys(), 2);
  EXPECT_TRUE(b->deleteKey("x"));
  EXPECT_FALSE(b->deleteKey("x"));
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    b->set("late", bytes("ok"));
  });
  a->wait({"late"});  // woken by another client's set
  later.join();
  EXPECT_EQ(text(a->get("late")), "ok");
  const auto start = Clock::now();
  EXPECT_THROW(a->wait({"never"}, std::chrono::milliseconds(300)), std::exception);
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(290));
  EXPECT_LT(waited, std::chrono::milliseconds(1300));  // a timeout t fails within [t, t + 1 s]
}

TEST(StoreServer, ServesPythonTorchDistributedTcpStoreWithTheToken) {
  StoreServerOptions o;
  o.token = "f00dcafe";
  StoreServer server(o);
  auto mine = c10::make_intrusive<c10d::PrefixStore>("f00dcafe", client(server.port()));
  mine->set("from-cpp", bytes("hello"));
  const auto py = t::run({GRADSYNC_PYTHON, "-c",
                          "import sys, datetime, torch.distributed as d\n"
                          "s = d.PrefixStore('f00dcafe', d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, "
                          "timeout=datetime.timedelta(seconds=20)))\n"
                          "assert s.get('from-cpp') == b'hello'\n"
                          "s.set('from-python', 'hi'); s.add('count', 7)\n",
                          std::to_string(server.port())});
  ASSERT_TRUE(py.ok()) << py.describe();
  EXPECT_EQ(text(mine->get("from-python")), "hi");
  EXPECT_EQ(mine->add("count", 0), 7);
  EXPECT_EQ(server.stats().wrong_token, 0);
}

TEST(FaultsStore, ListensOnlyOnTheAddressItIsGivenAndAPortInUseIsNamed) {
  StoreServer loopback(StoreServerOptions{});
  EXPECT_EQ(t::listeners_on(loopback.port()), std::vector<std::string>{fmt::format("0100007F:{:04X}", loopback.port())});
  StoreServerOptions all;
  all.host = "0.0.0.0";  // only when asked for (GRADSYNC_STORE_BIND=0.0.0.0)
  StoreServer everywhere(all);
  EXPECT_EQ(t::listeners_on(everywhere.port()), std::vector<std::string>{fmt::format("00000000:{:04X}", everywhere.port())});
  StoreServerOptions taken;
  taken.port = loopback.port();
  const auto err = t::error_of<gradsync::DistributedError>([&] { StoreServer again(taken); });
  const bool named = err.find(fmt::format("127.0.0.1:{}: bind failed: Address already in use", loopback.port())) !=
                     std::string::npos;
  EXPECT_TRUE(named) << err;
  t::record_faults({1, named ? 1 : 0, 0, 0, 0, 0, 0, 0});
}

TEST(FaultsStore, StrayMaliciousAndStalledClientsAreDroppedAndTheStoreKeepsServing) {
  StoreServerOptions o;
  o.token = "job7";
  o.request_timeout = std::chrono::milliseconds(500);
  StoreServer server(o);
  auto good = c10::make_intrusive<c10d::PrefixStore>("job7", client(server.port()));
  good->set("k", bytes("v"));
  const int64_t rss_before = resident_bytes();
  // Garbage, a scan's probe, a key without the token, and a 2 GiB length prefix on the right token's key.
  const auto send_raw = [&](const std::string& payload) {
    const int fd = raw_connect(server.port());
    EXPECT_EQ(::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL), static_cast<ssize_t>(payload.size()));
    return fd;
  };
  const auto u64 = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  int dropped = 0;
  const auto expect_dropped = [&](int fd, std::chrono::seconds limit) {
    const bool closed = closed_within(fd, limit);
    EXPECT_TRUE(closed);
    dropped += closed;
  };
  expect_dropped(send_raw("GET / HTTP/1.0\r\n\r\n"), std::chrono::seconds(2));
  const std::string stray_key = "/other/k";
  expect_dropped(send_raw(std::string(1, '\0') + u64(stray_key.size()) + stray_key + u64(1u << 30)),
                 std::chrono::seconds(2));
  expect_dropped(send_raw(std::string(1, '\0') + u64(uint64_t{2} << 30)), std::chrono::seconds(2));
  const std::string key = "/job7/big";
  expect_dropped(send_raw(std::string(1, '\0') + u64(key.size()) + key + u64(uint64_t{2} << 30)),
                 std::chrono::seconds(2));
  // Slowloris: half a request, then silence. Others are served meanwhile; it is dropped after request_timeout.
  const int slow = send_raw(std::string(1, '\0') + u64(key.size()) + "/jo");
  std::vector<double> ms;
  for (int i = 0; i < 200; ++i) {
    const auto start = Clock::now();
    EXPECT_EQ(text(good->get("k")), "v");
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  EXPECT_LT(ms[197], 100.0) << "p99 of get() while a client stalls";
  expect_dropped(slow, std::chrono::seconds(3));
  EXPECT_LT(resident_bytes() - rss_before, int64_t{16} << 20);
  const auto stats = server.stats();
  EXPECT_EQ(stats.malformed, 3);  // the HTTP probe, the 2 GiB key, the 2 GiB value
  EXPECT_EQ(stats.wrong_token, 1);
  EXPECT_EQ(stats.too_slow, 1);
  EXPECT_EQ(text(good->get("k")), "v");
  t::record_faults({5, dropped, 0, 0, 0, 0, 0, 0});
}

TEST(FaultsStore, AServerWithAHalfRequestHeldOpenStopsAtOnce) {
  const auto start = Clock::now();
  int held = -1;
  {
    StoreServer server(StoreServerOptions{});
    held = raw_connect(server.port());
    const std::string half(5, '\0');  // a SET's query byte and half of its key length
    ASSERT_EQ(::send(held, half.data(), half.size(), MSG_NOSIGNAL), 5);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }  // rank 0 exits: it must not wait for the client
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, 1.0);
  EXPECT_TRUE(closed_within(held, std::chrono::seconds(1)));
  t::record_faults({1, seconds < 1.0 ? 1 : 0, 0, 0, 0, 0, 0, 0});
}

TEST(StoreServer, AStoreWhoseServerIsGoneNamesItAndRankZero) {
  gradsync::LaunchEnv served;
  served.world_size = 2;
  served.master_addr = "127.0.0.1";
  served.master_port = t::free_port();
  auto rank0 = gradsync::open_tcp_store(served, std::chrono::seconds(5));
  gradsync::LaunchEnv other = served;
  other.rank = 1;
  auto rank1 = gradsync::open_tcp_store(other, std::chrono::seconds(5));
  rank1->set("a", bytes("1"));
  rank0.reset();  // rank 0 exits: its server goes with it
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto err = t::error_of<gradsync::DistributedError>([&] {
    rank1->set("b", bytes("2"));
    rank1->get("a");
  });
  EXPECT_NE(err.find(fmt::format("rank 1: the rendezvous store at 127.0.0.1:{} (served by rank 0) failed in",
                                 served.master_port)), std::string::npos) << err;
  EXPECT_NE(err.find("rank 0, which serves the store, has exited or failed"), std::string::npos) << err;
}
