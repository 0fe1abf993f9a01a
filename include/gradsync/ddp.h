// defines: DistributedDataParallel<ModuleHolder>, data parallelism for any torch::nn module holder
// (torch::nn::Sequential, torch::nn::Linear, your own TORCH_MODULE). The work is done by Reducer (reducer.h).
//
//   auto world = gradsync::init();
//   gradsync::DistributedDataParallel ddp(model, world);   // default Reduction::Mean, as PyTorch DDP
//   auto loss = loss_fn(ddp.forward(x), y);
//   loss.backward();                                       // gradients are the mean over ranks on return
//   optimizer.step();
#pragma once
#include <memory>
#include <utility>

#include "ddp/reducer.h"

namespace gradsync {

template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleHolder module, std::shared_ptr<World> world, DdpOptions options = {})
      : module_(std::move(module)), reducer_(std::make_unique<Reducer>(module_.ptr(), std::move(world), options)) {}

  // Runs the module's forward between the buffer broadcast and the arming of the gradient hooks.
  template <typename... Args>
  auto forward(Args&&... args) {
    reducer_->before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    reducer_->after_forward();
    return output;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // RAII: forward/backward passes in scope accumulate locally without communication.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*reducer_); }
  void zero_grad() { reducer_->zero_grad(); }

  ModuleHolder& module() { return module_; }
  Reducer& reducer() { return *reducer_; }

 private:
  ModuleHolder module_;
  std::unique_ptr<Reducer> reducer_;  // stable address: autograd hooks refer to its state
};

}  // namespace gradsync
