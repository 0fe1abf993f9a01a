// defines: Collectives, the typed layer between gradsync and its transport (c10d Gloo or Open MPI, see
// Backend in runtime.h). Every reduction states its semantics (Reduction::Sum or Reduction::Mean), every wait has
// the job's timeout, and every failure names the rank, the backend, the operation and its sequence number.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/reduction.h"
#include "gradsync/trace.h"

namespace gradsync {

// Which engine moves the bytes. Gloo: c10d's ProcessGroupGloo over TCP, rendezvous through a c10d store
// (torchrun, `gradsync launch`). Mpi: Open MPI (shared memory within a host), ranks started by mpirun. Both give
// the same results bit for bit on the operations below except where a sum's order differs (see docs/semantics.md).
enum class Backend { Gloo, Mpi };
const char* to_string(Backend backend);  // "gloo" / "mpi"

class Transport;      // src/runtime/transport.h: Gloo or MPI
class TransportWork;

// An operation in flight. wait() rethrows a transport failure, or the deadline passing, as DistributedError
// naming rank and operation.
class PendingWork {
 public:
  PendingWork() = default;
  PendingWork(std::shared_ptr<TransportWork> work, std::string what, std::chrono::milliseconds timeout);
  // Traced (trace.h): wait() records the collective from launch to completion and the wait itself.
  PendingWork(std::shared_ptr<TransportWork> work, std::string what, std::chrono::milliseconds timeout,
              std::shared_ptr<Tracer> tracer, TraceEvent launched);
  bool valid() const { return static_cast<bool>(work_); }
  // Waits, then runs the continuation given to then() (a communication hook's decompression), once.
  void wait();
  // `fn` runs after the operation completes, inside wait(). Returns the same work.
  PendingWork then(std::function<void()> fn) &&;

 private:
  std::shared_ptr<TransportWork> work_;
  std::function<void()> then_;
  std::string what_;  // "rank 1 of 4: allreduce #12 (sum, 262144 x float) on gloo" for error messages
  std::chrono::milliseconds timeout_{0};
  void record_trace(const TransportWork& work, int64_t waited);
  std::shared_ptr<Tracer> tracer_;  // null unless traced
  TraceEvent launched_;
};

class Collectives {
 public:
  Collectives(std::shared_ptr<Transport> transport, int rank, int size, std::chrono::milliseconds timeout);
  // A sub-group: `world_ranks[rank]` is this process's world rank.
  Collectives(std::shared_ptr<Transport> transport, int rank, std::vector<int> world_ranks, std::string group,
              std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int size() const { return size_; }
  Backend backend() const;
  // The world rank of each rank of this group, in group order (the world itself: 0..size-1).
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  // Collective over this group (PyTorch's new_group, MPI_Comm_split): the ranks passing the same `color` form one
  // new group, numbered by `key` then by their rank here. `name` ("shard", "replica") goes into the group's error
  // messages, which name world ranks. Gloo: a ProcessGroupGloo of the members on the job's store; MPI: a split of
  // this communicator (a group inside one host keeps the shared-memory path). Operations on different groups may
  // be in flight at once; each group orders its own.
  std::shared_ptr<Collectives> split(int color, int key, const std::string& name);

  // In place. Mean multiplies by 1/N before a SUM allreduce (see Note [Where the division happens]).
  void allreduce(torch::Tensor& tensor, Reduction reduction);
  // SUM allreduce started now, finished by PendingWork::wait(); the caller has already applied any scaling.
  PendingWork allreduce_sum_async(torch::Tensor& tensor);
  // Collective: `numel` zeros of `dtype` to allreduce again and again (DDP's buckets). On MPI with every rank on
  // one host they live in shared memory, where the allreduce sums them in place (docs/performance.md); any tensor
  // works with allreduce, these may just be faster. Every rank calls it with the same numel and dtype.
  torch::Tensor reduction_buffer(int64_t numel, c10::ScalarType dtype);
  void broadcast(torch::Tensor& tensor, int root);
  // Broadcasts a list of tensors from root, coalesced into one flat buffer per dtype.
  void broadcast_coalesced(const std::vector<torch::Tensor>& tensors, int root);
  // output[r*n : (r+1)*n] = input of rank r, where n = input.numel(). output.numel() must be size()*n.
  void allgather_flat(const torch::Tensor& input, torch::Tensor& output);
  PendingWork allgather_flat_async(const torch::Tensor& input, torch::Tensor& output);  // done at wait()
  // output (n elements) on rank r = reduction over ranks of input[r*n : (r+1)*n]; input.numel() = size()*n.
  // MPI: MPI_Reduce_scatter (equal counts). Gloo 1.13 has none: alltoall_base then a local sum moves the same bytes.
  void reduce_scatter(const torch::Tensor& input, torch::Tensor& output, Reduction reduction);
  // The same, finished (output written) by PendingWork::wait(); input must not change until then.
  PendingWork reduce_scatter_async(const torch::Tensor& input, torch::Tensor& output, Reduction reduction);
  // Collectives of this group and of the groups split() makes afterwards report to `tracer` (null: none, the
  // default). Set it before constructing an engine, whose groups are split then.
  void set_tracer(std::shared_ptr<Tracer> tracer) { tracer_ = std::move(tracer); }
  Tracer* tracer() const { return tracer_.get(); }

  // Every rank's string, in rank order (used for cross-rank consistency checks).
  std::vector<std::string> allgather_strings(const std::string& mine);
  void barrier();

 private:
  std::string describe(const char* op, const torch::Tensor* tensor, const char* detail = nullptr);
  void check_contiguous(const torch::Tensor& t, const char* op) const;
  void reject_global_mean(Reduction reduction, const char* op) const;
  void run(std::shared_ptr<TransportWork> work, std::string what, const char* op, int64_t bytes, int64_t sent);
  // The work, traced when a tracer is set: `op` as the trace names it, `bytes` of the tensor, `sent` by this rank.
  PendingWork pending(std::shared_ptr<TransportWork> work, std::string what, const char* op, int64_t bytes,
                      int64_t sent, bool reduces);

  std::shared_ptr<Transport> transport_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::vector<int> world_ranks_;
  std::string group_;      // "" for the world; the name given to split() otherwise
  uint64_t sequence_ = 0;  // counts operations so an error can say which one failed
  uint64_t splits_ = 0;    // counts split() calls: keeps the store keys of each split's groups apart
  std::shared_ptr<Tracer> tracer_;
  // When tracing, the clock just before the transport was handed the operation being described.
  void mark_launch() {
    if (tracer_) launched_ns_ = Tracer::now_ns();
  }
  int64_t launched_ns_ = 0;
};

}  // namespace gradsync
