// Hosts in network namespaces (see netns_hosts.h).
#include "support/netns_hosts.h"

#include <unistd.h>

#include <fmt/format.h>

namespace gradsync::test {

ProcessResult sh(const std::string& command) {
  CommandOptions o;
  o.timeout = std::chrono::seconds(20);
  return run({"/bin/sh", "-c", command}, o);
}

NetnsHosts::NetnsHosts(int count) : id_(static_cast<int>(::getpid() % 200) + 20), count_(count) {
  possible_ = ::geteuid() == 0 && sh("command -v ip").ok();
  // The switch namespace reserves the id: `ip netns add` fails when it exists (left over, or another test's).
  ProcessResult reserved;
  for (int tries = 0; tries < 200; ++tries, id_ = (id_ - 20 + 1) % 200 + 20) {
    reserved = sh(fmt::format("ip netns add gs{}s", id_));
    if (reserved.ok() || reserved.err.find("File exists") == std::string::npos) break;
  }
  if (!reserved.ok()) {
    error_ = reserved.err;
    count_ = 0;
    reserved_ = false;
    return;
  }
  const std::string bridge = fmt::format("gs{}s", id_);
  std::string script = fmt::format("set -e; ip -n {s} link add br0 type bridge; ip -n {s} link set br0 up; ",
                                   fmt::arg("s", bridge));
  for (int i = 0; i < count; ++i) {
    const char host = static_cast<char>('a' + i);
    script += fmt::format(
        "ip netns del {h} 2>/dev/null || true; ip link del {h} 2>/dev/null || true; "
        "ip netns add {h}; ip link add {h} type veth peer name {h}s; ip link set {h} netns {h}; "
        "ip link set {h}s netns {s}; ip -n {s} link set {h}s master br0; ip -n {s} link set {h}s up; "
        "ip -n {h} addr add {addr}/24 dev {h}; ip -n {h} link set {h} up; ip -n {h} link set lo up; ",
        fmt::arg("h", name(host)), fmt::arg("s", bridge), fmt::arg("addr", address(host)));
  }
  const auto r = sh(script);
  ok_ = r.ok();
  error_ = r.err;
}

NetnsHosts::~NetnsHosts() {
  if (!reserved_) return;  // the id is another's
  std::string script = fmt::format("ip netns del gs{}s; ", id_);
  for (int i = 0; i < count_; ++i) script += fmt::format("ip netns del {}; ", name(static_cast<char>('a' + i)));
  sh(script);
}

std::string NetnsHosts::name(char host) const { return fmt::format("gs{}{}", id_, host); }

std::string NetnsHosts::address(char host) const { return fmt::format("10.77.{}.{}", id_, host - 'a' + 1); }

std::vector<std::string> NetnsHosts::exec(char host, const std::vector<std::string>& argv) const {
  std::vector<std::string> out{"ip", "netns", "exec", name(host)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

CommandOptions NetnsHosts::job(char host, std::chrono::seconds timeout) const {
  auto o = job_options(timeout, {"GRADSYNC_BACKEND"});
  o.env.insert(o.env.end(), {{"GLOO_SOCKET_IFNAME", name(host)}, {"GRADSYNC_STORE_TOKEN", "5ca1ab1e"}});
  return o;
}

bool NetnsHosts::cut(char host) const { return sh(fmt::format("ip -n {0} link set {0} down", name(host))).ok(); }

}  // namespace gradsync::test
