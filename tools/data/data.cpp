// data: Fashion-MNIST (gzipped IDX via zlib), reproducible synthetic data, and torch.save dataset files.
// See data.h.
#include "data/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

namespace gradsync::cli {
namespace {

constexpr const char* kDatasetSpecs =
    "expected fashion-mnist[:train|:test], synthetic:N, or the path of a file written by "
    "torch.save({\"inputs\": X, \"targets\": Y}, path)";
constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";
constexpr int64_t kFashionMnistSide = 28;
constexpr int64_t kFashionMnistClasses = 10;

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

std::string shape_str(const torch::Tensor& t) { return fmt::format("{}", t.sizes()); }

// Python's spelling (torch.float32, ...), which is what users wrote.
std::string dtype_str(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return "float32";
    case torch::kFloat64:
      return "float64";
    case torch::kFloat16:
      return "float16";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kInt64:
      return "int64";
    case torch::kInt32:
      return "int32";
    case torch::kInt16:
      return "int16";
    case torch::kInt8:
      return "int8";
    case torch::kUInt8:
      return "uint8";
    case torch::kBool:
      return "bool";
    default:
      return std::string(c10::toString(t.scalar_type()));
  }
}

void check_model_sizes(int64_t input_size, int64_t output_size) {
  if (input_size <= 0 || output_size <= 0) {
    throw std::invalid_argument(fmt::format(
        "model input size {} / output size {}: both must be positive integers", input_size, output_size));
  }
}

// ---- Fashion-MNIST ---------------------------------------------------------------------------------

struct GzCloser {
  void operator()(gzFile_s* f) const {
    if (f != nullptr) gzclose(f);
  }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

GzHandle open_idx(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw std::runtime_error(fmt::format(
        "Fashion-MNIST file '{}': {}. Install the data set with `apt-get install dataset-fashion-mnist` "
        "(or `make deps`), or point GRADSYNC_FASHION_MNIST_DIR at a directory holding "
        "{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte.gz",
        path, std::strerror(err)));
  }
  if (S_ISDIR(st.st_mode)) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' is a directory, expected a gzipped IDX file", path));
  }
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    throw std::runtime_error(
        fmt::format("cannot open Fashion-MNIST file '{}': {}", path,
                    err != 0 ? std::strerror(err) : "zlib could not allocate its state"));
  }
  gzbuffer(f, 1 << 17);
  return GzHandle(f);
}

// Reads exactly `n` bytes; throws naming `what` if the stream ends early or is corrupt.
void read_exact(gzFile f, const std::string& path, void* dst, int64_t n, const char* what) {
  auto* out = static_cast<unsigned char*>(dst);
  int64_t done = 0;
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 24));
    const int got = gzread(f, out + done, chunk);
    if (got < 0) {
      int zerr = 0;
      const char* msg = gzerror(f, &zerr);
      throw std::runtime_error(fmt::format("Fashion-MNIST file '{}' is corrupt while reading the {}: {}",
                                           path, what, msg != nullptr ? msg : "zlib error"));
    }
    if (got == 0) {
      throw std::runtime_error(
          fmt::format("Fashion-MNIST file '{}' is truncated: the {} need {} bytes but only {} are present",
                      path, what, n, done));
    }
    done += got;
  }
}

uint32_t read_be32(gzFile f, const std::string& path, const char* what) {
  unsigned char b[4];
  read_exact(f, path, b, 4, what);
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

void expect_eof(gzFile f, const std::string& path, int64_t expected_bytes) {
  unsigned char extra;
  const int got = gzread(f, &extra, 1);
  if (got != 0) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' has {} than the {} bytes its header declares", path,
                    got > 0 ? "more data" : "a corrupt end, after reading", expected_bytes));
  }
}

constexpr uint32_t kImagesMagic = 2051;
constexpr uint32_t kLabelsMagic = 2049;
constexpr uint32_t kMaxIdxItems = 10'000'000;  // guards the allocation against a corrupt header

