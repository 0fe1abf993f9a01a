// Gradient-accumulated hooks (see grad_hook.h).
#include "engine/grad_hook.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace gradsync {
namespace {

class AccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  explicit AccumulatedHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

compat::GradAccumulator on_gradient_accumulated(const torch::Tensor& param, std::function<void()> fn) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<AccumulatedHook>(std::move(fn)));
  return accumulator;
}

}  // namespace gradsync
