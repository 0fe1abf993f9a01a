// Unit callers in Sequential slots (see unit_slots.h).
#include "shard/unit_slots.h"

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

// Slot a of a unit over slots [a, b]: elements a..b run inside the unit. A Tensor in, a Tensor out, as the
// elements of a Sequential FSDP can run.
class UnitCallImpl : public torch::nn::Module {
 public:
  UnitCallImpl(std::vector<torch::nn::AnyModule> elements, size_t unit, UnitSlots::RunUnit run)
      : elements_(std::move(elements)), unit_(unit), run_(std::move(run)) {}
  torch::Tensor forward(torch::Tensor x) {
    return run_(unit_, [&] {
      for (auto& element : elements_) x = element.forward(x);
      return x;
    });
  }

 private:
  std::vector<torch::nn::AnyModule> elements_;
  size_t unit_;
  UnitSlots::RunUnit run_;
};

// Slots a+1..b: their elements already ran in slot a.
class PassThroughImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(torch::Tensor x) { return x; }
};

}  // namespace

UnitSlots::UnitSlots(const std::vector<UnitPlan>& plans, const RunUnit& run) {
  for (const auto& plan : plans) {  // every plan checked before any slot changes
    if (plan.has_slot() && plan.last_child >= plan.sequential->size()) {
      throw ConfigError(fmt::format("FSDP unit '{}': slots {}..{} of a Sequential of {} elements (a Sequential "
                                    "whose registered children and elements differ)", plan.name, plan.first_child,
                                    plan.last_child, plan.sequential->size()));
    }
  }
  for (size_t u = 0; u < plans.size(); ++u) {
    const auto& plan = plans[u];
    if (!plan.has_slot()) continue;
    auto& sequential = plan.sequential;
    auto element = [&](size_t slot) -> torch::nn::AnyModule& {
      return *(sequential->begin() + static_cast<std::ptrdiff_t>(slot));
    };
    std::vector<torch::nn::AnyModule> originals;
    for (size_t s = plan.first_child; s <= plan.last_child; ++s) {
      originals.push_back(element(s));
      saved_.push_back({sequential, s, element(s)});
    }
    element(plan.first_child) = torch::nn::AnyModule(std::make_shared<UnitCallImpl>(std::move(originals), u, run));
    for (size_t s = plan.first_child + 1; s <= plan.last_child; ++s) {
      element(s) = torch::nn::AnyModule(std::make_shared<PassThroughImpl>());
    }
  }
}

UnitSlots::~UnitSlots() {
  for (auto& s : saved_) *(s.sequential->begin() + static_cast<std::ptrdiff_t>(s.slot)) = s.original;
}

}  // namespace gradsync