torch::Tensor read_idx_images(const std::string& path) {
  GzHandle h = open_idx(path);
  gzFile f = h.get();
  const uint32_t magic = read_be32(f, path, "header");
  if (magic != kImagesMagic) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' has magic number {}, expected {} (an IDX3 image file)", path,
                    magic, kImagesMagic));
  }
  const uint32_t count = read_be32(f, path, "header");
  const uint32_t rows = read_be32(f, path, "header");
  const uint32_t cols = read_be32(f, path, "header");
  if (rows != kFashionMnistSide || cols != kFashionMnistSide) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' has {}x{} images, expected 28x28", path, rows, cols));
  }
  if (count == 0 || count > kMaxIdxItems) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' declares {} images, expected 1..{}", path, count, kMaxIdxItems));
  }
  const int64_t pixels = kFashionMnistSide * kFashionMnistSide;
  auto bytes = torch::empty({static_cast<int64_t>(count), pixels}, torch::kUInt8);
  read_exact(f, path, bytes.data_ptr<uint8_t>(), bytes.numel(), "pixels");
  expect_eof(f, path, 16 + bytes.numel());
  return bytes.to(torch::kFloat32).div_(255.0f);
}

torch::Tensor read_idx_labels(const std::string& path) {
  GzHandle h = open_idx(path);
  gzFile f = h.get();
  const uint32_t magic = read_be32(f, path, "header");
  if (magic != kLabelsMagic) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' has magic number {}, expected {} (an IDX1 label file)", path,
                    magic, kLabelsMagic));
  }
  const uint32_t count = read_be32(f, path, "header");
  if (count == 0 || count > kMaxIdxItems) {
    throw std::runtime_error(
        fmt::format("Fashion-MNIST file '{}' declares {} labels, expected 1..{}", path, count, kMaxIdxItems));
  }
  auto bytes = torch::empty({static_cast<int64_t>(count)}, torch::kUInt8);
  read_exact(f, path, bytes.data_ptr<uint8_t>(), bytes.numel(), "labels");
  expect_eof(f, path, 8 + bytes.numel());
  const uint8_t* p = bytes.data_ptr<uint8_t>();
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    if (p[i] >= kFashionMnistClasses) {
      throw std::runtime_error(
          fmt::format("Fashion-MNIST file '{}': label {} at index {} is outside 0..9", path, int{p[i]}, i));
    }
  }
  return bytes.to(torch::kInt64);
}

// ---- torch.save files ------------------------------------------------------------------------------

std::vector<char> read_whole_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw std::runtime_error(
        fmt::format("dataset '{}': cannot open file: {} ({})", path, std::strerror(err), kDatasetSpecs));
  }
  if (S_ISDIR(st.st_mode)) {
    throw std::runtime_error(fmt::format("dataset '{}' is a directory; {}", path, kDatasetSpecs));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    throw std::runtime_error(fmt::format("dataset file '{}': cannot open: {}", path, std::strerror(err)));
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> guard(f, &std::fclose);
  std::vector<char> data;
  char buf[1 << 16];
  while (true) {
    const std::size_t got = std::fread(buf, 1, sizeof buf, f);
    data.insert(data.end(), buf, buf + got);
    if (got < sizeof buf) {
      if (std::ferror(f)) {
        const int err = errno;
        throw std::runtime_error(fmt::format("dataset file '{}': read error: {}", path, std::strerror(err)));
      }
      break;
    }
  }
  return data;
}

std::string first_line(const char* text) {
  std::string s = text != nullptr ? text : "";
  const auto nl = s.find('\n');
  if (nl != std::string::npos) s.resize(nl);
  return s;
}

torch::Tensor dict_tensor(const c10::impl::GenericDict& dict, const std::string& path, const char* key) {
  auto it = dict.find(c10::IValue(std::string(key)));
  if (it == dict.end()) {
    std::vector<std::string> keys;
    for (const auto& entry : dict) {
      keys.push_back(entry.key().isString() ? "'" + entry.key().toStringRef() + "'" : entry.key().tagKind());
    }
    throw std::invalid_argument(fmt::format(
        "dataset file '{}' has no key '{}' (keys: {}); expected a dict with keys 'inputs' and 'targets'",
        path, key, keys.empty() ? std::string("none") : fmt::format("{}", fmt::join(keys, ", "))));
  }
  const c10::IValue& value = it->value();
  if (!value.isTensor()) {
    throw std::invalid_argument(
        fmt::format("dataset file '{}': '{}' is a {}, expected a tensor", path, key, value.tagKind()));
  }
  torch::Tensor t = value.toTensor();
  if (t.layout() != torch::kStrided) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': '{}' is a sparse or otherwise non-dense tensor, expected a dense tensor", path,
        key));
  }
  return t.detach();
}

bool is_float_dtype(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat64;
}

