// The parts of the engine interface that are the same for every engine (see engine.h).
#include "gradsync/engine.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "norm/sync_batch_norm_path.h"
#include "engine/full_optim_state.h"

namespace gradsync {

torch::Tensor Engine::forward(const torch::Tensor& input) {
  if (!module_forward_) {
    throw ConfigError(fmt::format("{}: the module has no forward(Tensor); run your forward with "
                                  "forward_with([&] {{ return model->forward(...); }})", name()));
  }
  return forward_with([&] { return module_forward_(input); });
}

torch::OrderedDict<std::string, torch::Tensor> Engine::named_parameters() {
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& p : module().named_parameters(/*recurse=*/true)) {
    if (p.value().requires_grad()) out.insert(p.key(), p.value());
  }
  return out;
}

// The defaults below are the unsharded engines': they step the module's trainable parameters, which the
// non-virtual Engine::named_parameters() lists.
StateDict Engine::full_gradients() {
  StateDict out;
  for (const auto& p : Engine::named_parameters()) {
    const auto& grad = p.value().grad();
    out.emplace_back(p.key(), grad.defined() ? grad.detach().clone() : torch::zeros_like(p.value()));
  }
  return out;
}

c10::IValue Engine::full_optim_state_dict(const torch::optim::Optimizer& optimizer, bool rank0_only) {
  std::vector<NamedParamState> states;
  SteppedNames names;
  for (const auto& p : Engine::named_parameters()) {
    states.push_back({p.key(), get_param_state(optimizer, p.value())});
    names[p.value().unsafeGetTensorImpl()] = {p.key()};
  }
  const bool receiver = !rank0_only || !comm() || comm()->rank() == 0;
  return receiver ? optim_state_value(states, optimizer, names) : c10::impl::GenericDict(c10::StringType::get(),
                                                                                        c10::AnyType::get());
}

void Engine::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state) {
  const auto states = optim_states_of(state);
  for (const auto& p : Engine::named_parameters()) {
    auto it = states.find(p.key());
    set_param_state(optimizer, p.value(), it == states.end() ? ParamState{} : it->second);
  }
}

void Engine::set_global_item_count(int64_t /*items*/) {
  throw ConfigError(fmt::format("{} does not support Reduction::GlobalMean", name()));
}

namespace detail {

void check_micro_batches(int64_t micro_batches, int64_t minimum) {
  if (micro_batches < minimum) {
    throw ConfigError(fmt::format("accumulate: {} micro-batches requested; expected at least {}", micro_batches,
                                  minimum));
  }
}

void check_sync_batch_norm_steps(Engine& engine, int64_t micro_batches) {
  auto* comm = engine.comm();
  if (!comm || comm->size() == 1) return;
  const auto name = norm::sync_batch_norm_path(engine.module());
  if (name.empty()) return;
  auto all = torch::empty({comm->size()}, torch::kLong);
  comm->allgather_flat(torch::tensor({micro_batches}, torch::kLong), all);
  const auto counts = std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + comm->size());
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); })) return;
  throw ConfigError(fmt::format(
      "{}: the model's SyncBatchNorm '{}' communicates in every forward and backward, so every rank must run the same "
      "micro-steps, but the ranks' micro-batch counts differ (rank 0..{}: {}); give a rank short of data empty "
      "micro-batches (zero rows), their loss times 0", engine.name(), name, comm->size() - 1, fmt::join(counts, ", ")));
}

void require_global_mean(const Engine& engine) {
  if (engine.reduction() != Reduction::GlobalMean) {
    throw ConfigError(fmt::format("accumulate_global_mean needs an engine built with Reduction::GlobalMean; this {} "
                                  "reduces with {}", engine.name(), to_string(engine.reduction())));
  }
  if (engine.reduces_every_micro_step()) {
    throw ConfigError(fmt::format("{}: Reduction::GlobalMean divides by the step's item count, known only before the "
                                  "last micro-step; reducing every micro-step cannot use it (accumulate unsharded "
                                  "gradients instead)", engine.name()));
  }
}

GlobalStepLoss global_totals(Engine& engine, int64_t items, double loss_sum) {
  auto t = torch::tensor({static_cast<double>(items), loss_sum}, torch::kDouble);
  TraceLabel label(engine.tracer(), "global-mean count");
  if (auto* comm = engine.comm()) comm->allreduce(t, Reduction::Sum);
  GlobalStepLoss out;
  out.total_items = static_cast<int64_t>(std::llround(t[0].item<double>()));
  out.mean_loss = out.total_items > 0 ? t[1].item<double>() / static_cast<double>(out.total_items) : 0.0;
  engine.set_global_item_count(out.total_items);
  return out;
}

}  // namespace detail
}  // namespace gradsync
