// models: model-spec parsing and construction. See models.h.
#include "data/models.h"

#include <fmt/format.h>

#include <limits>

#include "data/gpt_model.h"
#include "data/res_model.h"
#include "gradsync/error.h"

namespace gradsync::cli {
namespace {

constexpr const char* kAllowedSpecs =
    "expected mlp:IN-H...-OUT, mlp-bn:IN-H...-OUT, cnn:C1-C2-OUT, res:IN-H-B-OUT or gpt:V-T-D-L-H";
constexpr int64_t kImageSide = 28;  // cnn: Fashion-MNIST's single-channel 28x28 images, flattened

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw ConfigError(fmt::format("model spec '{}': {}; {}", spec, why, kAllowedSpecs));
}

// Strictly digits, no sign, no whitespace, > 0, fits in int64.
int64_t parse_layer_size(const std::string& spec, const std::string& text) {
  if (text.empty()) bad_spec(spec, "empty layer size (two '-' in a row, or a leading/trailing '-')");
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') bad_spec(spec, fmt::format("'{}' is not a positive integer", text));
    const int digit = c - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) {
      bad_spec(spec, fmt::format("layer size '{}' is too large", text));
    }
    value = value * 10 + digit;
  }
  if (value <= 0) bad_spec(spec, fmt::format("'{}' is not a positive integer", text));
  return value;
}

}  // namespace

ModelSpec parse_model_spec(const std::string& spec) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos) {
    bad_spec(spec, "missing ':' between the model kind and the layer sizes");
  }
  const std::string kind = spec.substr(0, colon);
  ModelSpec out;
  if (kind == "mlp") {
    out.batch_norm = false;
  } else if (kind == "mlp-bn") {
    out.batch_norm = true;
  } else if (kind == "cnn") {
    out.cnn = true;
  } else if (kind == "res") {
    out.res = true;
  } else if (kind == "gpt") {
    out.gpt = true;
  } else {
    bad_spec(spec, fmt::format("unknown model kind '{}' (known kinds: mlp, mlp-bn, cnn, res, gpt)", kind));
  }
  const std::string sizes = spec.substr(colon + 1);
  if (sizes.empty()) bad_spec(spec, "no layer sizes after ':'");
  std::size_t start = 0;
  while (true) {
    const auto dash = sizes.find('-', start);
    const std::string part =
        sizes.substr(start, dash == std::string::npos ? std::string::npos : dash - start);
    out.sizes.push_back(parse_layer_size(spec, part));
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  if (out.cnn) {
    if (out.sizes.size() != 3) {
      bad_spec(spec, fmt::format("cnn takes exactly three sizes (channels C1, C2 and outputs), got {}",
                                 out.sizes.size()));
    }
    out.sizes.insert(out.sizes.begin(), kImageSide * kImageSide);
  }
  if (out.res && out.sizes.size() != 4) {
    bad_spec(spec, fmt::format("res takes exactly four sizes (inputs, width, blocks, outputs), got {}",
                               out.sizes.size()));
  }
  if (out.gpt && out.sizes.size() != 5) {
    bad_spec(spec, fmt::format("gpt takes exactly five sizes (vocabulary, context, width, blocks, heads), got {}",
                               out.sizes.size()));
  }
  if (out.gpt && out.sizes[2] % out.sizes[4] != 0) {
    bad_spec(spec, fmt::format("gpt's width {} is not a multiple of its {} heads", out.sizes[2], out.sizes[4]));
  }
  if (out.sizes.size() < 2) {
    bad_spec(spec, fmt::format("got {} layer size, need at least two (input and output)", out.sizes.size()));
  }
  return out;
}

namespace {

// Python: nn.Sequential(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, C1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
// nn.Conv2d(C1, C2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(C2 * 7 * 7, OUT)).
torch::nn::Sequential make_cnn(int64_t c1, int64_t c2, int64_t out) {
  namespace nn = torch::nn;
  const int64_t pooled = kImageSide / 4;
  return nn::Sequential(nn::Unflatten(nn::UnflattenOptions(1, {1, kImageSide, kImageSide})),
                        nn::Conv2d(nn::Conv2dOptions(1, c1, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(c1, c2, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Flatten(), nn::Linear(c2 * pooled * pooled, out));
}

torch::nn::Sequential make_mlp(const ModelSpec& spec) {
  torch::nn::Sequential model;
  const std::size_t layers = spec.sizes.size() - 1;
  for (std::size_t i = 0; i < layers; ++i) {
    const int64_t in = spec.sizes[i];
    const int64_t out = spec.sizes[i + 1];
    model->push_back(torch::nn::Linear(in, out));
    if (i + 1 < layers) {
      if (spec.batch_norm) model->push_back(torch::nn::BatchNorm1d(out));
      model->push_back(torch::nn::ReLU());
    }
  }
  return model;
}

}  // namespace

torch::nn::Sequential Model::sequential() const {
  auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(ref_.module);
  if (!sequential) throw ConfigError(fmt::format("the model ({}) is not a Sequential", ref_.module->name()));
  return torch::nn::Sequential(sequential);
}

Model make_model(const ModelSpec& spec) {
  if (spec.sizes.size() < 2) {
    throw ConfigError(
        fmt::format("model spec has {} layer sizes, need at least two (input and output)", spec.sizes.size()));
  }
  if (spec.cnn) return Model(make_cnn(spec.sizes[1], spec.sizes[2], spec.sizes[3]));
  if (spec.res) return Model(res::Res(spec.sizes[0], spec.sizes[1], spec.sizes[2], spec.sizes[3]));
  if (spec.gpt) return Model(gpt::Gpt(gpt::GptSizes{spec.sizes[0], spec.sizes[1], spec.sizes[2], spec.sizes[3],
                                                    spec.sizes[4]}));
  return Model(make_mlp(spec));
}

Model make_model(const std::string& spec) { return make_model(parse_model_spec(spec)); }

int64_t model_input_size(const std::string& spec) { return parse_model_spec(spec).input_size(); }

int64_t model_output_size(const std::string& spec) { return parse_model_spec(spec).output_size(); }

}  // namespace gradsync::cli
