// defines: WrapPolicy (which children of a module become FSDP units) and plan_units(), which turns a policy and a
// module into units: contiguous ranges of the module's direct children, plus a root unit for every parameter no
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

namespace gradsync {

struct WrapPolicy {
  enum class Kind {
    Children,   // every direct child that has parameters is a unit (PyTorch: wrap each layer)
    MinParams,  // consecutive children grouped until the group holds >= min_params parameters
    List,       // the named direct children, one unit each; the other children's parameters go to the root
  };
  Kind kind = Kind::Children;
  int64_t min_params = 0;
  std::vector<std::string> names;

  static WrapPolicy children();
  static WrapPolicy at_least(int64_t min_params);
  static WrapPolicy list(std::vector<std::string> names);
  // The CLI spelling: "children", "params:N", "list:A,B,...".
  std::string to_string() const;
};

// Parses "children", "params:N" (N >= 1) or "list:NAME[,NAME...]"; throws ConfigError naming the spec otherwise.
WrapPolicy parse_wrap_policy(const std::string& spec);

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
