// The MPI transport (transport.h) on Open MPI. Every operation runs as a *blocking* MPI call on one worker
// thread per transport, in submission order:
//  - blocking collectives are Open MPI's fastest (measured here, 16.8 MB between 2 ranks: MPI_Allreduce 2.5 ms,
//    MPI_Iallreduce driven by MPI_Test 5.2 ms), and where the worker has a core of its own it runs them while
//    backward goes on, so DDP's buckets and FSDP's reduce-scatters and prefetches overlap compute without hooks
//    polling MPI (when an operation starts: starts_eagerly());
//  - waiting on a condition variable gives every wait a deadline, which MPI itself has no notion of. A rank
//    whose wait times out throws (naming rank, operation and sequence number, see Collectives) and leaves MPI
//    unfinalised; mpirun then stops the whole job, so no rank hangs on after its timeout.
// With every rank on one host, DDP's buckets (reduction_buffer()) are slots of a shared segment (shared_segment.h),
// and their allreduce is two barriers around an in-place sum on the same worker, in the same order (16 MiB between
// 2 ranks: 1.1-1.3 ms, against 6.0-6.3 ms for MPI_Allreduce on that machine, docs/performance.md).
#define OMPI_SKIP_MPICXX 1  // the C API only: the deprecated C++ bindings need libmpi_cxx
#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "gradsync/error.h"
#include "gradsync/trace.h"
#include "runtime/mpi_shared_buckets.h"
#include "runtime/shared_segment.h"
#include "runtime/transport.h"

namespace gradsync {
namespace {

// ---- one MPI per process ------------------------------------------------------------------------

std::atomic<bool>& mpi_failed() {
  static std::atomic<bool> failed{false};  // a timed-out or failed operation may still be inside MPI: never finalise
  return failed;
}

void finalize_mpi_at_exit() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && !mpi_failed()) MPI_Finalize();
}

void ensure_mpi_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  // Open MPI's shared-memory transport moves large messages between ranks of a host with process_vm_readv, which
  // pins the pages at every call; copying through its shared segment instead measured 1.5-2x faster here for
  // 1-25 MB allreduces (DDP's buckets: 16.8 MB in 2.0 against 3.1-4.4 ms), though slower beyond the cache (64 MB).
  // A setting of the user's in the environment (or mpirun --mca, which arrives there) wins; one in an
  // mca-params.conf file does not, since the environment outranks the file.
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", /*overwrite=*/0);
  int provided = 0;
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    throw DistributedError("MPI_Init_thread failed (is this process started by mpirun?)");
  }
  // The transport's worker thread makes the MPI calls; other threads call MPI only when one fails (MPI_Error_string)
  // or a new transport starts, and then a worker detached after a failure may still be inside MPI. Open MPI grants
  // MULTIPLE, which covers that; SERIALIZED is the least the ordinary path needs.
  if (provided < MPI_THREAD_SERIALIZED) {
    throw DistributedError(fmt::format("MPI granted thread level {}; gradsync needs MPI_THREAD_SERIALIZED", provided));
  }
  std::atexit(finalize_mpi_at_exit);
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

// ---- dtypes -------------------------------------------------------------------------------------

