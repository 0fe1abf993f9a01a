// defines: CommStats, the bytes one rank sends per collective kind as the algorithms move them, and
// process_bytes_written(), the kernel's own count of what this process wrote (Gloo's TCP transport included),
// which measures the same thing from outside.
//
// Per-rank volume of a collective over N ranks on S bytes in total (ring algorithms; what Gloo 1.13 measured on
// loopback, see docs/sharding.md): all-gather and reduce-scatter (N-1)/N * S, allreduce 2(N-1)/N * S. For Psi
// parameters of b bytes: DDP's allreduce is 2(N-1)/N * b*Psi, the "2 Psi" of the ZeRO paper, whose figures drop
// the (N-1)/N.
#pragma once
#include <cstdint>
#include <string>

namespace gradsync {

struct CommStats {
  int64_t allgather = 0;       // bytes sent by this rank
  int64_t reduce_scatter = 0;
  int64_t allreduce = 0;
  int64_t calls = 0;
  int64_t total() const { return allgather + reduce_scatter + allreduce; }

  void add_allgather(int64_t total_bytes, int world);
  void add_reduce_scatter(int64_t total_bytes, int world);
  void add_allreduce(int64_t bytes, int world);
  CommStats operator-(const CommStats& before) const;
};

// /proc/self/io "wchar": bytes this process has written with write()/writev() (sockets and files), -1 if unknown.
int64_t process_bytes_written();

}  // namespace gradsync
