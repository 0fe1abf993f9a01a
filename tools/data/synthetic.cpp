// synthetic:N: random rows reproducible from the seed, bit-identical to the Python recipe in data.h.
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "data/data.h"
#include "data/dataset_spec.h"
#include "gradsync/error.h"

namespace gradsync::cli {

Dataset load_synthetic(int64_t n, int64_t input_size, int64_t output_size, LossKind loss, uint64_t seed) {
  check_model_sizes(input_size, output_size);
  if (n <= 0) {
    throw ConfigError(fmt::format("synthetic data set size {} must be a positive integer", n));
  }
  if (n > std::numeric_limits<int64_t>::max() / input_size ||
      input_size > std::numeric_limits<int64_t>::max() / output_size) {
    throw ConfigError(
        fmt::format("synthetic:{} with {} inputs and {} outputs is too large", n, input_size, output_size));
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::Tensor x = torch::randn({n, input_size}, gen);
  torch::Tensor w = torch::randn({input_size, output_size}, gen);
  torch::Tensor logits = x.matmul(w);
  torch::Tensor y =
      loss == LossKind::CrossEntropy ? logits.argmax(1) : logits / std::sqrt(static_cast<double>(input_size));
  return Dataset{x, y};
}

}  // namespace gradsync::cli