void check_finite(const torch::Tensor& t, const std::string& path, const char* key) {
  if (!torch::isfinite(t).all().item<bool>()) {
    const auto bad = torch::nonzero(torch::isfinite(t).logical_not().reshape({-1}))[0].item<int64_t>();
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': '{}' contains a non-finite value (NaN or infinity) at flat index {}; all values "
        "must be finite",
        path, key, bad));
  }
}

}  // namespace

LossKind parse_loss_kind(const std::string& name) {
  if (name == "ce" || name == "cross-entropy") return LossKind::CrossEntropy;
  if (name == "mse") return LossKind::MeanSquared;
  throw std::invalid_argument(
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

std::string fashion_mnist_dir() {
  const char* env = std::getenv("GRADSYNC_FASHION_MNIST_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return kDefaultFashionMnistDir;
}

Dataset load_fashion_mnist(const std::string& dir, const std::string& split, LossKind loss) {
  std::string prefix;
  if (split == "train") {
    prefix = "train";
  } else if (split == "test") {
    prefix = "t10k";
  } else {
    throw std::invalid_argument(
        fmt::format("fashion-mnist split '{}' is unknown; expected train or test", split));
  }
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  const std::string images_path = base + prefix + "-images-idx3-ubyte.gz";
  const std::string labels_path = base + prefix + "-labels-idx1-ubyte.gz";
  torch::Tensor images = read_idx_images(images_path);
  torch::Tensor labels = read_idx_labels(labels_path);
  if (images.size(0) != labels.size(0)) {
    throw std::runtime_error(fmt::format("Fashion-MNIST: '{}' has {} images but '{}' has {} labels",
                                         images_path, images.size(0), labels_path, labels.size(0)));
  }
  if (loss == LossKind::MeanSquared) labels = one_hot_float(labels, kFashionMnistClasses);
  return Dataset{images, labels};
}

Dataset load_synthetic(int64_t n, int64_t input_size, int64_t output_size, LossKind loss, uint64_t seed) {
  check_model_sizes(input_size, output_size);
  if (n <= 0) {
    throw std::invalid_argument(fmt::format("synthetic data set size {} must be a positive integer", n));
  }
  if (n > std::numeric_limits<int64_t>::max() / input_size ||
      input_size > std::numeric_limits<int64_t>::max() / output_size) {
    throw std::invalid_argument(
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

Dataset load_dataset_file(const std::string& path, int64_t input_size, int64_t output_size, LossKind loss) {
  check_model_sizes(input_size, output_size);
  const std::vector<char> bytes = read_whole_file(path);
  c10::IValue root;
  try {
    root = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    // torch.save(OrderedDict(...)) (e.g. torch.save(model.state_dict())) fails inside pickle_load.
    if (std::string(e.what_without_backtrace()).find("Expected GenericDict but got None") !=
        std::string::npos) {
      throw std::runtime_error(fmt::format(
          "dataset file '{}' holds a dict type libtorch cannot read (an OrderedDict?); save a plain dict: "
          "torch.save({{\"inputs\": X, \"targets\": Y}}, path)",
          path));
    }
    throw std::runtime_error(
        fmt::format("dataset file '{}' is not a readable torch.save file ({}); write it with Python "
                    "torch.save({{\"inputs\": X, \"targets\": Y}}, path) (default zip format)",
                    path, first_line(e.what_without_backtrace())));
  } catch (const std::exception& e) {
    throw std::runtime_error(
        fmt::format("dataset file '{}' is not a readable torch.save file ({}); write it with Python "
                    "torch.save({{\"inputs\": X, \"targets\": Y}}, path) (default zip format)",
                    path, first_line(e.what())));
  }
  if (!root.isGenericDict()) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}' holds a {}, expected a dict {{\"inputs\": X, \"targets\": Y}} (a plain dict, "
        "not an OrderedDict)",
        path, root.tagKind()));
  }
  const auto dict = root.toGenericDict();
  torch::Tensor x = dict_tensor(dict, path, "inputs");
  torch::Tensor y = dict_tensor(dict, path, "targets");

  // inputs: float32/float64 [n, ...] -> float32 [n, IN]
  if (!is_float_dtype(x)) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': 'inputs' has dtype {}, expected float32 or float64", path, dtype_str(x)));
  }
  if (x.dim() < 1) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': 'inputs' is a scalar, expected a tensor [n, ...] with one row per example",
        path));
  }
  const int64_t n = x.size(0);
  if (n == 0) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': 'inputs' has 0 rows (shape {}), expected at least one", path, shape_str(x)));
  }
  const int64_t width = x.numel() / n;
  if (width != input_size) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': 'inputs' of shape {} flattens to {} features per row, but the model takes {} "
        "inputs",
        path, shape_str(x), width, input_size));
  }
  x = x.reshape({n, width}).to(torch::kFloat32).contiguous();
  check_finite(x, path, "inputs");

  if (y.dim() < 1 || y.size(0) != n) {
    throw std::invalid_argument(fmt::format(
        "dataset file '{}': 'targets' has shape {} but 'inputs' has {} rows; both need one row per example",
        path, shape_str(y), n));
  }
  if (loss == LossKind::CrossEntropy) {
    if (y.scalar_type() != torch::kInt64) {
      throw std::invalid_argument(fmt::format(
          "dataset file '{}': 'targets' has dtype {}, but loss ce needs int64 class indices [n]{}", path,
          dtype_str(y), is_float_dtype(y) ? " (float targets need loss mse)" : ""));
    }
    if (y.dim() != 1) {
      throw std::invalid_argument(fmt::format(
          "dataset file '{}': 'targets' has shape {}, but loss ce needs class indices of shape [{}]", path,
          shape_str(y), n));
    }
    y = y.contiguous();
    const auto bad = torch::nonzero(y.lt(0).logical_or(y.ge(output_size)));
    if (bad.size(0) > 0) {
      const int64_t row = bad[0][0].item<int64_t>();
      throw std::invalid_argument(
          fmt::format("dataset file '{}': target {} at row {} is outside the model's classes [0, {})", path,
                      y[row].item<int64_t>(), row, output_size));
    }
  } else {
    if (!is_float_dtype(y)) {
      throw std::invalid_argument(fmt::format(
          "dataset file '{}': 'targets' has dtype {}, but loss mse needs float32 or float64 targets [n, {}]",
          path, dtype_str(y), output_size));
    }
    if (y.dim() == 1 && output_size == 1) y = y.reshape({n, 1});
    if (y.dim() != 2 || y.size(1) != output_size) {
      throw std::invalid_argument(fmt::format(
          "dataset file '{}': 'targets' has shape {}, but loss mse with a model of {} outputs needs [{}, {}]",
          path, shape_str(y), output_size, n, output_size));
    }
    y = y.to(torch::kFloat32).contiguous();
    check_finite(y, path, "targets");
  }
  return Dataset{x, y};
}

