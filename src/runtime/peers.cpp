// The job's peers and their state on this host (see peers.h).
#include "runtime/peers.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <mutex>

#include <fmt/format.h>

namespace gradsync {
namespace {

struct Peers {
  std::mutex mutex;
  std::vector<RendezvousInfo> all;
  int self = -1;
};

Peers& peers() {
  static auto* p = new Peers();  // intentionally never freed: read from error paths at any time
  return *p;
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The state letter of /proc/<pid>/stat (R, S, D, T, t, Z, ...), or '?' when the process is gone.
char process_state(long pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

}  // namespace

std::string machine_identity() {
  const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  struct stat st {};
  if (boot.empty() || ::stat("/proc/self/ns/pid", &st) != 0) return "";
  return fmt::format("{}/{}", boot, st.st_ino);
}

void remember_peers(std::vector<RendezvousInfo> all, int self_rank) {
  std::lock_guard<std::mutex> lock(peers().mutex);
  peers().all = std::move(all);
  peers().self = self_rank;
}

std::string describe_stalled_peers() {
  std::lock_guard<std::mutex> lock(peers().mutex);
  const std::string here = machine_identity();
  std::string out;
  for (const auto& p : peers().all) {
    if (p.rank == peers().self || here.empty() || p.machine != here) continue;
    const char state = process_state(p.pid);
    const char* what = state == 'T' || state == 't' ? "is stopped (SIGSTOP or a debugger)"
                       : state == 'Z'              ? "has exited (not yet reaped)"
                       : state == '?'              ? "has exited"
                                                   : nullptr;
    if (what) out += fmt::format("; rank {} (pid {} on this host) {}", p.rank, p.pid, what);
  }
  return out;
}

}  // namespace gradsync
