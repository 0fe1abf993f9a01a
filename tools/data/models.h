// models: build the models named by a model spec ("mlp:784-256-10", "mlp-bn:784-256-10", "cnn:32-64-10").
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
  bool cnn = false;            // "cnn:C1-C2-OUT": two convolutions on 28x28 single-channel images
  std::vector<int64_t> sizes;  // IN, H1, ..., OUT (at least 2 entries, all > 0); cnn: 784, C1, C2, OUT
  int64_t input_size() const { return sizes.front(); }
  int64_t output_size() const { return sizes.back(); }
};

// Parses "mlp:IN-H1-...-OUT", "mlp-bn:IN-H1-...-OUT" or "cnn:C1-C2-OUT".
// Throws gradsync::ConfigError naming the spec, the offending part and what is allowed.
ModelSpec parse_model_spec(const std::string& spec);

// mlp:    Linear(IN,H1), ReLU, Linear(H1,H2), ReLU, ..., Linear(Hk,OUT)
// mlp-bn: Linear(IN,H1), BatchNorm1d(H1), ReLU, ..., Linear(Hk,OUT)
// cnn:    Unflatten(1, (1, 28, 28)), Conv2d(1, C1, 3, padding=1), ReLU, MaxPool2d(2), Conv2d(C1, C2, 3, padding=1),
//         ReLU, MaxPool2d(2), Flatten, Linear(C2 * 7 * 7, OUT) -- on flattened 784-pixel images; keys 1.*, 4.*, 8.*
// Children are registered as "0", "1", ... exactly like Python's nn.Sequential.
torch::nn::Sequential make_model(const std::string& spec);
torch::nn::Sequential make_model(const ModelSpec& spec);

int64_t model_input_size(const std::string& spec);
int64_t model_output_size(const std::string& spec);

}  // namespace gradsync::cli
