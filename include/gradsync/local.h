// defines: LocalEngine, the engine interface for one process: no ranks, no communication. What a training loop
// written against Engine runs when there is nothing to distribute, and the reference every data-parallel engine is
// compared with (N ranks must end where one process on the global batch ends).
//
//   gradsync::LocalEngine engine(model);
//   torch::optim::SGD optimizer(engine.parameters(), 0.1);
//   gradsync::accumulate(engine, K, [&](int64_t k) { return loss_fn(engine.forward(x[k]), y[k]); });
//   optimizer.step();
#pragma once
#include <memory>
#include <vector>

#include "gradsync/engine.h"

namespace gradsync {

class LocalEngine : public Engine {
 public:
  explicit LocalEngine(const ModuleRef& module);

  using Engine::forward;
  bool require_sync() const override { return require_sync_; }
  void set_require_sync(bool sync) override { require_sync_ = sync; }  // nothing to synchronise; kept for no_sync()
  std::vector<torch::Tensor> parameters() const override;  // the parameters that require grad
  void zero_grad() override;                                 // in place, as Module::zero_grad(false)
  double clip_grad_norm(double max_norm, double norm_type = 2.0) override;
  void track_optimizer(const torch::optim::Optimizer* optimizer) override;
  StateDict state_dict(bool rank0_only = false) override;
  void load_state_dict(const StateDict& state) override;  // strict (load_into)
  MemoryStats memory() const override;
  CommStats traffic() const override { return {}; }
  torch::nn::Module& module() override { return *module_; }
  Reduction reduction() const override { return Reduction::Mean; }  // of one rank: the gradient itself
  const char* name() const override { return "LocalEngine"; }
  Collectives* comm() override { return nullptr; }

  void begin_forward() override {}
  void end_forward() override {}
  void join_backward() override {}  // no other rank to join: .grad keeps what it has

 private:
  void sample_memory() const;

  std::shared_ptr<torch::nn::Module> module_;
  const torch::optim::Optimizer* optimizer_ = nullptr;
  mutable MemoryMeter meter_;
  bool require_sync_ = true;
};

}  // namespace gradsync
