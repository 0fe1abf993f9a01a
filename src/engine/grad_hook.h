// defines: on_gradient_accumulated(), how every engine learns that autograd has accumulated a parameter's
// gradient: a post-hook on the parameter's AccumulateGrad node, which runs once per backward after .grad changed.
#pragma once
#include <functional>
#include <memory>

#include <torch/torch.h>
#include <torch/csrc/autograd/function.h>

#include "torch_compat.h"

namespace gradsync {

// Installs `fn` as a post-hook of `param`'s AccumulateGrad node and returns the node: the hook lives only while the
// node does, so the engine keeps it. `fn` outlives the engine inside autograd's graph: capture weak references.
compat::GradAccumulator on_gradient_accumulated(const torch::Tensor& param, std::function<void()> fn);

}  // namespace gradsync
