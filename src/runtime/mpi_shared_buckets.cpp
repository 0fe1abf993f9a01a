// Shared-memory buckets on MPI (see mpi_shared_buckets.h).
#include "runtime/mpi_shared_buckets.h"

#include <array>
#include <atomic>
#include <string>
#include <system_error>

#include <unistd.h>

#include <fmt/format.h>

namespace gradsync {
namespace {

bool all_on_one_host(MPI_Comm comm, int size) {
  MPI_Comm host = MPI_COMM_NULL;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host) != MPI_SUCCESS) return false;
  int host_size = 0;
  MPI_Comm_size(host, &host_size);
  MPI_Comm_free(&host);
  return host_size == size;
}

bool all_ranks(MPI_Comm comm, bool mine) {
  int all = mine ? 1 : 0;
  return MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm) == MPI_SUCCESS && all == 1;
}

// Once per process: why a reduction buffer stays in plain memory (its allreduce is then Open MPI's, slower).
void warn_plain_buffer(int rank, size_t bytes, const std::string& why) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  fmt::print(stderr, "gradsync: warning: rank {}: a DDP bucket ({} bytes per rank) stays in plain memory and is "
             "summed by MPI_Allreduce, not in shared memory: {}\n", rank, bytes, why);
}

}  // namespace

bool shared_buckets_possible(MPI_Comm comm, int size, bool allowed) {
  const bool one_host = size > 1 && all_on_one_host(comm, size);  // the same on every rank
  return one_host && all_ranks(comm, allowed);
}

std::shared_ptr<SharedSegment> agree_on_segment(MPI_Comm comm, int rank, int size, size_t slot_bytes,
                                                const SubmitOperation& submit, std::chrono::milliseconds timeout) {
  auto name = std::make_shared<std::array<char, 64>>();  // shared with the operations: a wait may time out
  std::shared_ptr<SharedSegment> segment;
  std::string failure;  // why this rank could not take part
  struct UnlinkOnExit {  // rank 0's name must not outlive the agreement, whichever way it ends
    std::string name;
    ~UnlinkOnExit() { if (!name.empty()) SharedSegment::unlink(name); }
  } created;
  if (rank == 0) {
    static std::atomic<uint64_t> serial{0};  // per process: two Worlds' segments must not share a name
    const auto chosen = fmt::format("/gradsync-{}-{}", getpid(), ++serial);
    try {
      segment = SharedSegment::create(chosen, slot_bytes, size);
      created.name = chosen;
      chosen.copy(name->data(), name->size() - 1);
    } catch (const std::system_error& e) {
      failure = e.what();
    }
  }
  submit([comm, name] { return MPI_Bcast(name->data(), 64, MPI_CHAR, 0, comm); })->wait(timeout);
  if (rank != 0 && (*name)[0]) {
    try {
      segment = SharedSegment::open(name->data(), slot_bytes, size);
    } catch (const std::system_error& e) {
      failure = e.what();
    }
  }
  auto all_mapped = std::make_shared<int>(segment ? 1 : 0);
  submit([comm, all_mapped] {
    return MPI_Allreduce(MPI_IN_PLACE, all_mapped.get(), 1, MPI_INT, MPI_MIN, comm);
  })->wait(timeout);
  if (!failure.empty()) warn_plain_buffer(rank, slot_bytes, failure);
  return *all_mapped ? segment : nullptr;
}

// Every rank's slot is written before any rank reads it (the first barrier), and every share is summed before any
// rank goes on to use or refill its slot (the second). The fences order the plain loads and stores against the
// barriers' own synchronisation.
int sum_in_place(MPI_Comm comm, const SharedSegment& segment, size_t offset, int64_t count,
                 SharedSegment::Element element, int rank) {
  if (const int code = MPI_Barrier(comm); code != MPI_SUCCESS) return code;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  segment.sum_share(offset, count, element, rank);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return MPI_Barrier(comm);
}

}  // namespace gradsync