// float16 and bfloat16 have no MPI sum: 2-byte words with a sum computed in float32 per pair, as Gloo does.
template <typename T>
void sum_16bit(void* in, void* inout, int* count, MPI_Datatype*) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *count; ++i) b[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

struct WireType {
  MPI_Datatype type;
  MPI_Op sum;
};

WireType wire_type(c10::ScalarType dtype) {
  static MPI_Op half_sum = [] { MPI_Op op; MPI_Op_create(&sum_16bit<c10::Half>, 1, &op); return op; }();
  static MPI_Op bf16_sum = [] { MPI_Op op; MPI_Op_create(&sum_16bit<c10::BFloat16>, 1, &op); return op; }();
  switch (dtype) {
    case torch::kFloat: return {MPI_FLOAT, MPI_SUM};
    case torch::kDouble: return {MPI_DOUBLE, MPI_SUM};
    case torch::kLong: return {MPI_INT64_T, MPI_SUM};
    case torch::kInt: return {MPI_INT32_T, MPI_SUM};
    case torch::kByte: return {MPI_UINT8_T, MPI_SUM};
    case torch::kChar: return {MPI_INT8_T, MPI_SUM};
    case torch::kHalf: return {MPI_UINT16_T, half_sum};
    case torch::kBFloat16: return {MPI_UINT16_T, bf16_sum};
    default:
      throw ConfigError(fmt::format("the MPI backend cannot reduce {} tensors; allowed: float32, float64, "
                                    "float16, bfloat16, int8/32/64, uint8", c10::toString(dtype)));
  }
}

// What a shared-memory bucket can sum in place; float32 and float64 only (DDP's gradients), the rest go to MPI.
std::optional<SharedSegment::Element> shared_element(c10::ScalarType dtype) {
  if (dtype == torch::kFloat) return SharedSegment::Element::Float32;
  if (dtype == torch::kDouble) return SharedSegment::Element::Float64;
  return std::nullopt;
}

int count_of(const torch::Tensor& t) {
  if (t.numel() > std::numeric_limits<int>::max()) {
    throw ConfigError(fmt::format("the MPI backend sends at most {} elements per operation; got {}",
                                  std::numeric_limits<int>::max(), t.numel()));
  }
  return static_cast<int>(t.numel());
}

// ---- work and the worker ------------------------------------------------------------------------

// Small operations take microseconds, as long as waking a sleeping thread: the waiter and the worker first poll for
// this long (yielding) before they sleep. Measured here, a 4 KiB allreduce between 2 ranks: 9 us with sleeping
// threads against 1 us for MPI_Allreduce itself.
constexpr auto kSpin = std::chrono::microseconds(50);

template <typename Ready>
bool spin_until(Ready&& ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (std::chrono::steady_clock::now() < until) {
    if (ready()) return true;
    std::this_thread::yield();
  }
  return ready();
}

class MpiWork : public TransportWork {
 public:
  MpiWork(std::function<int()> run, std::function<void()> on_wait) : run_(std::move(run)), on_wait_(std::move(on_wait)) {}

  void execute() {
    const int code = run_();
    run_ = nullptr;  // releases the tensors as soon as the bytes have moved
    completed_ns_->store(Tracer::now_ns());  // one clock read: cheaper than asking whether anyone traces
    std::lock_guard<std::mutex> lock(mutex_);
    code_ = code;
    done_ = true;
    done_cv_.notify_all();
  }

  void wait(std::chrono::milliseconds timeout) override {
    if (on_wait_) on_wait_();
    spin_until([&] { return done_.load(); });
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_cv_.wait_for(lock, timeout, [&] { return done_.load(); })) {
      mpi_failed() = true;
      throw std::runtime_error(fmt::format("MPI operation not finished after the {} ms timeout", timeout.count()));
    }
    if (code_ != MPI_SUCCESS) {
      mpi_failed() = true;
      throw std::runtime_error(mpi_error(code_));
    }
  }

 private:
  std::function<int()> run_;
  std::function<void()> on_wait_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  std::atomic<bool> done_{false};  // set under mutex_ (for the condition variable), read without it by spin_until
  int code_ = MPI_SUCCESS;
};

// The operations of one transport, in submission order, and the worker thread's loop over them. Shared by the
// transport, its works and its worker thread, since the worker can outlive the transport: when the transport is
// destroyed after a failure (an exception unwinding, or an operation that timed out) the worker is detached rather
// than joined, as it may be stuck in MPI for good, and must find its queue still there when it wakes.
class WorkQueue : public std::enable_shared_from_this<WorkQueue> {
 public:
  explicit WorkQueue(bool eager) : eager_(eager) {}

  std::shared_ptr<MpiWork> submit(std::function<int()> run) {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t seq = ++submitted_;
    auto work = std::make_shared<MpiWork>(std::move(run), [queue = weak_from_this(), seq] {
      if (auto q = queue.lock()) q->release(seq);
    });
    queue_.push_back(work);
    if (eager_) release_locked(seq);
    return work;
  }

  // The worker thread's loop: runs released operations in order until stop() and nothing released is left.
  void run() {
    for (;;) {
      spin_until([&] { return runnable_.load(); });
      std::shared_ptr<MpiWork> work;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queue_cv_.wait(lock, [&] { return stopping_ || started_ < released_; });
        if (started_ == released_) return;  // stopping, nothing released
        work = std::move(queue_.front());
        queue_.pop_front();
        ++started_;
        runnable_ = started_ < released_;
      }
      work->execute();
    }
  }

  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    queue_cv_.notify_all();
  }

 private:
  // Lets the worker run operations up to `seq`: a wait needs its own operation and every earlier one, no more.
  void release(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    release_locked(seq);
  }
  void release_locked(uint64_t seq) {
    released_ = std::max(released_, seq);
    runnable_ = started_ < released_;
    queue_cv_.notify_one();
  }

  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<MpiWork>> queue_;
  uint64_t submitted_ = 0;  // operations numbered 1, 2, ... in submission order
  uint64_t released_ = 0;   // operations up to this number may run
  uint64_t started_ = 0;    // operations the worker has taken
  std::atomic<bool> runnable_{false};  // started_ < released_, readable without the lock (spin_until)
  bool stopping_ = false;
  bool eager_;
};

