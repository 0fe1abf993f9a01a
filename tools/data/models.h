// models: build the models named by a model spec ("mlp:784-256-10", "mlp-bn:784-256-10", "cnn:32-64-10",
// "res:784-64-2-10", "gpt:256-128-256-4-4").
//
// Every model has exactly the state-dict keys of the equivalent Python module ("0.weight", "0.bias", ... for the
// Sequentials; "inp.weight", "blocks.0.norm.weight", ... for res), so checkpoints move between the two unchanged.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/engine.h"

namespace gradsync::cli {

// A model built from a spec: the module and its forward, whatever its type; engines take it as a ModuleRef.
class Model {
 public:
  Model() = default;
  explicit Model(const ModuleRef& ref) : ref_(ref) {}
  torch::Tensor forward(const torch::Tensor& x) const { return ref_.forward(x); }
  torch::nn::Module* operator->() const { return ref_.module.get(); }
  torch::nn::Module& operator*() const { return *ref_.module; }
  operator const ModuleRef&() const { return ref_; }  // NOLINT: implicit, so engines take a Model
  // The mlp, mlp-bn and cnn models are Sequentials; ConfigError for the others.
  torch::nn::Sequential sequential() const;

 private:
  ModuleRef ref_{std::shared_ptr<torch::nn::Module>{}};
};

// A parsed model spec.
struct ModelSpec {
  bool batch_norm = false;     // "mlp-bn": Linear, BatchNorm1d, ReLU per hidden layer
  bool cnn = false;            // "cnn:C1-C2-OUT": two convolutions on 28x28 single-channel images
  bool res = false;            // "res:IN-H-B-OUT": B residual blocks of width H (res_model.h)
  bool gpt = false;            // "gpt:V-T-D-L-H": a transformer over tokens (gpt_model.h)
  // IN, H1, ..., OUT (at least 2 entries, all > 0); cnn: 784, C1, C2, OUT; res: IN, H, B, OUT; gpt: V, T, D, L, H
  std::vector<int64_t> sizes;
  // gpt: the context T (token positions per sample) and the vocabulary V (logits per position).
  int64_t input_size() const { return gpt ? sizes[1] : sizes.front(); }
  int64_t output_size() const { return gpt ? sizes[0] : sizes.back(); }
};

// Parses "mlp:IN-H1-...-OUT", "mlp-bn:IN-H1-...-OUT", "cnn:C1-C2-OUT", "res:IN-H-B-OUT" or "gpt:V-T-D-L-H" (D a
// multiple of H).
// Throws gradsync::ConfigError naming the spec, the offending part and what is allowed.
ModelSpec parse_model_spec(const std::string& spec);

// mlp:    Linear(IN,H1), ReLU, Linear(H1,H2), ReLU, ..., Linear(Hk,OUT)
// mlp-bn: Linear(IN,H1), BatchNorm1d(H1), ReLU, ..., Linear(Hk,OUT)
// cnn:    Unflatten(1, (1, 28, 28)), Conv2d(1, C1, 3, padding=1), ReLU, MaxPool2d(2), Conv2d(C1, C2, 3, padding=1),
//         ReLU, MaxPool2d(2), Flatten, Linear(C2 * 7 * 7, OUT) -- on flattened 784-pixel images; keys 1.*, 4.*, 8.*
// res:    inp Linear(IN,H), blocks of h + fc(relu(norm(h))), out Linear(H,OUT) -- see res_model.h
// gpt:    vocabulary V, context T, width D, L blocks of H heads, output layer tied to wte -- see gpt_model.h
// The Sequentials' children are registered as "0", "1", ... exactly like Python's nn.Sequential.
Model make_model(const std::string& spec);
Model make_model(const ModelSpec& spec);

int64_t model_input_size(const std::string& spec);
int64_t model_output_size(const std::string& spec);

}  // namespace gradsync::cli
