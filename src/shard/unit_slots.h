// defines: UnitSlots, the callers FSDP puts into a torch::nn::Sequential's slots so that the model's own forward
// runs its units (Note [Unit slots] in wrap_policy.h), and the original elements put back when the engine goes.
//
// Only the Sequential's list of callable elements changes, not its registered children: parameter names, state
// dicts and module() are the user's, unchanged. A unit over slots [a, b] puts one caller in slot a that runs the
// original elements a..b inside the unit, and pass-throughs in a+1..b.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "shard/wrap_policy.h"

namespace gradsync {

class UnitSlots {
 public:
  // body computes the unit's output; the RunUnit gathers the unit around it (ShardedUnits::run_unit).
  using RunUnit = std::function<torch::Tensor(size_t unit, const std::function<torch::Tensor()>& body)>;

  UnitSlots(const std::vector<UnitPlan>& plans, const RunUnit& run);
  ~UnitSlots();  // the original elements back in their slots
  UnitSlots(const UnitSlots&) = delete;
  UnitSlots& operator=(const UnitSlots&) = delete;

 private:
  struct Saved {
    std::shared_ptr<torch::nn::SequentialImpl> sequential;
    size_t slot;
    torch::nn::AnyModule original;
  };
  std::vector<Saved> saved_;
};

}  // namespace gradsync
