// defines: plan_units(), which turns a WrapPolicy (fsdp.h) and a module into FSDP units: contiguous ranges of the module's direct children, plus a root unit for every parameter no
// unit took.
//
// A unit is what FSDP gathers and frees as a whole: its parameters live in one flat buffer (flat_param.h). Small
// units hold less memory at a time but issue more, smaller collectives; one unit for the whole model is plain
// ZeRO-2/3 without the per-layer memory benefit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/fsdp.h"

namespace gradsync {

struct UnitPlan {
  std::string name;                      // "0", "3..5" for a range of children, "(root)" for the root unit
  bool is_root = false;
  size_t first_child = 0, last_child = 0;  // inclusive range of direct children (not meaningful for the root)
  std::vector<std::string> param_names;  // state-dict keys ("3.weight"), in state-dict order
  std::vector<torch::Tensor> params;     // the module's own parameter tensors, same order
  int64_t numel() const;
};

// Units in child order, then the root unit if any parameter is left over. Throws ConfigError for a List naming a
// child that does not exist or has no parameters, or naming one twice.
std::vector<UnitPlan> plan_units(const torch::nn::Module& module, const WrapPolicy& policy);

}  // namespace gradsync
