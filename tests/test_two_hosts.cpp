// Two hosts on one machine (ctest label `faults`): two network namespaces joined by a veth pair, one launcher in
// each (--nnodes 2), Gloo over real TCP between 10.77.x.1 and 10.77.x.2 through rank 0's store with a token. The
// parameters equal the one-host run bit for bit; cutting the link mid-training fails both sides within the timeout
// and leaves nothing running. Skipped, saying why, where namespaces cannot be made.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gradsync/state_dict.h"
#include "support/fault_record.h"
#include "support/subprocess.h"

namespace fs = std::filesystem;
namespace t = gradsync::test;
using Clock = std::chrono::steady_clock;

namespace {

t::ProcessResult sh(const std::string& command) {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(20);
  return t::run({"/bin/sh", "-c", command}, o);
}

// Two namespaces gs<id>a and gs<id>b, veth gs<id>a <-> gs<id>b, addresses 10.77.<id>.1 and .2; removed on scope exit.
class TwoHosts {
 public:
  TwoHosts() : id_(static_cast<int>(::getpid() % 200) + 20) {
    const auto r = sh(fmt::format(
        "set -e; ip netns add {a}; ip netns add {b}; ip link add {a} type veth peer name {b}; "
        "ip link set {a} netns {a}; ip link set {b} netns {b}; "
        "ip -n {a} addr add 10.77.{id}.1/24 dev {a}; ip -n {b} addr add 10.77.{id}.2/24 dev {b}; "
        "ip -n {a} link set {a} up; ip -n {b} link set {b} up; ip -n {a} link set lo up; ip -n {b} link set lo up",
        fmt::arg("a", name('a')), fmt::arg("b", name('b')), fmt::arg("id", id_)));
    ok_ = r.ok();
    error_ = r.err;
  }
  ~TwoHosts() { sh(fmt::format("ip netns del {}; ip netns del {}", name('a'), name('b'))); }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string name(char host) const { return fmt::format("gs{}{}", id_, host); }
  std::string address(char host) const { return fmt::format("10.77.{}.{}", id_, host == 'a' ? 1 : 2); }

  // `gradsync launch` of node `host` (a: node 0, the store's) running `train_args`, inside its namespace.
  t::Process launch(char host, int port, const std::vector<std::string>& train_args) const {
    std::vector<std::string> argv{"ip", "netns", "exec", name(host), GRADSYNC_BIN, "launch", "--nnodes", "2",
                                  "--node-rank", host == 'a' ? "0" : "1", "-n", "1", "--master-addr", address('a'),
                                  "--master-port", std::to_string(port), "--", GRADSYNC_BIN, "train"};
    argv.insert(argv.end(), train_args.begin(), train_args.end());
    t::CommandOptions o;
    o.timeout = std::chrono::seconds(120);
    o.env = {{"OMP_NUM_THREADS", "1"}, {"GLOO_SOCKET_IFNAME", name(host)}, {"GRADSYNC_STORE_TOKEN", "5ca1ab1e"}};
    o.unset_env = {"RANK", "WORLD_SIZE", "GRADSYNC_STORE_FILE", "MASTER_ADDR", "MASTER_PORT", "GRADSYNC_BACKEND"};
    return t::Process::start(argv, o);
  }

 private:
  int id_;
  bool ok_ = false;
  std::string error_;
};

std::vector<std::string> flags(const std::string& dir, const std::string& tag, int64_t steps) {
  return {"--model", "mlp:8-16-4", "--data", "synthetic:256", "--global-batch", "16", "--steps",
          std::to_string(steps), "--optimizer", "adam", "--timeout", "5", "--quiet", "--save-state",
          dir + "/" + tag + ".pt", "--log", dir + "/" + tag + ".log"};
}


}  // namespace

TEST(FaultsTwoHosts, GlooAcrossTwoNamespacesEqualsTheOneHostRunAndACutLinkFailsWithinTheTimeout) {
  TwoHosts hosts;
  if (!hosts.ok()) GTEST_SKIP() << "network namespaces cannot be made here (needs root and iproute2): " << hosts.error();
  const auto dir = t::make_temp_dir("gradsync-two-hosts-");
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(120);
  o.env = {{"OMP_NUM_THREADS", "1"}};
  o.unset_env = {"RANK", "WORLD_SIZE", "GRADSYNC_STORE_FILE", "MASTER_ADDR", "MASTER_PORT", "GRADSYNC_BACKEND"};
  auto one_host = flags(dir, "one", 40);
  one_host.insert(one_host.begin(), {GRADSYNC_BIN, "train", "--world-size", "2"});
  ASSERT_TRUE(t::run(one_host, o).ok());

  const int port = 29000 + static_cast<int>(::getpid() % 1000);
  auto node0 = hosts.launch('a', port, flags(dir, "two", 40));
  auto node1 = hosts.launch('b', port, flags(dir, "two-node1", 40));
  const auto r0 = node0.wait(), r1 = node1.wait();
  ASSERT_TRUE(r0.ok()) << r0.describe();
  ASSERT_TRUE(r1.ok()) << r1.describe();
  const auto a = gradsync::load_state_dict(dir + "/one.pt"), b = gradsync::load_state_dict(dir + "/two.pt");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;

  // Cut the link while they train: both sides fail within the timeout (5 s), naming their rank and operation.
  auto cut0 = hosts.launch('a', port + 1, flags(dir, "cut", 1000000));
  auto cut1 = hosts.launch('b', port + 1, flags(dir, "cut-node1", 1000000));
  while (t::line_count(dir + "/cut.log") < 10 && !cut0.poll()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(sh(fmt::format("ip -n {} link set {} down", hosts.name('a'), hosts.name('a'))).ok());
  const auto cut_at = Clock::now();
  const auto c0 = cut0.wait(), c1 = cut1.wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - cut_at).count();
  EXPECT_FALSE(c0.timed_out || c1.timed_out);
  EXPECT_NE(c0.exit_code, 0);
  EXPECT_NE(c1.exit_code, 0);
  EXPECT_LT(seconds, 5 * 1.1 + 6) << "timeout + 10% + the launchers' grace period";
  EXPECT_NE(c0.err.find("rank 0 of 2: "), std::string::npos) << c0.err;
  EXPECT_NE(c1.err.find("rank 1 of 2: "), std::string::npos) << c1.err;
  const bool clean = c0.exit_code != 0 && c1.exit_code != 0 && c0.err.find("rank 0 of 2: ") != std::string::npos &&
                     c1.err.find("rank 1 of 2: ") != std::string::npos;
  t::record_faults({1, clean ? 1 : 0, (c0.timed_out || c1.timed_out) ? 1 : 0, 0, 0, 0, 0, 0});
  fmt::print("faults: two hosts over veth bit-identical to one host; link cut detected on both in {:.1f} s\n",
             seconds);
  fs::remove_all(dir);
}
