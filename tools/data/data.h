// data: the data sets the `gradsync` CLI trains on, as whole in-memory tensors.
//
// Dataset specs (load_dataset):
//   fashion-mnist[:train|:test]  Debian's dataset-fashion-mnist (gzipped IDX files, read with zlib);
//                                directory overridable by $GRADSYNC_FASHION_MNIST_DIR.
//   synthetic:N                  N random rows, reproducible from the seed and bit-identical to the Python
//                                recipe documented at load_synthetic().
//   PATH                         a file written by Python torch.save({"inputs": X, "targets": Y}, PATH).
//
// Errors: gradsync::ConfigError for bad input (a bad spec, a missing, unreadable or corrupt file, wrong
// shapes/dtypes/values), gradsync::Error for other failures (a read error, zlib out of memory); each message
// names the spec or path, the offending value and what is allowed. One file per loader: data.cpp (the specs),
// fashion_mnist.cpp, synthetic.cpp, torch_save_file.cpp.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace gradsync::cli {

struct Dataset {
  torch::Tensor inputs;   // float32 [n, IN], contiguous (images are flattened)
  torch::Tensor targets;  // CrossEntropy: int64 [n] in [0, OUT); MeanSquared: float32 [n, OUT]
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
};

enum class LossKind { CrossEntropy, MeanSquared };

// Fashion-MNIST's shape: 28x28 grey pixels, i.e. 784 inputs per example, and 10 classes.
constexpr int64_t kFashionMnistSide = 28;
constexpr int64_t kFashionMnistInputs = kFashionMnistSide * kFashionMnistSide;
constexpr int64_t kFashionMnistClasses = 10;

// "ce" / "cross-entropy" -> CrossEntropy, "mse" -> MeanSquared; anything else throws gradsync::ConfigError.
LossKind parse_loss_kind(const std::string& name);
// "ce" or "mse" (the canonical CLI spelling).
const char* loss_kind_name(LossKind loss);

// Loads the data set named by `spec` (see above) for a model with `input_size` inputs and `output_size`
// outputs. Throws as described at the top of this file.
Dataset load_dataset(const std::string& spec, int64_t input_size, int64_t output_size, LossKind loss,
                     uint64_t seed);

// synthetic:N, bit-identical to (same libtorch):
//   g = torch.Generator(); g.manual_seed(seed)
//   X = torch.randn(N, IN, generator=g); W = torch.randn(IN, OUT, generator=g); logits = X @ W
//   Y = logits.argmax(dim=1)          # CrossEntropy, int64 [N]
//   Y = logits / math.sqrt(IN)        # MeanSquared, float32 [N, OUT]
Dataset load_synthetic(int64_t n, int64_t input_size, int64_t output_size, LossKind loss, uint64_t seed);

// Fashion-MNIST split "train" (60000 rows) or "test" (10000 rows) from `dir`: inputs float32 [n, 784]
// in [0, 1], targets int64 [n] in [0, 9] (CrossEntropy) or one-hot float32 [n, 10] (MeanSquared).
Dataset load_fashion_mnist(const std::string& dir, const std::string& split, LossKind loss);
// $GRADSYNC_FASHION_MNIST_DIR if set and non-empty, else /usr/share/datasets/fashion-mnist.
std::string fashion_mnist_dir();

// A file written by torch.save({"inputs": X, "targets": Y}, path), validated against the model sizes.
Dataset load_dataset_file(const std::string& path, int64_t input_size, int64_t output_size, LossKind loss);

// Rows `indices` (int64 [k]) of `data`, e.g. one rank's shard or one batch.
Dataset select_rows(const Dataset& data, const torch::Tensor& indices);

// int64 class indices [n] -> float32 one-hot [n, classes].
torch::Tensor one_hot_float(const torch::Tensor& labels, int64_t classes);

}  // namespace gradsync::cli
