// Communication volume accounting (CommStats in stats.h).
#include "gradsync/stats.h"

#include <fstream>

#include "common/ring_bytes.h"

namespace gradsync {

void CommStats::add_allgather(int64_t total_bytes, int world) {
  allgather += ring_share_sent(total_bytes, world);
  ++calls;
}

void CommStats::add_reduce_scatter(int64_t total_bytes, int world) {
  reduce_scatter += ring_share_sent(total_bytes, world);
  ++calls;
}

void CommStats::add_allreduce(int64_t bytes, int world) {
  allreduce += ring_allreduce_sent(bytes, world);
  ++calls;
}

void CommStats::add_replica_allreduce(int64_t bytes, int replicas) {
  across_replicas += ring_allreduce_sent(bytes, replicas);
  ++calls;
}

CommStats CommStats::operator-(const CommStats& before) const {
  CommStats d;
  d.allgather = allgather - before.allgather;
  d.reduce_scatter = reduce_scatter - before.reduce_scatter;
  d.allreduce = allreduce - before.allreduce;
  d.across_replicas = across_replicas - before.across_replicas;
  d.calls = calls - before.calls;
  return d;
}

int64_t process_bytes_written() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

int64_t process_peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "VmHWM:   123456 kB"
  }
  return -1;
}

}  // namespace gradsync