Dataset load_dataset(const std::string& spec, int64_t input_size, int64_t output_size, LossKind loss,
                     uint64_t seed) {
  check_model_sizes(input_size, output_size);
  if (spec.empty()) throw std::invalid_argument(fmt::format("dataset spec is empty; {}", kDatasetSpecs));

  if (spec == "synthetic" || starts_with(spec, "synthetic:")) {
    const std::string count = spec.size() > 10 ? spec.substr(10) : "";
    const int64_t n = parse_positive(count);
    if (n <= 0) {
      throw std::invalid_argument(fmt::format(
          "dataset spec '{}': '{}' is not a positive integer; expected synthetic:N with N the number of rows",
          spec, count));
    }
    return load_synthetic(n, input_size, output_size, loss, seed);
  }

  if (spec == "fashion-mnist" || starts_with(spec, "fashion-mnist:")) {
    const std::string split = spec == "fashion-mnist" ? std::string("train") : spec.substr(14);
    if (split != "train" && split != "test") {
      throw std::invalid_argument(fmt::format(
          "dataset spec '{}': split '{}' is unknown; expected fashion-mnist, fashion-mnist:train or "
          "fashion-mnist:test",
          spec, split));
    }
    const int64_t pixels = kFashionMnistSide * kFashionMnistSide;
    if (input_size != pixels) {
      throw std::invalid_argument(fmt::format(
          "dataset '{}' has {} inputs per example (28x28 pixels) but the model takes {}; use a model spec "
          "like mlp:784-256-10",
          spec, pixels, input_size));
    }
    if (output_size != kFashionMnistClasses) {
      throw std::invalid_argument(fmt::format(
          "dataset '{}' has {} classes but the model has {} outputs; use a model spec ending in -10", spec,
          kFashionMnistClasses, output_size));
    }
    return load_fashion_mnist(fashion_mnist_dir(), split, loss);
  }

  return load_dataset_file(spec, input_size, output_size, loss);
}

}  // namespace gradsync::cli
