// data: the data sets the `gradsync` CLI trains on, as whole in-memory tensors.
//
// Dataset specs (load_dataset):
//   fashion-mnist[:train|:test]  Debian's dataset-fashion-mnist (gzipped IDX files, read with zlib);
//                                directory overridable by $GRADSYNC_FASHION_MNIST_DIR.
//   synthetic:N                  N random rows, reproducible from the seed and bit-identical to the Python
//                                recipe documented at load_synthetic().
//   PATH                         a file written by Python torch.save({"inputs": X, "targets": Y}, PATH).
//
// Token specs (load_token_dataset, for the gpt model; token_data.cpp):
//   fortunes[:train|:test]       Debian's fortunes package, every fortune a document ($GRADSYNC_FORTUNES_DIR
//                                overrides /usr/share/games/fortunes; its files without a '.' in their names)
//   text:PATH, text-test:PATH    documents separated by lines holding only '%'
//   PATH                         torch.save({"inputs": int64 [S, L], "targets": int64 [S, L]}), L <= the context,
//                                targets -100 where a position is not trained on
// Text is bytes as tokens (a vocabulary of 256). Document i (over all files, in order) is held out (:test,
// text-test:) iff i % 10 == 9. A document of n bytes gives sequences of up to T + 1 bytes starting at 0, T, 2T, ...
// (while start + 1 < n): inputs its first bytes right-padded with 0 to T, targets the bytes after each, -100 past
// the end. So sequence lengths vary as in real fine-tuning, and a sample's items are its targets != -100.
//
// Errors: gradsync::ConfigError for bad input (a bad spec, a missing, unreadable or corrupt file, wrong
// shapes/dtypes/values), gradsync::Error for other failures (a read error, zlib out of memory); each message
// names the spec or path, the offending value and what is allowed. One file per loader: data.cpp (the specs),
// fashion_mnist.cpp, synthetic.cpp, torch_save_file.cpp.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gradsync::cli {

// A target position that is not trained on (PyTorch's cross_entropy ignore_index default).
inline constexpr int64_t kIgnoreIndex = -100;

struct Dataset {
  torch::Tensor inputs;   // float32 [n, IN], contiguous (images are flattened); tokens: int64 [n, L]
  torch::Tensor targets;  // CrossEntropy: int64 [n] in [0, OUT); MeanSquared: float32 [n, OUT]; tokens: int64 [n, L]
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
  // Token data: a sample is a sequence, its items the targets != kIgnoreIndex.
  bool tokens() const { return targets.defined() && targets.dim() == 2 && targets.scalar_type() == torch::kLong; }
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

// The tensors 'inputs' and 'targets' of a torch.save'd dict, unchecked (ConfigError naming the file otherwise).
std::pair<torch::Tensor, torch::Tensor> read_dataset_file_tensors(const std::string& path);

// A token spec (see the top of this file) for a gpt model of vocabulary `vocab` and context `context`; also
// synthetic:N, N sequences of T random tokens (from `seed`) with every position a target.
Dataset load_token_dataset(const std::string& spec, int64_t vocab, int64_t context, uint64_t seed);
// fortunes[...], text:... or text-test:...
bool is_text_spec(const std::string& spec);
// $GRADSYNC_FORTUNES_DIR if set and non-empty, else /usr/share/games/fortunes.
std::string fortunes_dir();
// A text's documents: lines holding only '%' separate them; each other line adds its bytes and a newline;
// documents under 2 bytes are dropped.
std::vector<std::string> split_documents(const std::string& text);

// Rows `indices` (int64 [k]) of `data`, e.g. one rank's shard or one batch.
Dataset select_rows(const Dataset& data, const torch::Tensor& indices);

// int64 class indices [n] -> float32 one-hot [n, classes].
torch::Tensor one_hot_float(const torch::Tensor& labels, int64_t classes);

}  // namespace gradsync::cli
