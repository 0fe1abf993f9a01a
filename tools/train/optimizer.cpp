// The optimizer of `gradsync train` (see optimizer.h).
#include "train/optimizer.h"

#include <map>
#include <string>
#include <vector>

namespace gradsync::cli {
namespace {

// One group over the engine's parameters, or with --no-decay-1d two over the original parameters (the engine's
// named_parameters(): shard pieces for the sharded engines): the rest with --weight-decay, then the parameters of
// one dimension (biases, norm weights) without.
template <typename Optimizer, typename Options>
std::unique_ptr<torch::optim::Optimizer> optimizer_over(const TrainConfig& c, Engine& engine, const Model& model,
                                                        const Options& options) {
  if (!c.no_decay_1d) return std::make_unique<Optimizer>(engine.parameters(), options);
  std::map<std::string, int64_t> dims;
  for (const auto& p : model->named_parameters(/*recurse=*/true)) dims[p.key()] = p.value().dim();
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : engine.named_parameters()) (dims.at(p.key()) <= 1 ? no_decay : decay).push_back(p.value());
  // Defaults without decay: libtorch >= 2.15 gives a group's default-valued option (weight_decay 0) the defaults'.
  auto without = options;
  without.weight_decay(0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<Options>(options));
  groups.emplace_back(no_decay, std::make_unique<Options>(without));
  return std::make_unique<Optimizer>(std::move(groups), without);
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, Engine& engine, const Model& model) {
  if (c.optimizer == "adam") {
    const auto options = torch::optim::AdamOptions(c.lr.value_or(1e-3)).weight_decay(c.weight_decay);
    return optimizer_over<torch::optim::Adam>(c, engine, model, options);
  }
  return optimizer_over<torch::optim::SGD>(
      c, engine, model,
      torch::optim::SGDOptions(c.lr.value_or(0.01)).momentum(c.momentum.value_or(0)).weight_decay(c.weight_decay));
}

}  // namespace gradsync::cli
