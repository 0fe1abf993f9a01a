// Cross-rank check of the unit collective order (see order_check.h).
#include "shard/order_check.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"

namespace gradsync {

OrderCheck::OrderCheck(std::vector<std::string> unit_names, OrderChecking mode)
    : unit_names_(std::move(unit_names)), mode_(mode), active_(mode != OrderChecking::Never) {}

std::string OrderCheck::describe(int64_t op, int64_t unit, int64_t numel) const {
  const std::string name = unit >= 0 && static_cast<size_t>(unit) < unit_names_.size()
                               ? fmt::format("unit {} ('{}', {} elements)", unit, unit_names_[unit], numel)
                               : "";
  switch (static_cast<Op>(op)) {
    case Op::ForwardGather: return "forward all-gather of " + name;
    case Op::BackwardGather: return "backward all-gather of " + name;
    case Op::ReduceGrad: return "gradient reduction of " + name;
    case Op::EndOfBackward: return "the end of backward (no more unit collectives)";
  }
  return fmt::format("unknown operation {}", op);
}

void OrderCheck::expect(Collectives& comm, Op op, size_t unit, int64_t numel) {
  if (!active_ || comm.size() == 1) return;
  ++sequence_;
  auto mine = torch::tensor({static_cast<int64_t>(op), static_cast<int64_t>(unit), numel}, torch::kLong);
  auto all = torch::empty({3 * comm.size()}, torch::kLong);
  TraceLabel label(comm.tracer(), "order check");
  comm.allgather_flat(mine, all);
  auto* v = all.data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < comm.size(); ++r) {
    same = same && v[3 * r] == v[0] && v[3 * r + 1] == v[1] && v[3 * r + 2] == v[2];
  }
  if (same) return;
  std::vector<std::string> per_rank;
  for (int r = 0; r < comm.size(); ++r) {
    per_rank.push_back(fmt::format("rank {}: {}", r, describe(v[3 * r], v[3 * r + 1], v[3 * r + 2])));
  }
  active_ = false;
  throw DistributedError(fmt::format(
      "FullyShardedDataParallel on rank {}: the ranks run their units in different orders (unit collective #{} of "
      "the checked step): {}. Every rank must run the same units in the same order in forward and backward",
      comm.rank(), sequence_, fmt::join(per_rank, "; ")));
}

void OrderCheck::end_of_synced_backward(Collectives& comm) {
  if (!active_) return;
  expect(comm, Op::EndOfBackward, static_cast<size_t>(-1), 0);
  if (mode_ != OrderChecking::Always) active_ = false;
  sequence_ = 0;
}

}  // namespace gradsync
