// The two-rank allreduce on c10d's Gloo context (see gloo_group.h).
#include "runtime/gloo_group.h"

#include <algorithm>
#include <memory>
#include <vector>

#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

namespace gradsync {

// Note [Gloo headers]
// A libtorch 2.x carries its own, newer gloo inside libtorch_cpu.so but ships no gloo headers, so gradsync compiles
// against Debian's gloo headers (of 2022-05). Code compiled here may only rely on what both gloos lay out alike:
// - Context: its member functions (compiled inside libtorch), never its data members. Newer gloo dropped the
//   virtual destructor, so `rank` and `size` sit 8 bytes earlier than the old header says; the rank is the
//   group's (getRank()).
// - transport::UnboundBuffer: the virtual send/recv/waitSend/waitRecv, declared in the same order in both (newer
//   gloo appends put/get/getRemoteKey after them, so the slots in use are unchanged).
// - Slot::build: an inline computation, the same in both.
// The two-rank allreduce's tests (bit for bit the ring's result, on every run of the suite) are what establish it.
//
// Note [The two-rank allreduce]
// Each rank owns half of the buffer, as in Gloo's ring. Both ranks send the peer's half at once, in segments; as
// each segment of its own half arrives, a rank adds it and sends the sum straight back. The connection is busy
// in both directions from the first byte to the last, and the sums need no step of their own after the
// reduction. On this machine's loopback TCP (docs/performance.md) 16 MiB took 13-16 ms against Gloo's ring's 15-19
// ms on the same bytes (interleaved), and a bare exchange of 16 MiB each way 12 ms.
//
// Bit for bit the ring's result: at two ranks every element is the sum of the two ranks' values, and a + b ==
// b + a in IEEE arithmetic, whichever side adds. At more ranks the order of the additions depends on the ring's
// geometry, so those stay with Gloo's ring (PyTorch DDP's bits at any N).
namespace {

constexpr uint8_t kSlotPrefix = 0x47;  // Gloo's own algorithms use 0x01-0x08 (gloo/types.h)

// Segments of 2 MiB: at 16 MiB, 1 and 2 MiB measured alike and 4 MiB slower (docs/performance.md); smaller ones
// pay Gloo's per-message cost more often.
constexpr int64_t kSegmentBytes = 2 << 20;

// [begin, end) element ranges of `count` elements from `offset` in segments of at most `step`.
std::vector<std::pair<int64_t, int64_t>> segments(int64_t offset, int64_t count, int64_t step) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t at = 0; at < count; at += step) out.emplace_back(offset + at, offset + std::min(count, at + step));
  return out;
}

template <typename T>
void add_into(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// See Note [Gloo headers]: of gloo's classes this touches only what is the same in every gloo (UnboundBuffer's
// send/recv/wait, Context::createUnboundBuffer, Slot::build); the rank comes from the group, not the Context.
class PairAllreduce : public compat::GlooGroupWork {
 public:
  PairAllreduce(std::shared_ptr<::gloo::Context> context, at::Tensor tensor, int rank, uint32_t tag, uint64_t seq,
                std::chrono::milliseconds timeout)
      : GlooGroupWork(context, std::move(tensor), seq, timeout, "gradsync:pair_allreduce"),
        gloo_context_(std::move(context)),
        rank_(rank),
        tag_(tag) {}

  void run() override {
    const int me = rank_;
    const int peer = 1 - me;
    const int64_t n = tensor_.numel();
    const int64_t size = tensor_.element_size();
    const int64_t half = (n + 1) / 2;  // rank 0 owns [0, half), rank 1 [half, n)
    const int64_t own_begin = me == 0 ? 0 : half;
    const int64_t own_count = me == 0 ? half : n - half;
    const int64_t step = std::max<int64_t>(1, kSegmentBytes / size);
    const auto mine = segments(own_begin, own_count, step);
    const auto theirs = segments(half - own_begin, n - own_count, step);  // the other half
    const uint64_t contributions = ::gloo::Slot::build(kSlotPrefix, tag_);
    const uint64_t sums = contributions + 1;

    char* data = static_cast<char*>(tensor_.data_ptr());
    auto received = at::empty({std::max<int64_t>(own_count, 1)}, tensor_.options());
    const char* got = static_cast<const char*>(received.data_ptr());
    auto buffer = gloo_context_->createUnboundBuffer(data, static_cast<size_t>(n * size));
    auto incoming = gloo_context_->createUnboundBuffer(received.data_ptr(), static_cast<size_t>(received.nbytes()));

    // Every receive is posted before any send, so no message waits for its buffer.
    for (const auto& [b, e] : mine) incoming->recv(peer, contributions, (b - own_begin) * size, (e - b) * size);
    for (const auto& [b, e] : theirs) buffer->recv(peer, sums, b * size, (e - b) * size);
    for (const auto& [b, e] : theirs) buffer->send(peer, contributions, b * size, (e - b) * size);
    // One connection delivers in order: the k-th completed receive is segment k.
    for (const auto& [b, e] : mine) {
      incoming->waitRecv();
      add(data + b * size, got + (b - own_begin) * size, e - b);
      buffer->send(peer, sums, b * size, (e - b) * size);
    }
    for (size_t i = 0; i < theirs.size(); ++i) buffer->waitRecv();
    for (size_t i = 0; i < mine.size() + theirs.size(); ++i) buffer->waitSend();
  }

 private:
  void add(char* dst, const char* src, int64_t n) const {
    if (tensor_.scalar_type() == at::kDouble) {
      add_into(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(src), n);
    } else {
      add_into(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src), n);
    }
  }

  std::shared_ptr<::gloo::Context> gloo_context_;
  int rank_;
  uint32_t tag_;
};

}  // namespace

bool GlooGroup::pipelines(const at::Tensor& tensor) const {
  const auto dtype = tensor.scalar_type();
  return getSize() == 2 && (dtype == at::kFloat || dtype == at::kDouble) &&
         tensor.numel() * tensor.element_size() >= kPipelinedBytes;
}

c10::intrusive_ptr<c10d::Work> GlooGroup::allreduce_sum(at::Tensor tensor) {
  if (!pipelines(tensor)) {
    std::vector<at::Tensor> list{tensor};
    return allreduce(list, c10d::AllreduceOptions{});
  }
  const uint32_t tag = nextTag();
  auto work = c10::make_intrusive<PairAllreduce>(getContext(tag), std::move(tensor), getRank(), tag, next_seq(),
                                                 getOptions()->timeout);
  enqueue(work);
  return work;
}

}  // namespace gradsync
