// defines: Transport, the engine that moves bytes for Collectives (collectives.h), and its two implementations:
// c10d's ProcessGroupGloo (TCP, torchrun-compatible) and Open MPI (shared memory within a host, any fabric MPI
// knows across hosts). A transport only sums and copies; scaling, checks, sequence numbers and error messages
// stay in Collectives so both backends declare the same semantics.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include "gradsync/runtime.h"

namespace gradsync {

// One operation in flight. wait() returns once it completed, or throws std::runtime_error (transport failure or
// the deadline passed); Collectives turns that into a DistributedError naming rank, operation and sequence number.
class TransportWork {
 public:
  virtual ~TransportWork() = default;
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // A traced operation (trace.h) asks when its bytes finished moving, which can be long before anyone waits.
  // Until watch_completion() is called nothing is timed; completed_ns() is then the Tracer::now_ns() of the end,
  // or 0 where the transport cannot tell (the wait's end is used instead).
  virtual void watch_completion() {}
  int64_t completed_ns() const { return completed_ns_->load(); }

 protected:
  // Shared, so a transport's callback may outlive the work that asked for it.
  std::shared_ptr<std::atomic<int64_t>> completed_ns_ = std::make_shared<std::atomic<int64_t>>(0);
};

// Every operation starts at once and is finished by the returned work's wait(). Operations are issued in the
// same order on every rank. Tensors are contiguous (checked by Collectives) and stay alive until the work is done.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual Backend backend() const = 0;
  virtual std::shared_ptr<TransportWork> allreduce_sum(torch::Tensor tensor) = 0;
  virtual std::shared_ptr<TransportWork> broadcast(torch::Tensor tensor, int root) = 0;
  // output[r*n : (r+1)*n] = input of rank r; output has size()*input.numel() elements.
  virtual std::shared_ptr<TransportWork> allgather(torch::Tensor input, torch::Tensor output) = 0;
  // output (n elements) on rank r = sum over ranks of input[r*n : (r+1)*n].
  virtual std::shared_ptr<TransportWork> reduce_scatter_sum(torch::Tensor input, torch::Tensor output) = 0;
  virtual std::shared_ptr<TransportWork> barrier() = 0;
  // A transport over `members` (ranks of this one, in the new group's order), of which this rank is
  // members[index]; every member calls it with the same members and `id` (unique per split and color), and the
  // ranks of other colors call it for their own groups at the same time. Returns once the group is connected.
  virtual std::shared_ptr<Transport> split(const std::vector<int>& members, int index, const std::string& id,
                                           int color, int key, std::chrono::milliseconds timeout) = 0;
  // Collective (same numel and dtype on every rank, in the same order): zeros to pass to allreduce_sum() again and
  // again, as DDP's buckets. MPI with every rank on one host places them in shared memory (shared_segment.h), where
  // allreduce_sum() of them, or of a part at the same offset on every rank, sums in place. Plain memory elsewhere.
  virtual torch::Tensor reduction_buffer(int64_t numel, c10::ScalarType dtype, std::chrono::milliseconds timeout) {
    return torch::zeros({numel}, torch::TensorOptions().dtype(dtype));
  }
};

// c10d ProcessGroupGloo over `store` (the rendezvous has already been checked by the caller).
std::shared_ptr<Transport> make_gloo_transport(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                                               std::chrono::milliseconds timeout);

// Open MPI on a duplicate of MPI_COMM_WORLD; initialises MPI once per process. Throws ConfigError when MPI's
// rank or size disagree with `env` (a process not started by mpirun).
std::shared_ptr<Transport> make_mpi_transport(const LaunchEnv& env, std::chrono::milliseconds timeout);

// The MPI library's version line (MPI_Get_library_version: callable before MPI_Init), first line only.
std::string mpi_library_version();

}  // namespace gradsync
