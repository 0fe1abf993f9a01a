// data: the data-set specs (load_dataset picks the loader), the loss kinds, and the row helpers every loader
// and trainer shares. The loaders: fashion_mnist.cpp, synthetic.cpp, torch_save_file.cpp. See data.h.
#include "data/data.h"

#include <fmt/format.h>

#include <limits>

#include "data/dataset_spec.h"
#include "gradsync/error.h"

namespace gradsync::cli {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

// Strictly digits, > 0, fits in int64; nullopt-like -1 otherwise.
int64_t parse_positive(const std::string& text) {
  if (text.empty()) return -1;
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return -1;
    const int digit = c - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) return -1;
    value = value * 10 + digit;
  }
  return value > 0 ? value : -1;
}

// "synthetic" or "synthetic:N".
Dataset load_synthetic_spec(const std::string& spec, int64_t input_size, int64_t output_size, LossKind loss,
                            uint64_t seed) {
  const std::string count = spec.size() > 10 ? spec.substr(10) : "";
  const int64_t n = parse_positive(count);
  if (n <= 0) {
    throw ConfigError(fmt::format(
        "dataset spec '{}': '{}' is not a positive integer; expected synthetic:N with N the number of rows",
        spec, count));
  }
  return load_synthetic(n, input_size, output_size, loss, seed);
}

// "fashion-mnist" or "fashion-mnist:SPLIT", for a model of 784 inputs and 10 outputs.
Dataset load_fashion_mnist_spec(const std::string& spec, int64_t input_size, int64_t output_size,
                                LossKind loss) {
  const std::string split = spec == "fashion-mnist" ? std::string("train") : spec.substr(14);
  if (split != "train" && split != "test") {
    throw ConfigError(fmt::format(
        "dataset spec '{}': split '{}' is unknown; expected fashion-mnist, fashion-mnist:train or "
        "fashion-mnist:test",
        spec, split));
  }
  if (input_size != kFashionMnistInputs) {
    throw ConfigError(fmt::format(
        "dataset '{}' has {} inputs per example (28x28 pixels) but the model takes {}; use a model spec "
        "like mlp:784-256-10",
        spec, kFashionMnistInputs, input_size));
  }
  if (output_size != kFashionMnistClasses) {
    throw ConfigError(fmt::format(
        "dataset '{}' has {} classes but the model has {} outputs; use a model spec ending in -10", spec,
        kFashionMnistClasses, output_size));
  }
  return load_fashion_mnist(fashion_mnist_dir(), split, loss);
}

}  // namespace

void check_model_sizes(int64_t input_size, int64_t output_size) {
  if (input_size <= 0 || output_size <= 0) {
    throw ConfigError(fmt::format("model input size {} / output size {}: both must be positive integers",
                                  input_size, output_size));
  }
}

LossKind parse_loss_kind(const std::string& name) {
  if (name == "ce" || name == "cross-entropy") return LossKind::CrossEntropy;
  if (name == "mse") return LossKind::MeanSquared;
  throw ConfigError(
      fmt::format("loss '{}' is unknown; expected ce (cross-entropy) or mse (mean squared error)", name));
}

const char* loss_kind_name(LossKind loss) { return loss == LossKind::CrossEntropy ? "ce" : "mse"; }

torch::Tensor one_hot_float(const torch::Tensor& labels, int64_t classes) {
  return torch::one_hot(labels.to(torch::kInt64), classes).to(torch::kFloat32);
}

Dataset select_rows(const Dataset& data, const torch::Tensor& indices) {
  const auto idx = indices.to(torch::kInt64);
  return Dataset{data.inputs.index_select(0, idx), data.targets.index_select(0, idx)};
}

Dataset load_dataset(const std::string& spec, int64_t input_size, int64_t output_size, LossKind loss,
                     uint64_t seed) {
  check_model_sizes(input_size, output_size);
  if (spec.empty()) throw ConfigError(fmt::format("dataset spec is empty; {}", kDatasetSpecs));
  if (spec == "synthetic" || starts_with(spec, "synthetic:")) {
    return load_synthetic_spec(spec, input_size, output_size, loss, seed);
  }
  if (spec == "fashion-mnist" || starts_with(spec, "fashion-mnist:")) {
    return load_fashion_mnist_spec(spec, input_size, output_size, loss);
  }
  return load_dataset_file(spec, input_size, output_size, loss);
}

}  // namespace gradsync::cli