// The one worker thread of a process, shared by the transports of the world and of its sub-groups (split()): every
// MPI call of the process runs on it, in submission order, so the ranks' programs alone order the operations of
// different groups. Joined when the last transport goes, or detached after a failure (see mpi_failed).
class MpiWorker {
 public:
  explicit MpiWorker(bool eager) : queue_(std::make_shared<WorkQueue>(eager)) {
    thread_ = std::thread([queue = queue_] { queue->run(); });
  }
  ~MpiWorker() {
    queue_->stop();
    // An operation stuck in MPI (a peer died) cannot be joined; MPI is then never finalised (see mpi_failed).
    if (mpi_failed() || std::uncaught_exceptions() > 0) {
      mpi_failed() = true;
      thread_.detach();
      return;
    }
    thread_.join();
  }
  std::shared_ptr<MpiWork> submit(std::function<int()> run) { return queue_->submit(std::move(run)); }

 private:
  std::shared_ptr<WorkQueue> queue_;
  std::thread thread_;
};

// The operations capture the communicator by value, never the transport: a detached worker may still run them.
class MpiTransport : public Transport {
 public:
  // Takes `comm` over (freed with the transport). Collective over it: whether its buckets can be shared.
  MpiTransport(std::shared_ptr<MpiWorker> worker, MPI_Comm comm, bool shared_allowed,
               std::chrono::milliseconds timeout)
      : worker_(std::move(worker)), comm_(comm), shared_allowed_(shared_allowed) {
    submit([this] {
      MPI_Comm_size(comm_, &size_);
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors become exceptions, not an abort
      shared_buckets_ = shared_buckets_possible(comm_, size_, shared_allowed_);
      return MPI_SUCCESS;
    })->wait(timeout);
  }

  ~MpiTransport() override {
    if (mpi_failed() || std::uncaught_exceptions() > 0) return;  // the worker may still use comm_: leaked
    // On the worker, after every operation of this group: none may run on a freed communicator.
    try {
      submit([comm = comm_]() mutable { return MPI_Comm_free(&comm); })->wait(std::chrono::minutes(1));
    } catch (const std::exception&) {
      // mpi_failed is set: MPI is never finalised, the process is going down with an error of its own
    }
  }

  // MPI_Comm_split on the worker, in order with this group's other operations; a group inside one host keeps the
  // shared-memory buckets.
  std::shared_ptr<Transport> split(const std::vector<int>& /*members*/, int /*index*/, const std::string& /*id*/,
                                   int color, int key, std::chrono::milliseconds timeout) override {
    auto sub = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    submit([comm = comm_, color, key, sub] { return MPI_Comm_split(comm, color, key, sub.get()); })->wait(timeout);
    return std::make_shared<MpiTransport>(worker_, *sub, shared_allowed_, timeout);
  }

  Backend backend() const override { return Backend::Mpi; }

