// defines: plan_units(), which turns a WrapPolicy (fsdp.h) and a module into FSDP units, found recursively, plus a
// root unit for every trainable parameter no unit took.
//
// A unit is what FSDP gathers and frees as a whole: its parameters live in one flat buffer (flat_param.h). Small
// units hold less memory at a time but issue more, smaller collectives; one unit for the whole model is plain
// ZeRO-2/3 without the per-layer memory benefit.
//
// Where a unit runs (Note [Unit slots]): C++ modules have no forward pre-hooks, so FSDP must be the one that calls a
// unit. A torch::nn::Sequential calls its elements through type-erased slots (AnyModule); FSDP puts a small caller
// in a unit's slot that gathers the unit, runs the original element and arms its backward hook (unit_slots.h). So a
// unit that is an element of a Sequential, at any depth, runs with the model's own forward unchanged. A unit that
// is not (a module its parent's forward calls through a typed member) has no slot: the model then runs through
// FullyShardedDataParallel::forward_with(body), with unit(name, fn) around its part. That is the one constraint.
//
// Frozen parameters (requires_grad false) belong to no unit: they stay whole on every rank, as the module holds
// them, and take part in no collective after the construction's broadcast.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/fsdp.h"

namespace gradsync {

struct UnitPlan {
  std::string name;  // the module's qualified name ("0", "blocks.1"), "3..5" for a range of slots, "(root)"
  bool is_root = false;
  // The Sequential whose slots [first_child, last_child] run the unit; null when the unit has no slot.
  std::shared_ptr<torch::nn::SequentialImpl> sequential;
  size_t first_child = 0, last_child = 0;
  std::vector<std::string> param_names;  // state-dict keys ("3.weight"), in state-dict order
  std::vector<torch::Tensor> params;     // the module's own parameter tensors, same order
  int64_t numel() const;
  bool has_slot() const { return sequential != nullptr; }
};

// Units in the module's registration order, then the root unit if any trainable parameter is left over. Throws
// ConfigError for a policy naming a module that does not exist, has no trainable parameters, is named twice or lies
// inside another unit.
std::vector<UnitPlan> plan_units(const torch::nn::Module& module, const WrapPolicy& policy);

// "torch::nn::LinearImpl" -> "Linear", "app::BlockImpl" -> "Block": the type name a type: policy matches.
std::string module_type_name(const torch::nn::Module& module);

}  // namespace gradsync
