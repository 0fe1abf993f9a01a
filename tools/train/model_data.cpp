// The model, its data and --freeze for `gradsync train` (see model_data.h).
#include "train/model_data.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "gradsync/fsdp.h"

namespace gradsync::cli {

void to_dtype(torch::nn::Module& model, c10::ScalarType dtype) {
  // Module::to(dtype) would convert every tensor, BatchNorm's int64 num_batches_tracked too (Python's only the
  // floating ones); set_data keeps each tensor's identity, so optimizers and engines built later see the new data.
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    if (p.is_floating_point() && p.scalar_type() != dtype) p.set_data(p.to(dtype));
  }
  for (auto& b : model.buffers()) {
    if (b.is_floating_point() && b.scalar_type() != dtype) b.set_data(b.to(dtype));
  }
}

Model build_model(const TrainConfig& c) {
  auto model = make_model(c.model);
  to_dtype(*model, parse_dtype(c.dtype));
  return model;
}

void freeze_parameters(const TrainConfig& c, const Model& model) {
  for (const auto& prefix : c.freeze) {
    int64_t frozen = 0;
    std::vector<std::string> names;
    for (const auto& p : model->named_parameters(/*recurse=*/true)) {
      names.push_back(p.key());
      if (p.key().rfind(prefix, 0) != 0) continue;
      p.value().set_requires_grad(false);
      ++frozen;
    }
    if (frozen == 0) {
      throw ConfigError(fmt::format("--freeze {}: no parameter name starts with it; the parameters are {}", prefix,
                                    fmt::join(names, ", ")));
    }
  }
  const auto params = model->parameters();
  if (!c.freeze.empty() && std::none_of(params.begin(), params.end(), [](const auto& p) { return p.requires_grad(); })) {
    throw ConfigError(fmt::format("--freeze {}: every parameter would be frozen, leaving nothing to train",
                                  fmt::join(c.freeze, ",")));
  }
}

void check_sync_bn(const TrainConfig& c) {
  if (!c.sync_bn) return;
  if (!parse_model_spec(c.model).batch_norm) {
    throw ConfigError(fmt::format("--sync-bn synchronises BatchNorm statistics, and --model {} has no BatchNorm "
                                  "(mlp-bn:IN-H...-OUT has one per hidden layer)", c.model));
  }
  if (c.strategy == Strategy::Local) {
    throw ConfigError("--sync-bn with --strategy local: one process already normalises over its whole batch; "
                      "use a data-parallel strategy");
  }
}

void check_model_data(const TrainConfig& c) {
  const auto spec = parse_model_spec(c.model);
  if (!spec.gpt) {
    if (is_text_spec(c.data)) {
      throw ConfigError(fmt::format("--data {} is text (token sequences) for a gpt model; --model {} takes rows of "
                                    "numbers", c.data, c.model));
    }
    if (c.sample > 0) throw ConfigError(fmt::format("--sample generates text with a gpt model, not {}", c.model));
    return;
  }
  if (c.loss != "ce") {
    throw ConfigError(fmt::format("--loss {} with --model {}: a gpt model predicts tokens; use --loss ce", c.loss,
                                  c.model));
  }
  if (c.sample > 0 && spec.output_size() != 256) {
    throw ConfigError(fmt::format("--sample prints bytes; --model {} has a vocabulary of {}, not 256", c.model,
                                  spec.output_size()));
  }
}

Dataset load_data(const TrainConfig& c, const std::string& spec, uint64_t seed) {
  const auto model = parse_model_spec(c.model);
  if (model.gpt) return load_token_dataset(spec, model.output_size(), model.input_size(), seed);
  auto data = load_dataset(spec, model.input_size(), model.output_size(), parse_loss_kind(c.loss), seed);
  const auto dtype = parse_dtype(c.dtype);
  data.inputs = data.inputs.to(dtype);
  if (data.targets.is_floating_point()) data.targets = data.targets.to(dtype);
  return data;
}

}  // namespace gradsync::cli
