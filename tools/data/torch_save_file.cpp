// Data-set files written by Python's torch.save({"inputs": X, "targets": Y}, path), read with gradsync's
// weights-only reader (common/torch_file.h) and validated against the model's sizes and the loss. See data.h.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "data/data.h"
#include "data/dataset_spec.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"

namespace gradsync::cli {
namespace {

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

bool is_float_dtype(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat64;
}

std::string first_line(const char* text) {
  std::string s = text != nullptr ? text : "";
  const auto nl = s.find('\n');
  if (nl != std::string::npos) s.resize(nl);
  return s;
}

std::vector<char> read_whole_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw ConfigError(
        fmt::format("dataset '{}': cannot open file: {} ({})", path, std::strerror(err), kDatasetSpecs));
  }
  if (S_ISDIR(st.st_mode)) {
    throw ConfigError(fmt::format("dataset '{}' is a directory; {}", path, kDatasetSpecs));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    throw ConfigError(fmt::format("dataset file '{}': cannot open: {}", path, std::strerror(err)));
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
        throw Error(fmt::format("dataset file '{}': read error: {}", path, std::strerror(err)));
      }
      break;
    }
  }
  return data;
}

[[noreturn]] void not_a_torch_file(const std::string& path, const std::string& why) {
  throw ConfigError(fmt::format("dataset file '{}' is not a readable torch.save file ({}); write it with Python "
                                "torch.save({{\"inputs\": X, \"targets\": Y}}, path) (default zip format)",
                                path, why));
}

