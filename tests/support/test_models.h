// defines: what the engine tests share (test_engine.cpp, test_fsdp.cpp, test_zero.cpp): small models, optimizers,
// data that changes every step, and state-dict comparison. Every check compares a data-parallel run with an
// unsharded one on the same data.
#pragma once
#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"

namespace gradsync::test::sharding {

inline std::shared_ptr<World> join() { return init({std::chrono::seconds(60), std::nullopt, std::nullopt}); }

// "6-13-7-3" -> Linear(6,13) [BatchNorm1d(13)] ReLU Linear(13,7) ... Linear(7,3), seeded.
inline torch::nn::Sequential make_mlp(const std::string& widths, bool batch_norm, uint64_t seed) {
  std::vector<int64_t> sizes;
  std::stringstream in(widths);
  for (std::string part; std::getline(in, part, '-');) sizes.push_back(std::stoll(part));
  torch::manual_seed(seed);
  torch::nn::Sequential model;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    model->push_back(torch::nn::Linear(sizes[i], sizes[i + 1]));
    if (i + 2 < sizes.size()) {
      if (batch_norm) model->push_back(torch::nn::BatchNorm1d(sizes[i + 1]));
      model->push_back(torch::nn::ReLU());
    }
  }
  return model;
}

inline int64_t input_width(const std::string& widths) { return std::stoll(widths.substr(0, widths.find('-'))); }
inline int64_t output_width(const std::string& widths) { return std::stoll(widths.substr(widths.rfind('-') + 1)); }

// sgd: momentum 0.9 and weight decay (state and a parameter-dependent term); adam: two moments.
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                               const std::vector<torch::Tensor>& params) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  if (kind == "plain") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  return std::make_unique<torch::optim::SGD>(params,
                                             torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
}

// Global batch of step s: the same on every rank, different every step.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t step, int64_t size, int64_t in, int64_t classes) {
  torch::manual_seed(1000 + static_cast<uint64_t>(step));
  return {torch::randn({size, in}), torch::randint(0, classes, {size})};
}

// max over tensors of max|a-b| / max|b| (per tensor); keys must match in order.
inline double max_relative_difference(const StateDict& a, const StateDict& b, std::string* worst_key = nullptr) {
  if (a.size() != b.size()) return 1e30;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !a[i].second.sizes().equals(b[i].second.sizes())) return 1e30;
    auto x = a[i].second.to(torch::kDouble);
    auto y = b[i].second.to(torch::kDouble);
    const double scale = std::max(y.abs().max().item<double>(), 1e-12);
    const double d = (x - y).abs().max().item<double>() / scale;
    if (d > worst) {
      worst = d;
      if (worst_key) *worst_key = a[i].first;
    }
  }
  return worst;
}

inline StateDict copy_of(const StateDict& s) {
  StateDict out;
  for (const auto& [k, v] : s) out.emplace_back(k, v.detach().clone());
  return out;
}

}  // namespace gradsync::test::sharding
