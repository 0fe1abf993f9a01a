// Typed collectives over a transport (see collectives.h): checks, scaling and error messages, once for both
// backends; the bytes move in src/runtime/{gloo,mpi}_transport.cpp.
#include "gradsync/collectives.h"

#include <utility>

#include <algorithm>
#include <cstring>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/ring_bytes.h"
#include "gradsync/error.h"
#include "runtime/peers.h"
#include "runtime/transport.h"

namespace gradsync {

const char* to_string(Backend backend) { return backend == Backend::Mpi ? "mpi" : "gloo"; }

namespace {

int64_t byte_size(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The label of a collective that scales by `factor` itself (a Mean): the caller's label, with the caller's factor
// times this one, so the trace shows every factor applied to what is sent. (A prvalue: C++17 elides the copy.)
TraceLabel scaled_label(Tracer* tracer, double factor) {
  const auto* outer = TraceLabel::current();
  return TraceLabel(tracer, outer ? outer->label() : "", (outer ? outer->factor() : 1.0) * factor);
}

// A transport's failure of the operation `what` as gradsync reports it. Transports name only addresses; this says
// which rank and which operation, and which peer is to blame when this host can tell (a stopped or vanished rank),
// or where to look.
DistributedError operation_failed(const std::string& what, const std::exception& e) {
  const auto stalled = describe_stalled_peers();
  return DistributedError(fmt::format("{} failed: {}{}", what, e.what(),
                                      stalled.empty() ? " (another rank exited, crashed or stalled; the launcher's "
                                                        "report names it)" : stalled));
}

}  // namespace

PendingWork::PendingWork(std::shared_ptr<TransportWork> work, std::string what, std::chrono::milliseconds timeout)
    : work_(std::move(work)), what_(std::move(what)), timeout_(timeout) {}

PendingWork::PendingWork(std::shared_ptr<TransportWork> work, std::string what, std::chrono::milliseconds timeout,
                         std::shared_ptr<Tracer> tracer, TraceEvent launched)
    : work_(std::move(work)),
      what_(std::move(what)),
      timeout_(timeout),
      tracer_(std::move(tracer)),
      launched_(std::move(launched)) {
  work_->watch_completion();
}

void PendingWork::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  const int64_t waited = tracer_ ? Tracer::now_ns() : 0;
  try {
    work->wait(timeout_);
  } catch (const std::exception& e) {
    throw operation_failed(what_, e);
  }
  if (then_) std::exchange(then_, nullptr)();
  if (tracer_) record_trace(*work, waited);
}

// The collective from launch to completion (the transport's time, else now), and the wait from `waited` to now.
void PendingWork::record_trace(const TransportWork& work, int64_t waited) {
  const int64_t now = Tracer::now_ns();
  TraceEvent wait = launched_;
  wait.kind = TraceEvent::Kind::Wait;
  wait.name = "wait";
  wait.begin_ns = waited;
  wait.end_ns = now;
  const int64_t completed = work.completed_ns();
  launched_.end_ns = std::clamp(completed > 0 ? completed : now, launched_.begin_ns, now);
  tracer_->record(std::move(launched_));
  tracer_->record(std::move(wait));
  tracer_.reset();
}

PendingWork PendingWork::then(std::function<void()> fn) && {
  then_ = std::move(fn);
  return std::move(*this);
}

Collectives::Collectives(std::shared_ptr<Transport> transport, int rank, int size, std::chrono::milliseconds timeout)
    : transport_(std::move(transport)), rank_(rank), size_(size), timeout_(timeout) {
  for (int r = 0; r < size; ++r) world_ranks_.push_back(r);
}

Collectives::Collectives(std::shared_ptr<Transport> transport, int rank, std::vector<int> world_ranks,
                         std::string group, std::chrono::milliseconds timeout)
    : transport_(std::move(transport)),
      rank_(rank),
      size_(static_cast<int>(world_ranks.size())),
      timeout_(timeout),
      world_ranks_(std::move(world_ranks)),
      group_(std::move(group)) {}

std::shared_ptr<Collectives> Collectives::split(int color, int key, const std::string& name) {
  const uint64_t id = ++splits_;
  auto mine = torch::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, torch::kLong);
  auto all = torch::empty({2 * size_}, torch::kLong);
  allgather_flat(mine, all);
  const int64_t* v = all.data_ptr<int64_t>();
  std::vector<int> members;  // ranks of this group with my color, ordered by (key, rank) as MPI_Comm_split does
  for (int r = 0; r < size_; ++r) {
    if (v[2 * r] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return v[2 * a + 1] < v[2 * b + 1]; });
  const int index = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  std::vector<int> world;
  for (int m : members) world.push_back(world_ranks_[static_cast<size_t>(m)]);
  const auto label = group_.empty() ? name : fmt::format("{}/{}", group_, name);
  auto what = describe("split", nullptr, fmt::format("{} group of world ranks {}", label, fmt::join(world, ",")).c_str());
  try {
    auto transport = transport_->split(members, index, fmt::format("{}.{}", id, color), color, key, timeout_);
    auto group = std::make_shared<Collectives>(std::move(transport), index, std::move(world), label, timeout_);
    group->set_tracer(tracer_);
    return group;
  } catch (const std::runtime_error& e) {
    if (dynamic_cast<const Error*>(&e)) throw;
    throw operation_failed(what, e);
  }
}

