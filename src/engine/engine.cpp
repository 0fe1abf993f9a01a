// The parts of the engine interface that are the same for every engine (see engine.h).
#include "gradsync/engine.h"

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {

torch::Tensor Engine::forward(const torch::Tensor& input) {
  if (!module_forward_) {
    throw ConfigError(fmt::format("{}: the module has no forward(Tensor); run your forward with "
                                  "forward_with([&] {{ return model->forward(...); }})", name()));
  }
  return forward_with([&] { return module_forward_(input); });
}

void Engine::set_global_item_count(int64_t /*items*/) {
  throw ConfigError(fmt::format("{} does not support Reduction::GlobalMean; use DistributedDataParallel", name()));
}

namespace detail {

void check_micro_batches(int64_t micro_batches, int64_t minimum) {
  if (micro_batches < minimum) {
    throw ConfigError(fmt::format("accumulate: {} micro-batches requested; expected at least {}", micro_batches,
                                  minimum));
  }
}

void require_global_mean(const Engine& engine) {
  if (engine.reduction() != Reduction::GlobalMean) {
    throw ConfigError(fmt::format("accumulate_global_mean needs an engine built with Reduction::GlobalMean; this {} "
                                  "reduces with {}", engine.name(), to_string(engine.reduction())));
  }
}

GlobalStepLoss global_totals(Engine& engine, int64_t items, double loss_sum) {
  auto t = torch::tensor({static_cast<double>(items), loss_sum}, torch::kDouble);
  if (auto* comm = engine.comm()) comm->allreduce(t, Reduction::Sum);
  GlobalStepLoss out;
  out.total_items = static_cast<int64_t>(std::llround(t[0].item<double>()));
  out.mean_loss = out.total_items > 0 ? t[1].item<double>() / static_cast<double>(out.total_items) : 0.0;
  engine.set_global_item_count(out.total_items);
  return out;
}

}  // namespace detail
}  // namespace gradsync