  std::shared_ptr<TransportWork> allreduce_sum(torch::Tensor t) override {
    const auto element = shared_element(t.scalar_type());
    if (auto in = element ? segments_.find(t.data_ptr(), t.numel() * t.element_size(), rank_) : std::nullopt) {
      return submit([comm = comm_, t, in = *in, element = *element, rank = rank_] {
        return sum_in_place(comm, *in.segment, in.offset, t.numel(), element, rank);
      });
    }
    auto wire = wire_type(t.scalar_type());
    return submit([comm = comm_, t, wire, n = count_of(t)] {
      return MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), n, wire.type, wire.sum, comm);
    });
  }

  std::shared_ptr<TransportWork> broadcast(torch::Tensor t, int root) override {
    return submit([comm = comm_, t, root, bytes = byte_count(t)] {
      return MPI_Bcast(t.data_ptr(), bytes, MPI_BYTE, root, comm);
    });
  }

  std::shared_ptr<TransportWork> allgather(torch::Tensor in, torch::Tensor out) override {
    return submit([comm = comm_, in, out, bytes = byte_count(in)] {
      return MPI_Allgather(in.data_ptr(), bytes, MPI_BYTE, out.data_ptr(), bytes, MPI_BYTE, comm);
    });
  }

  std::shared_ptr<TransportWork> reduce_scatter_sum(torch::Tensor in, torch::Tensor out) override {
    auto wire = wire_type(in.scalar_type());
    // MPI_Reduce_scatter with equal counts, not MPI_Reduce_scatter_block: Open MPI 4.1 runs the block variant as
    // a reduce then a scatter (16.8 MB between 2 ranks: 12.2 ms, against 2.6 ms for MPI_Reduce_scatter).
    return submit([comm = comm_, in, out, wire, counts = std::vector<int>(static_cast<size_t>(size_), count_of(out))] {
      return MPI_Reduce_scatter(in.data_ptr(), out.data_ptr(), counts.data(), wire.type, wire.sum, comm);
    });
  }

  std::shared_ptr<TransportWork> barrier() override {
    return submit([comm = comm_] { return MPI_Barrier(comm); });
  }

  // A slot of a new shared segment when every rank could map one (GRADSYNC_MPI_SHARED_BUCKETS=off on any rank:
  // never), else plain memory on every rank. The tensor keeps its segment mapped; the segment is found again by address.
  torch::Tensor reduction_buffer(int64_t numel, c10::ScalarType dtype, std::chrono::milliseconds timeout) override {
    if (!shared_buckets_ || numel == 0 || !shared_element(dtype)) {
      return Transport::reduction_buffer(numel, dtype, timeout);
    }
    constexpr size_t kPage = 4096;
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    auto segment = agree_on_segment(comm_, rank_, size_, (bytes + kPage - 1) / kPage * kPage,
                                    [this](std::function<int()> run) { return submit(std::move(run)); }, timeout);
    if (!segment) return Transport::reduction_buffer(numel, dtype, timeout);
    segments_.add(segment);
    return torch::from_blob(segment->slot(rank_), {numel}, [segment](void*) {}, torch::TensorOptions().dtype(dtype));
  }

 private:
  static int byte_count(const torch::Tensor& t) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (bytes > std::numeric_limits<int>::max()) {
      throw ConfigError(fmt::format("the MPI backend copies at most {} bytes per operation; got {}",
                                    std::numeric_limits<int>::max(), bytes));
    }
    return static_cast<int>(bytes);
  }

  std::shared_ptr<MpiWork> submit(std::function<int()> run) { return worker_->submit(std::move(run)); }

  std::shared_ptr<MpiWorker> worker_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int size_ = 0;
  int rank_ = 0;
  bool shared_allowed_ = true;   // GRADSYNC_MPI_SHARED_BUCKETS on this rank
  bool shared_buckets_ = false;  // every rank on this host and allowing it: buffers are agreed on, maybe shared
  SegmentRegistry segments_;  // the reduction buffers' segments, to find them again in allreduce_sum()
};

// Which of two values the environment variable `name` holds: true for `yes`, false for `no`, `fallback` when unset
// or empty; any other value is a ConfigError naming it.
bool env_switch(const char* name, const char* yes, const char* no, bool fallback) {
  const char* value = std::getenv(name);
  if (!value || !*value) return fallback;
  const std::string mode = value;
  if (mode != yes && mode != no) throw ConfigError(fmt::format("{}='{}'; expected {} or {}", name, mode, yes, no));
  return mode == yes;
}

// When an operation starts. Eagerly (at submission) its bytes move while the caller computes: right when the worker
// thread has a core of its own. On a host whose cores the ranks' compute threads already fill, the worker would
// take cycles from backward instead (measured here, 2 cores, 2 ranks x 1 thread: DDP 0.5 ms and FSDP 2-3 ms slower
// per step), so there an operation starts when someone waits for it, in submission order.
// GRADSYNC_MPI_PROGRESS=eager|on-wait overrides the rule.
bool starts_eagerly(const LaunchEnv& env) {
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return env_switch("GRADSYNC_MPI_PROGRESS", "eager", "on-wait",
                    cores > static_cast<long>(env.local_world_size) * at::get_num_threads());
}

}  // namespace

std::shared_ptr<Transport> make_mpi_transport(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  ensure_mpi_initialized();
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != env.rank || size != env.world_size) {
    throw ConfigError(fmt::format(
        "the MPI backend needs ranks started by mpirun (`gradsync launch --backend mpi`): MPI says rank {} of {}, "
        "the {} environment says rank {} of {}", rank, size, env.source, env.rank, env.world_size));
  }
  // GRADSYNC_MPI_SHARED_BUCKETS=on|off: whether reduction buffers (DDP's buckets) may live in shared memory.
  const bool shared_buckets = env_switch("GRADSYNC_MPI_SHARED_BUCKETS", "on", "off", true);
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return std::make_shared<MpiTransport>(std::make_shared<MpiWorker>(starts_eagerly(env)), comm, shared_buckets,
                                        timeout);
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string line(text, static_cast<size_t>(std::max(length, 0)));
  const auto end = line.find_first_of(",\n");
  return end == std::string::npos ? line : line.substr(0, end);
}

}  // namespace gradsync
