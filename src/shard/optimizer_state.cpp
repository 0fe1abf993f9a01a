// Optimizer state as named tensors (see optimizer_state.h).
#include "shard/optimizer_state.h"

#include <algorithm>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "torch_compat.h"

namespace gradsync {
namespace {

namespace optim = torch::optim;

// The key torch::optim uses for a parameter's state.
compat::OptimizerStateKey state_key(const torch::Tensor& param) { return compat::optimizer_state_key(param); }

void add_if_defined(NamedTensors& out, const char* name, const torch::Tensor& t) {
  if (t.defined()) out.emplace_back(name, t);
}

template <typename AdamState>
NamedTensors adam_like(const AdamState& s) {
  NamedTensors out;
  add_if_defined(out, "exp_avg", s.exp_avg());
  add_if_defined(out, "exp_avg_sq", s.exp_avg_sq());
  add_if_defined(out, "max_exp_avg_sq", s.max_exp_avg_sq());
  return out;
}

torch::Tensor take(const ParamState& state, const std::string& name, const torch::Tensor& param,
                   const std::string& optimizer, bool required) {
  for (const auto& [key, tensor] : state.tensors) {
    if (key != name) continue;
    if (!tensor.sizes().equals(param.sizes())) {
      throw ConfigError(fmt::format("optimizer state '{}' has shape [{}] but its parameter has shape [{}]", name,
                                    fmt::join(tensor.sizes(), ", "), fmt::join(param.sizes(), ", ")));
    }
    return tensor.to(param.options().requires_grad(false)).clone();
  }
  if (required) throw ConfigError(fmt::format("{} state lacks '{}'", optimizer, name));
  return {};
}

void check_names(const ParamState& state, const std::vector<std::string>& allowed, const std::string& optimizer) {
  for (const auto& [key, tensor] : state.tensors) {
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      throw ConfigError(fmt::format("{} keeps no state named '{}' (the checkpoint was written by another "
                                    "optimizer?)", optimizer, key));
    }
  }
}

template <typename AdamState>
std::unique_ptr<AdamState> make_adam_like(const ParamState& state, const torch::Tensor& param, const char* name) {
  check_names(state, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, name);
  auto s = std::make_unique<AdamState>();
  s->step(state.step.value_or(0));
  s->exp_avg(take(state, "exp_avg", param, name, true));
  s->exp_avg_sq(take(state, "exp_avg_sq", param, name, true));
  s->max_exp_avg_sq(take(state, "max_exp_avg_sq", param, name, false));
  return s;
}

}  // namespace

NamedTensors state_tensors(const optim::OptimizerParamState& state) {
  if (auto* s = dynamic_cast<const optim::SGDParamState*>(&state)) {
    NamedTensors out;
    add_if_defined(out, "momentum_buffer", s->momentum_buffer());
    return out;
  }
  if (auto* s = dynamic_cast<const optim::AdamParamState*>(&state)) return adam_like(*s);
  if (auto* s = dynamic_cast<const optim::AdamWParamState*>(&state)) return adam_like(*s);
  if (auto* s = dynamic_cast<const optim::AdagradParamState*>(&state)) {
    NamedTensors out;
    add_if_defined(out, "sum", s->sum());
    return out;
  }
  if (auto* s = dynamic_cast<const optim::RMSpropParamState*>(&state)) {
    NamedTensors out;
    add_if_defined(out, "square_avg", s->square_avg());
    add_if_defined(out, "momentum_buffer", s->momentum_buffer());
    add_if_defined(out, "grad_avg", s->grad_avg());
    return out;
  }
  return {};
}

ParamState get_param_state(const optim::Optimizer& optimizer, const torch::Tensor& param) {
  ParamState out;
  auto it = optimizer.state().find(state_key(param));
  if (it == optimizer.state().end()) return out;
  const auto& state = *it->second;
  if (auto* s = dynamic_cast<const optim::AdamParamState*>(&state)) out.step = s->step();
  if (auto* s = dynamic_cast<const optim::AdamWParamState*>(&state)) out.step = s->step();
  out.tensors = state_tensors(state);
  return out;
}

void set_param_state(optim::Optimizer& optimizer, const torch::Tensor& param, const ParamState& state) {
  const auto key = state_key(param);
  if (state.empty()) {
    optimizer.state().erase(key);
    return;
  }
  std::unique_ptr<optim::OptimizerParamState> made;
  if (dynamic_cast<optim::SGD*>(&optimizer)) {
    check_names(state, {"momentum_buffer"}, "SGD");
    auto s = std::make_unique<optim::SGDParamState>();
    s->momentum_buffer(take(state, "momentum_buffer", param, "SGD", false));
    made = std::move(s);
  } else if (dynamic_cast<optim::AdamW*>(&optimizer)) {
    made = make_adam_like<optim::AdamWParamState>(state, param, "AdamW");
  } else if (dynamic_cast<optim::Adam*>(&optimizer)) {
    made = make_adam_like<optim::AdamParamState>(state, param, "Adam");
  } else {
    throw ConfigError("sharded optimizer checkpoints support SGD, Adam and AdamW only");
  }
  optimizer.state()[key] = std::move(made);
}

}  // namespace gradsync
