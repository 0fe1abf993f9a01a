// defines: access to one parameter's torch::optim state as named tensors, for memory accounting and sharded
// checkpoints. libtorch keys an optimizer's state by the parameter's TensorImpl address, so the state of a shard
// can only be found through the shard tensor itself.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// The defined state tensors of SGD (momentum_buffer), Adam/AdamW (exp_avg, exp_avg_sq, max_exp_avg_sq), Adagrad
// (sum) and RMSprop (square_avg, momentum_buffer, grad_avg); empty for other state types.
NamedTensors state_tensors(const torch::optim::OptimizerParamState& state);

// One parameter's state: its step count (optimizers that keep one) and its tensors.
struct ParamState {
  std::optional<int64_t> step;
  NamedTensors tensors;
  bool empty() const { return !step && tensors.empty(); }
};

// Empty when the optimizer has no state for `param` yet (before its first step).
ParamState get_param_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& param);

// Installs `state` for `param` (replacing any). Supports SGD, Adam and AdamW; throws ConfigError for other
// optimizers or for a state that does not fit (a name the optimizer does not keep, a shape unlike the parameter).
void set_param_state(torch::optim::Optimizer& optimizer, const torch::Tensor& param, const ParamState& state);

}  // namespace gradsync
