// defines: the MPI transport's buckets in shared memory (mpi_transport.cpp; the memory and the sum itself are in
// shared_segment.h): whether a job can have them, how the ranks agree on each one, and its allreduce. Private, and
// with mpi_transport.cpp the only file that includes mpi.h in the library.
#pragma once
#define OMPI_SKIP_MPICXX 1  // the C API only: the deprecated C++ bindings need libmpi_cxx
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "runtime/shared_segment.h"
#include "runtime/transport.h"

namespace gradsync {

// Collective: every rank of `comm` runs on this host (MPI's shared-memory split) and every rank `allowed` it
// (GRADSYNC_MPI_SHARED_BUCKETS may differ between ranks; ranks that disagreed would make different calls).
bool shared_buckets_possible(MPI_Comm comm, int size, bool allowed);

// Runs an operation on the transport's worker, in order with its other operations.
using SubmitOperation = std::function<std::shared_ptr<TransportWork>(std::function<int()>)>;

// Collective: rank 0 creates a segment of `size` slots and broadcasts its name, the others map it, and all agree
// whether every rank could; then rank 0 removes the name, so the memory lives only while mapped. nullptr on every
// rank when some rank could not (no room in /dev/shm), after a warning (once per process) on that rank.
std::shared_ptr<SharedSegment> agree_on_segment(MPI_Comm comm, int rank, int size, size_t slot_bytes,
                                                const SubmitOperation& submit, std::chrono::milliseconds timeout);

// The allreduce of a bucket in shared memory, run on the worker: `count` elements `offset` bytes into every slot.
int sum_in_place(MPI_Comm comm, const SharedSegment& segment, size_t offset, int64_t count,
                 SharedSegment::Element element, int rank);

}  // namespace gradsync
