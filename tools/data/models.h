// models: build the MLPs named by a model spec ("mlp:784-256-10", "mlp-bn:784-256-10").
//
// The returned Sequential has exactly the state-dict keys of the equivalent Python nn.Sequential
// ("0.weight", "0.bias", "2.weight", ...), so checkpoints move between the two unchanged.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gradsync::cli {

// A parsed model spec.
struct ModelSpec {
  bool batch_norm = false;     // "mlp-bn": Linear, BatchNorm1d, ReLU per hidden layer
  std::vector<int64_t> sizes;  // IN, H1, ..., OUT (at least 2 entries, all > 0)
  int64_t input_size() const { return sizes.front(); }
  int64_t output_size() const { return sizes.back(); }
};

// Parses "mlp:IN-H1-...-OUT" or "mlp-bn:IN-H1-...-OUT".
// Throws gradsync::ConfigError naming the spec, the offending part and what is allowed.
ModelSpec parse_model_spec(const std::string& spec);

// mlp:    Linear(IN,H1), ReLU, Linear(H1,H2), ReLU, ..., Linear(Hk,OUT)
// mlp-bn: Linear(IN,H1), BatchNorm1d(H1), ReLU, ..., Linear(Hk,OUT)
// Children are registered as "0", "1", ... exactly like Python's nn.Sequential.
torch::nn::Sequential make_model(const std::string& spec);
torch::nn::Sequential make_model(const ModelSpec& spec);

int64_t model_input_size(const std::string& spec);
int64_t model_output_size(const std::string& spec);

}  // namespace gradsync::cli
