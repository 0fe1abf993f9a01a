// SyncBatchNorm's autograd function (see sync_batch_norm_function.h).
#include "norm/sync_batch_norm_function.h"

#include <torch/csrc/autograd/custom_function.h>

namespace gradsync::norm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels to backward inside the autograd context, which holds only IValues: a capsule keeps it alive
// for as long as the graph lives.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<Collectives> g) : group(std::move(g)) {}
  std::shared_ptr<Collectives> group;
};

// [C] -> [1, C, 1, ...] against an input of `dims` dimensions.
torch::Tensor per_channel(const torch::Tensor& t, int64_t dims) {
  std::vector<int64_t> shape(static_cast<size_t>(dims), 1);
  shape[1] = t.numel();
  return t.view(shape);
}

// Half and bfloat16 compute in float32, as BatchNorm's own kernels do; wider types in their own.
torch::Tensor widened(const torch::Tensor& t) { return t.element_size() < 4 ? t.to(torch::kFloat) : t; }

std::vector<int64_t> reduced_dims(int64_t dims) {
  std::vector<int64_t> out{0};
  for (int64_t d = 2; d < dims; ++d) out.push_back(d);
  return out;
}

struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& mean, const torch::Tensor& invstd,
                               int64_t count, std::shared_ptr<Collectives> group) {
    const auto d = input.dim();
    const auto x = widened(input);
    auto out = (x - per_channel(mean, d)) * per_channel(invstd * widened(weight), d) + per_channel(widened(bias), d);
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["group"] = torch::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(std::move(group)));
    return out.to(input.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &input = saved[0], &weight = saved[1], &mean = saved[2], &invstd = saved[3];
    const auto d = input.dim();
    const auto dy = widened(grads[0].defined() ? grads[0] : torch::zeros_like(input));
    const auto xmu = widened(input) - per_channel(mean, d);
    // This rank's sums (float32 for 16-bit inputs, as one BatchNorm's backward).
    auto sum_dy = dy.sum(reduced_dims(d));
    auto sum_dy_xmu = (dy * xmu).sum(reduced_dims(d));
    torch::Tensor grad_input, grad_weight, grad_bias;
    // This rank's own sums: the engine reduces weight and bias like any parameter.
    if (ctx->needs_input_grad(1)) grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
    if (ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.scalar_type());
    if (ctx->needs_input_grad(0)) {
      auto capsule = ctx->saved_data["group"].toCapsule();
      auto& group = *static_cast<GroupCapsule*>(capsule.get())->group;
      // Every rank's, summed, then divided by the global count (float32 for 16-bit inputs: Gloo has no bfloat16 sum).
      auto sums = torch::cat({sum_dy, sum_dy_xmu});
      group.allreduce(sums, Reduction::Sum);
      const auto n = static_cast<double>(ctx->saved_data["count"].toInt());
      const int64_t c = mean.numel();
      const auto mean_dy = sums.narrow(0, 0, c) / n;
      const auto mean_dy_xmu = sums.narrow(0, c, c) / n;
      grad_input = ((dy - per_channel(mean_dy, d) - xmu * per_channel(invstd * invstd * mean_dy_xmu, d)) *
                    per_channel(invstd * widened(weight), d)).to(input.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor normalise(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                        const torch::Tensor& mean, const torch::Tensor& invstd, int64_t count,
                        std::shared_ptr<Collectives> group) {
  // Without affine: weight 1 and bias 0 that need no gradient (autograd functions take no undefined inputs).
  const auto w = weight.defined() ? weight : torch::ones_like(mean);
  const auto b = bias.defined() ? bias : torch::zeros_like(mean);
  return SyncBatchNormFunction::apply(input, w, b, mean, invstd, count, std::move(group));
}

}  // namespace gradsync::norm
