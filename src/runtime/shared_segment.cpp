// Shared slots and their in-place sum (see shared_segment.h).
#include "runtime/shared_segment.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace gradsync {
namespace {

[[noreturn]] void fail(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

// /dev/shm serves others too (Open MPI's own segments, other programs' shared tensors): a segment takes at most half
// of what is free there.
void check_room(size_t bytes) {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) return;  // shm_open and posix_fallocate decide
  const auto free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (bytes > free_bytes / 2) {
    fail(ENOSPC, std::to_string(bytes) + " bytes asked of /dev/shm, " + std::to_string(free_bytes) +
                     " free; a segment takes at most half");
  }
}

class Fd {  // closes on every path; the mapping outlives it
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { if (fd_ >= 0) ::close(fd_); }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Elements summed at a time in a buffer that stays in L1, then written to every slot: each slot's share is read
// once and written once.
constexpr int64_t kBlock = 2048;

template <typename T>
void add_into(T* __restrict sum, const T* __restrict source, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] += source[i];
}

// Two ranks: each element read once from each slot and the sum written straight back to both.
template <typename T>
void sum_pair(T* __restrict a, T* __restrict b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const T sum = a[i] + b[i];
    a[i] = sum;
    b[i] = sum;
  }
}

template <typename T>
void sum_range(const std::vector<T*>& slots, int64_t begin, int64_t end) {
  if (slots.size() == 2) return sum_pair(slots[0], slots[1], begin, end);
  T sum[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    const size_t bytes = static_cast<size_t>(n) * sizeof(T);
    std::memcpy(sum, slots[0] + b, bytes);
    for (size_t k = 1; k < slots.size(); ++k) add_into(sum, slots[k] + b, n);  // rank order: the same bits everywhere
    for (T* slot : slots) std::memcpy(slot + b, sum, bytes);
  }
}

template <typename T>
void sum_share_of(const SharedSegment& segment, size_t offset, int64_t count, int rank) {
  const int n = segment.slots();
  // Shares are cut at multiples of a cache line from `offset`: when that is aligned too (a whole bucket is, at the
  // start of its slot), no line is written by two ranks.
  constexpr int64_t kLine = 64 / sizeof(T);
  const int64_t share = (count + n - 1) / n;
  const int64_t per_rank = (share + kLine - 1) / kLine * kLine;
  const int64_t begin = std::min(count, per_rank * rank);
  const int64_t end = std::min(count, begin + per_rank);
  std::vector<T*> slots;
  for (int r = 0; r < n; ++r) slots.push_back(reinterpret_cast<T*>(static_cast<char*>(segment.slot(r)) + offset));
  sum_range(slots, begin, end);
}

}  // namespace

std::shared_ptr<SharedSegment> SharedSegment::map(int fd, size_t slot_bytes, int slots) {
  const size_t bytes = slot_bytes * static_cast<size_t>(slots);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) fail(errno, "mmap of a shared bucket segment");
  return std::shared_ptr<SharedSegment>(new SharedSegment(static_cast<char*>(base), slot_bytes, slots));
}

std::shared_ptr<SharedSegment> SharedSegment::create(const std::string& name, size_t slot_bytes, int slots) {
  check_room(slot_bytes * static_cast<size_t>(slots));
  Fd fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
  if (fd.get() < 0) fail(errno, "shm_open(" + name + ")");
  const off_t bytes = static_cast<off_t>(slot_bytes * static_cast<size_t>(slots));
  if (::ftruncate(fd.get(), bytes) != 0) {
    const int error = errno;
    ::shm_unlink(name.c_str());
    fail(error, "ftruncate(" + name + ")");
  }
  if (const int error = ::posix_fallocate(fd.get(), 0, bytes); error != 0) {
    ::shm_unlink(name.c_str());
    fail(error, "reserving " + std::to_string(bytes) + " bytes for " + name + " in /dev/shm");
  }
  try {
    return map(fd.get(), slot_bytes, slots);
  } catch (const std::system_error&) {
    ::shm_unlink(name.c_str());
    throw;
  }
}

std::shared_ptr<SharedSegment> SharedSegment::open(const std::string& name, size_t slot_bytes, int slots) {
  Fd fd(::shm_open(name.c_str(), O_RDWR, 0));
  if (fd.get() < 0) fail(errno, "shm_open(" + name + ")");
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(errno, "fstat(" + name + ")");
  if (static_cast<size_t>(st.st_size) < slot_bytes * static_cast<size_t>(slots)) fail(EINVAL, name + " is too small");
  return map(fd.get(), slot_bytes, slots);
}

void SharedSegment::unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

SharedSegment::~SharedSegment() { ::munmap(base_, slot_bytes_ * static_cast<size_t>(slots_)); }

bool SharedSegment::holds(const void* data, size_t bytes, int rank) const {
  const auto* begin = static_cast<const char*>(slot(rank));
  const auto* p = static_cast<const char*>(data);
  return p >= begin && p + bytes <= begin + slot_bytes_;
}

void SharedSegment::sum_share(size_t offset, int64_t count, Element element, int rank) const {
  if (element == Element::Float32) {
    sum_share_of<float>(*this, offset, count, rank);
  } else {
    sum_share_of<double>(*this, offset, count, rank);
  }
}

void SegmentRegistry::add(const std::shared_ptr<SharedSegment>& segment) {
  std::lock_guard<std::mutex> lock(mutex_);
  segments_.push_back(segment);
}

std::optional<SegmentRegistry::Found> SegmentRegistry::find(const void* data, size_t bytes, int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<Found> found;
  auto gone = [&](const std::weak_ptr<SharedSegment>& weak) {
    auto segment = weak.lock();
    if (!segment) return true;  // every buffer of it was released
    if (!found && segment->holds(data, bytes, rank)) {
      found = Found{segment, static_cast<size_t>(static_cast<const char*>(data) -
                                                 static_cast<const char*>(segment->slot(rank)))};
    }
    return false;
  };
  segments_.erase(std::remove_if(segments_.begin(), segments_.end(), gone), segments_.end());
  return found;
}

}  // namespace gradsync
