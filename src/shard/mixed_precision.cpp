// Mixed-precision dtypes and Gloo workarounds (see Note [Mixed precision on Gloo] in mixed_precision.h).
#include "shard/mixed_precision.h"

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {

c10::ScalarType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return torch::kFloat;
  if (name == "fp64" || name == "float64") return torch::kDouble;
  if (name == "fp16" || name == "float16") return torch::kHalf;
  if (name == "bf16" || name == "bfloat16") return torch::kBFloat16;
  throw ConfigError(fmt::format("dtype '{}' is not known; expected fp32, fp64, fp16 or bf16", name));
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat: return "fp32";
    case torch::kDouble: return "fp64";
    case torch::kHalf: return "fp16";
    case torch::kBFloat16: return "bf16";
    default: return c10::toString(dtype);
  }
}

c10::ScalarType gloo_reduce_dtype(c10::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? torch::kFloat : dtype;
}

torch::Tensor gloo_copyable(const torch::Tensor& t) {
  // Same element size, no arithmetic on the bits: the copy is exact whatever the bit patterns mean.
  return t.scalar_type() == torch::kBFloat16 ? t.view(torch::kHalf) : t;
}

}  // namespace gradsync
