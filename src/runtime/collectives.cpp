// Typed collectives over a c10d process group (see collectives.h).
#include "gradsync/collectives.h"

#include <cstring>
#include <map>

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {

PendingWork::PendingWork(c10::intrusive_ptr<c10d::Work> work, std::string what)
    : work_(std::move(work)), what_(std::move(what)) {}

void PendingWork::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  try {
    work->wait();
  } catch (const std::exception& e) {
    // Gloo names only IP:port; say which rank and which operation, and where to look for the peer's fate.
    throw DistributedError(fmt::format("{} failed: {} (another rank exited, crashed or stalled; the launcher's "
                                       "report names it)", what_, e.what()));
  }
}

Collectives::Collectives(c10::intrusive_ptr<c10d::ProcessGroup> group, int rank, int size)
    : group_(std::move(group)), rank_(rank), size_(size) {}

std::string Collectives::describe(const char* op, const torch::Tensor* tensor, const char* detail) {
  ++sequence_;
  std::string shape = tensor ? fmt::format(", {} x {}", tensor->numel(), c10::toString(tensor->scalar_type())) : "";
  return fmt::format("rank {} of {}: {} #{}{}{}", rank_, size_, op, sequence_,
                     detail ? fmt::format(" ({})", detail) : std::string(), shape);
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
  if (reduction == Reduction::Mean && size_ > 1) {
    // See Note [Where the division happens]: scale by 1/N first, exactly like a DDP bucket copy.
    tensor.mul_(1.0 / size_);
  }
  allreduce_sum_async(tensor).wait();
}

PendingWork Collectives::allreduce_sum_async(torch::Tensor& tensor) {
  check_contiguous(tensor, "allreduce");
  std::vector<at::Tensor> list{tensor};
  auto what = describe("allreduce", &tensor, "sum");
  return PendingWork(group_->allreduce(list, c10d::AllreduceOptions{}), std::move(what));
}

void Collectives::broadcast(torch::Tensor& tensor, int root) {
  check_contiguous(tensor, "broadcast");
  std::vector<at::Tensor> list{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  auto what = describe("broadcast", &tensor, fmt::format("from rank {}", root).c_str());
  PendingWork(group_->broadcast(list, options), std::move(what)).wait();
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
  check_contiguous(input, "allgather");
  check_contiguous(output, "allgather");
  const int64_t n = input.numel();
  if (output.numel() != n * size_) {
    throw ConfigError(fmt::format("rank {}: allgather_flat output has {} elements; expected {} x {} = {}", rank_,
                                  output.numel(), size_, n, n * size_));
  }
  // Gloo 1.13 has no _allgather_base: narrow views of one flat buffer as the output list gather in place.
  std::vector<std::vector<at::Tensor>> outputs(1);
  auto flat_out = output.view({-1});
  for (int r = 0; r < size_; ++r) outputs[0].push_back(flat_out.narrow(0, r * n, n));
  std::vector<at::Tensor> inputs{input.reshape({-1})};
  auto what = describe("allgather", &input);
  PendingWork(group_->allgather(outputs, inputs), std::move(what)).wait();
}

void Collectives::reduce_scatter(const torch::Tensor& input, torch::Tensor& output, Reduction reduction) {
  reject_global_mean(reduction, "reduce_scatter");
  check_contiguous(input, "reduce_scatter");
  const int64_t n = output.numel();
  if (input.numel() != n * size_) {
    throw ConfigError(fmt::format("rank {}: reduce_scatter input has {} elements; expected {} x {} = {}", rank_,
                                  input.numel(), size_, n, n * size_));
  }
  // alltoall: chunk r of every rank's input lands on rank r, as [size, n]; the sum over dim 0 is the reduction.
  auto source = input.reshape({-1});
  if (reduction == Reduction::Mean && size_ > 1) source = source.mul(1.0 / size_);
  auto received = torch::empty_like(source);
  std::vector<int64_t> equal_splits;  // empty: n elements to and from every rank
  auto what = describe("reduce_scatter", &input, to_string(reduction));
  PendingWork(group_->alltoall_base(received, source, equal_splits, equal_splits), std::move(what)).wait();
  output.view({-1}).copy_(received.view({size_, n}).sum(0));
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
  PendingWork(group_->barrier(c10d::BarrierOptions{}), std::move(what)).wait();
}

}  // namespace gradsync