Backend Collectives::backend() const { return transport_->backend(); }

std::string Collectives::describe(const char* op, const torch::Tensor* tensor, const char* detail) {
  ++sequence_;
  std::string shape = tensor ? fmt::format(", {} x {}", tensor->numel(), c10::toString(tensor->scalar_type())) : "";
  // A sub-group's errors name world ranks: "rank 3 (1 of 2 in the shard group of world ranks 2,3)".
  const auto who = group_.empty() ? fmt::format("rank {} of {}", rank_, size_)
                                  : fmt::format("rank {} ({} of {} in the {} group of world ranks {})",
                                                world_ranks_[static_cast<size_t>(rank_)], rank_, size_, group_,
                                                fmt::join(world_ranks_, ","));
  return fmt::format("{}: {} #{}{}{} on {}", who, op, sequence_, detail ? fmt::format(" ({})", detail) : std::string(),
                     shape, to_string(backend()));
}

void Collectives::run(std::shared_ptr<TransportWork> work, std::string what, const char* op, int64_t bytes,
                      int64_t sent) {
  pending(std::move(work), std::move(what), op, bytes, sent, false).wait();
}

PendingWork Collectives::pending(std::shared_ptr<TransportWork> work, std::string what, const char* op, int64_t bytes,
                                 int64_t sent, bool reduces) {
  if (!tracer_) return PendingWork(std::move(work), std::move(what), timeout_);
  TraceEvent e;
  e.kind = TraceEvent::Kind::Collective;
  e.name = op;
  if (const auto* label = TraceLabel::current()) {
    e.label = label->label();
    e.factor = label->factor();
  }
  e.group = group_.empty() ? "world" : group_;
  e.reduction = reduces ? "sum" : "";
  e.bytes = bytes;
  e.sent = sent;
  e.sequence = static_cast<int64_t>(sequence_);
  e.begin_ns = launched_ns_;
  return PendingWork(std::move(work), std::move(what), timeout_, tracer_, std::move(e));
}

void Collectives::reject_global_mean(Reduction reduction, const char* op) const {
  if (reduction == Reduction::GlobalMean) {
    throw ConfigError(fmt::format("rank {}: {} cannot compute a global mean from tensors alone: it needs item "
                                  "counts (reduce with Sum and divide by the allreduced count)", rank_, op));
  }
}

void Collectives::check_contiguous(const torch::Tensor& t, const char* op) const {
  if (!t.is_contiguous()) {
    throw ConfigError(fmt::format("rank {}: {} needs a contiguous tensor", rank_, op));
  }
}

void Collectives::allreduce(torch::Tensor& tensor, Reduction reduction) {
  reject_global_mean(reduction, "allreduce");
  const double factor = reduction == Reduction::Mean && size_ > 1 ? 1.0 / size_ : 1.0;
  const auto label = scaled_label(tracer(), factor);
  // See Note [Where the division happens]: scale by 1/N first, exactly like a DDP bucket copy.
  if (factor != 1.0) tensor.mul_(factor);
  allreduce_sum_async(tensor).wait();
}

PendingWork Collectives::allreduce_sum_async(torch::Tensor& tensor) {
  check_contiguous(tensor, "allreduce");
  auto what = describe("allreduce", &tensor, "sum");
  const int64_t bytes = byte_size(tensor);
  mark_launch();
  return pending(transport_->allreduce_sum(tensor), std::move(what), "allreduce", bytes,
                 ring_allreduce_sent(bytes, size_), true);
}

