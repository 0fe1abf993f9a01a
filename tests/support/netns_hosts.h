// defines: NetnsHosts, hosts on one machine for the multi-host tests: network namespaces gs<id>a, gs<id>b, ... each
// with one interface of its own name on a bridge in a switch namespace gs<id>s, addressed 10.77.<id>.1, .2, ...
// Removed on scope exit. Needs root and iproute2; ok() is false (and error() says why) where they cannot be made.
// <id> is the first free one from the test's pid: a namespace left by a crashed run, or another test's, is skipped.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "support/subprocess.h"

namespace gradsync::test {

// `command` under /bin/sh, with a 20 s deadline.
ProcessResult sh(const std::string& command);

class NetnsHosts {
 public:
  explicit NetnsHosts(int count);
  ~NetnsHosts();
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  bool ok() const { return ok_; }
  bool possible() const { return possible_; }  // root with iproute2: where not ok() is a failure, not a skip
  const std::string& error() const { return error_; }
  // Host 'a', 'b', ...: its namespace, which is also the name of its interface.
  std::string name(char host) const;
  std::string address(char host) const;
  // `argv` run inside the host's namespace: ip netns exec <name> argv...
  std::vector<std::string> exec(char host, const std::vector<std::string>& argv) const;
  // A gradsync job's options there: job_options(timeout, {GRADSYNC_BACKEND}), Gloo on the host's interface, the
  // store's token.
  CommandOptions job(char host, std::chrono::seconds timeout) const;
  // Takes the host's link down: it can reach no other host, and none reaches it.
  bool cut(char host) const;

 private:
  int id_;
  int count_;
  bool ok_ = false;
  bool possible_ = false;
  bool reserved_ = true;  // this object made gs<id>s (and removes what it made)
  std::string error_;
};

}  // namespace gradsync::test

// In a test: skips where namespaces cannot be made at all (not root, no iproute2), and fails where they could be
// but were not, so that a suite of multi-host tests never passes by skipping on a machine that can run it.
#define GRADSYNC_REQUIRE_HOSTS(hosts)                                                                    \
  do {                                                                                                  \
    if (!(hosts).ok() && !(hosts).possible()) {                                                         \
      GTEST_SKIP() << "network namespaces cannot be made here (needs root and iproute2): " << (hosts).error(); \
    }                                                                                                   \
    ASSERT_TRUE((hosts).ok()) << "network namespaces could not be made, as root: " << (hosts).error();   \
  } while (0)
