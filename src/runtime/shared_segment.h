// defines: SharedSegment, memory that every rank of one host maps (POSIX shared memory), cut into one slot per rank,
// and its in-place allreduce, sum_share(). The MPI transport puts DDP's buckets there (Transport::reduction_buffer):
// a bucket's elements are then summed where backward's scaled copy wrote them, each rank summing its share of every
// slot and writing the sum into all of them, instead of going through Open MPI's own shared-memory buffers (two
// copies more; measured in docs/performance.md, "DDP buckets in shared memory").
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace gradsync {

class SharedSegment {
 public:
  enum class Element { Float32, Float64 };  // what sum_share() adds

  // A new segment `name` ("/gradsync-..."), slots x slot_bytes, zero-filled, its memory reserved now: a /dev/shm
  // too small fails here (std::system_error) rather than with SIGBUS at the first write, and so does a segment
  // that would take more than half of the space free there.
  static std::shared_ptr<SharedSegment> create(const std::string& name, size_t slot_bytes, int slots);
  // Maps the segment another rank created; std::system_error when it is missing or smaller than expected.
  static std::shared_ptr<SharedSegment> open(const std::string& name, size_t slot_bytes, int slots);
  // Removes the name once every rank has mapped it: the memory then lives as long as some rank maps it, and a rank
  // that crashes leaves nothing behind in /dev/shm.
  static void unlink(const std::string& name);

  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  void* slot(int rank) const { return base_ + static_cast<size_t>(rank) * slot_bytes_; }
  size_t slot_bytes() const { return slot_bytes_; }
  int slots() const { return slots_; }
  // Whether [data, data + bytes) lies inside slot `rank`.
  bool holds(const void* data, size_t bytes, int rank) const;

  // Sums `count` elements starting `offset` bytes into each slot, over all slots in rank order, and writes the sum
  // into every slot: this rank adds its share (the rank-th of `slots()` contiguous parts, cut at cache lines). Once
  // every rank has returned from it, every slot holds the whole sum. The caller keeps the ranks in step around it
  // (a barrier before: every slot written; and after: every share summed).
  void sum_share(size_t offset, int64_t count, Element element, int rank) const;

 private:
  SharedSegment(char* base, size_t slot_bytes, int slots) : base_(base), slot_bytes_(slot_bytes), slots_(slots) {}
  static std::shared_ptr<SharedSegment> map(int fd, size_t slot_bytes, int slots);

  char* base_;
  size_t slot_bytes_;
  int slots_;
};

// The segments a transport handed out whose buffers may still be alive, found again by address (an allreduce is
// given a tensor, not a segment). Thread-safe.
class SegmentRegistry {
 public:
  struct Found {
    std::shared_ptr<SharedSegment> segment;
    size_t offset;  // bytes into each rank's slot
  };
  void add(const std::shared_ptr<SharedSegment>& segment);
  // The live segment whose slot `rank` holds all of [data, data + bytes), if any.
  std::optional<Found> find(const void* data, size_t bytes, int rank);

 private:
  std::mutex mutex_;
  std::vector<std::weak_ptr<SharedSegment>> segments_;
};

}  // namespace gradsync