// The object torch.save stored in the file.
c10::IValue unpickle(const std::string& path) {
  const std::vector<char> bytes = read_whole_file(path);
  try {
    return unpickle_torch_zip(bytes);  // the zip structure is checked first: no read past a cut file's end
  } catch (const ConfigError& e) {
    not_a_torch_file(path, e.what());
  } catch (const c10::Error& e) {
    not_a_torch_file(path, first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    not_a_torch_file(path, first_line(e.what()));
  }
}

// The dict {"inputs": X, "targets": Y} the file must hold (other keys are ignored).
c10::impl::GenericDict root_dict(const c10::IValue& root, const std::string& path) {
  if (!root.isGenericDict()) {
    throw ConfigError(fmt::format(
        "dataset file '{}' holds a {}, expected a dict {{\"inputs\": X, \"targets\": Y}} (a plain dict, "
        "not an OrderedDict)",
        path, root.tagKind()));
  }
  return root.toGenericDict();
}

torch::Tensor dict_tensor(const c10::impl::GenericDict& dict, const std::string& path, const char* key) {
  auto it = dict.find(c10::IValue(std::string(key)));
  if (it == dict.end()) {
    std::vector<std::string> keys;
    for (const auto& entry : dict) {
      keys.push_back(entry.key().isString() ? "'" + entry.key().toStringRef() + "'" : entry.key().tagKind());
    }
    throw ConfigError(fmt::format(
        "dataset file '{}' has no key '{}' (keys: {}); expected a dict with keys 'inputs' and 'targets'", path,
        key, keys.empty() ? std::string("none") : fmt::format("{}", fmt::join(keys, ", "))));
  }
  const c10::IValue& value = it->value();
  if (!value.isTensor()) {
    throw ConfigError(
        fmt::format("dataset file '{}': '{}' is a {}, expected a tensor", path, key, value.tagKind()));
  }
  torch::Tensor t = value.toTensor();
  if (t.layout() != torch::kStrided) {
    throw ConfigError(fmt::format(
        "dataset file '{}': '{}' is a sparse or otherwise non-dense tensor, expected a dense tensor", path, key));
  }
  return t.detach();
}

void check_finite(const torch::Tensor& t, const std::string& path, const char* key) {
  if (!torch::isfinite(t).all().item<bool>()) {
    const auto bad = torch::nonzero(torch::isfinite(t).logical_not().reshape({-1}))[0].item<int64_t>();
    throw ConfigError(fmt::format(
        "dataset file '{}': '{}' contains a non-finite value (NaN or infinity) at flat index {}; all values "
        "must be finite",
        path, key, bad));
  }
}

// inputs: float32/float64 [n, ...] -> float32 [n, IN], contiguous, every value finite.
torch::Tensor checked_inputs(const torch::Tensor& x, const std::string& path, int64_t input_size) {
  if (!is_float_dtype(x)) {
    throw ConfigError(fmt::format("dataset file '{}': 'inputs' has dtype {}, expected float32 or float64", path,
                                  dtype_str(x)));
  }
  if (x.dim() < 1) {
    throw ConfigError(fmt::format(
        "dataset file '{}': 'inputs' is a scalar, expected a tensor [n, ...] with one row per example", path));
  }
  const int64_t n = x.size(0);
  if (n == 0) {
    throw ConfigError(fmt::format("dataset file '{}': 'inputs' has 0 rows (shape {}), expected at least one",
                                  path, shape_str(x)));
  }
  const int64_t width = x.numel() / n;
  if (width != input_size) {
    throw ConfigError(fmt::format(
        "dataset file '{}': 'inputs' of shape {} flattens to {} features per row, but the model takes {} "
        "inputs",
        path, shape_str(x), width, input_size));
  }
  auto flat = x.reshape({n, width}).to(torch::kFloat32).contiguous();
  check_finite(flat, path, "inputs");
  return flat;
}

// CrossEntropy: int64 class indices [n], each in [0, OUT).
torch::Tensor class_targets(const torch::Tensor& y, const std::string& path, int64_t n, int64_t output_size) {
  if (y.scalar_type() != torch::kInt64) {
    throw ConfigError(fmt::format(
        "dataset file '{}': 'targets' has dtype {}, but loss ce needs int64 class indices [n]{}", path,
        dtype_str(y), is_float_dtype(y) ? " (float targets need loss mse)" : ""));
  }
  if (y.dim() != 1) {
    throw ConfigError(
        fmt::format("dataset file '{}': 'targets' has shape {}, but loss ce needs class indices of shape [{}]",
                    path, shape_str(y), n));
  }
  auto classes = y.contiguous();
  const auto bad = torch::nonzero(classes.lt(0).logical_or(classes.ge(output_size)));
  if (bad.size(0) > 0) {
    const int64_t row = bad[0][0].item<int64_t>();
    throw ConfigError(fmt::format("dataset file '{}': target {} at row {} is outside the model's classes [0, {})",
                                  path, classes[row].item<int64_t>(), row, output_size));
  }
  return classes;
}

// MeanSquared: float32/float64 [n, OUT] ([n] too when OUT = 1) -> float32 [n, OUT], every value finite.
torch::Tensor regression_targets(const torch::Tensor& y, const std::string& path, int64_t n, int64_t output_size) {
  if (!is_float_dtype(y)) {
    throw ConfigError(fmt::format(
        "dataset file '{}': 'targets' has dtype {}, but loss mse needs float32 or float64 targets [n, {}]", path,
        dtype_str(y), output_size));
  }
  const auto rows = y.dim() == 1 && output_size == 1 ? y.reshape({n, 1}) : y;
  if (rows.dim() != 2 || rows.size(1) != output_size) {
    throw ConfigError(fmt::format(
        "dataset file '{}': 'targets' has shape {}, but loss mse with a model of {} outputs needs [{}, {}]", path,
        shape_str(rows), output_size, n, output_size));
  }
  auto values = rows.to(torch::kFloat32).contiguous();
  check_finite(values, path, "targets");
  return values;
}

// targets: one row per example of the `n` inputs, in the form `loss` needs.
torch::Tensor checked_targets(const torch::Tensor& y, const std::string& path, int64_t n, int64_t output_size,
                              LossKind loss) {
  if (y.dim() < 1 || y.size(0) != n) {
    throw ConfigError(fmt::format(
        "dataset file '{}': 'targets' has shape {} but 'inputs' has {} rows; both need one row per example", path,
        shape_str(y), n));
  }
  return loss == LossKind::CrossEntropy ? class_targets(y, path, n, output_size)
                                        : regression_targets(y, path, n, output_size);
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> read_dataset_file_tensors(const std::string& path) {
  const auto dict = root_dict(unpickle(path), path);
  return {dict_tensor(dict, path, "inputs"), dict_tensor(dict, path, "targets")};
}

Dataset load_dataset_file(const std::string& path, int64_t input_size, int64_t output_size, LossKind loss) {
  check_model_sizes(input_size, output_size);
  const auto dict = root_dict(unpickle(path), path);
  const torch::Tensor x = dict_tensor(dict, path, "inputs");
  const torch::Tensor y = dict_tensor(dict, path, "targets");
  const torch::Tensor inputs = checked_inputs(x, path, input_size);
  return Dataset{inputs, checked_targets(y, path, inputs.size(0), output_size, loss)};
}

}  // namespace gradsync::cli