torch::Tensor Collectives::reduction_buffer(int64_t numel, c10::ScalarType dtype) {
  auto what = describe("reduction buffer", nullptr, fmt::format("{} x {}", numel, c10::toString(dtype)).c_str());
  try {
    return transport_->reduction_buffer(numel, dtype, timeout_);
  } catch (const std::runtime_error& e) {
    if (dynamic_cast<const Error*>(&e)) throw;  // already says what is wrong (ConfigError)
    throw operation_failed(what, e);  // the agreement's broadcast or allreduce
  }
}

void Collectives::broadcast(torch::Tensor& tensor, int root) {
  check_contiguous(tensor, "broadcast");
  auto what = describe("broadcast", &tensor, fmt::format("from rank {}", root).c_str());
  mark_launch();
  run(transport_->broadcast(tensor, root), std::move(what), "broadcast", byte_size(tensor), 0);
}

void Collectives::broadcast_coalesced(const std::vector<torch::Tensor>& tensors, int root) {
  if (size_ == 1) return;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  torch::NoGradGuard no_grad;
  for (auto& [dtype, group] : by_dtype) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : group) flat_parts.push_back(t.detach().reshape({-1}));
    auto flat = torch::cat(flat_parts);
    broadcast(flat, root);
    int64_t offset = 0;
    for (const auto& t : group) {
      // Write through .data() semantics: a parameter's autograd version must not change here.
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void Collectives::allgather_flat(const torch::Tensor& input, torch::Tensor& output) {
  allgather_flat_async(input, output).wait();
}

PendingWork Collectives::allgather_flat_async(const torch::Tensor& input, torch::Tensor& output) {
  check_contiguous(input, "allgather");
  check_contiguous(output, "allgather");
  const int64_t n = input.numel();
  if (output.numel() != n * size_) {
    throw ConfigError(fmt::format("rank {}: allgather_flat output has {} elements; expected {} x {} = {}", rank_,
                                  output.numel(), size_, n, n * size_));
  }
  auto what = describe("allgather", &input);
  const int64_t bytes = byte_size(output);
  mark_launch();
  return pending(transport_->allgather(input, output), std::move(what), "allgather", bytes,
                 ring_share_sent(bytes, size_), false);
}

void Collectives::reduce_scatter(const torch::Tensor& input, torch::Tensor& output, Reduction reduction) {
  reduce_scatter_async(input, output, reduction).wait();
}

PendingWork Collectives::reduce_scatter_async(const torch::Tensor& input, torch::Tensor& output,
                                              Reduction reduction) {
  reject_global_mean(reduction, "reduce_scatter");
  check_contiguous(input, "reduce_scatter");
  check_contiguous(output, "reduce_scatter");
  const int64_t n = output.numel();
  if (input.numel() != n * size_) {
    throw ConfigError(fmt::format("rank {}: reduce_scatter input has {} elements; expected {} x {} = {}", rank_,
                                  input.numel(), size_, n, n * size_));
  }
  auto source = input.reshape({-1});
  // See Note [Where the division happens]: x 1/N on a copy (the caller's input stays as it was), then a SUM.
  const double factor = reduction == Reduction::Mean && size_ > 1 ? 1.0 / size_ : 1.0;
  if (factor != 1.0) source = source.mul(factor);
  auto what = describe("reduce_scatter", &input, to_string(reduction));
  const int64_t bytes = byte_size(input);
  const auto label = scaled_label(tracer(), factor);
  mark_launch();
  return pending(transport_->reduce_scatter_sum(source, output), std::move(what), "reduce_scatter", bytes,
                 ring_share_sent(bytes, size_), true);
}

std::vector<std::string> Collectives::allgather_strings(const std::string& mine) {
  auto length = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong);
  auto lengths = torch::empty({size_}, torch::kLong);
  allgather_flat(length, lengths);
  const int64_t longest = lengths.max().item<int64_t>();
  auto padded = torch::zeros({std::max<int64_t>(longest, 1)}, torch::kUInt8);
  std::memcpy(padded.data_ptr<uint8_t>(), mine.data(), mine.size());
  auto all = torch::empty({size_ * padded.numel()}, torch::kUInt8);
  allgather_flat(padded, all);
  std::vector<std::string> out;
  const auto* bytes = all.data_ptr<uint8_t>();
  for (int r = 0; r < size_; ++r) {
    const auto* begin = reinterpret_cast<const char*>(bytes + r * padded.numel());
    out.emplace_back(begin, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

void Collectives::barrier() {
  auto what = describe("barrier", nullptr);
  mark_launch();
  run(transport_->barrier(), std::move(what), "barrier", 0, 0);
}

}  // namespace gradsync
