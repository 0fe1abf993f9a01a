// LocalEngine: the engine interface for one process (see local.h).
#include "gradsync/local.h"

#include "common/clip_grad.h"

namespace gradsync {

LocalEngine::LocalEngine(const ModuleRef& module) : Engine(module), module_(module.module) { sample_memory(); }

std::vector<torch::Tensor> LocalEngine::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : module_->parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

void LocalEngine::zero_grad() { module_->zero_grad(/*set_to_none=*/false); }  // memory() measures when asked

double LocalEngine::clip_grad_norm(double max_norm, double norm_type) {
  return gradsync::clip_grad_norm(parameters(), max_norm, norm_type, /*spread_over=*/nullptr);
}

void LocalEngine::track_optimizer(const torch::optim::Optimizer* optimizer) {
  optimizer_ = optimizer;
  sample_memory();
}

StateDict LocalEngine::state_dict(bool /*rank0_only: this process is rank 0*/) {
  StateDict out;
  for (const auto& [name, tensor] : gradsync::state_dict(*module_)) out.emplace_back(name, tensor.detach().clone());
  return out;
}

void LocalEngine::load_state_dict(const StateDict& state) { load_into(*module_, state); }

MemoryStats LocalEngine::memory() const {
  sample_memory();
  return meter_.stats();
}

void LocalEngine::sample_memory() const { meter_.sample(module_memory(*module_, optimizer_)); }

}  // namespace gradsync
