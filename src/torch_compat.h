// defines: what differs between the two libtorch lines gradsync builds against, Debian 12's 1.13 and 2.x (>= 2.11),
// so that no other file needs a version test. Build-time differences (gloo's headers, fmt, the libraries) are in
// cmake/torch_line.cmake.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#define GRADSYNC_TORCH2 (TORCH_VERSION_MAJOR >= 2)

namespace gradsync::compat {

// What keeps a parameter's AccumulateGrad node (and the hooks on it) alive: a std::shared_ptr up to 2.1x, a
// c10::intrusive_ptr in 2.15. Taken from grad_accumulator() itself, so no version test is needed.
using GradAccumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// The key of a parameter's entry in torch::optim::Optimizer::state(): the parameter's TensorImpl, as a pointer
// since 2.2, as that pointer's text before.
#if GRADSYNC_TORCH2
using OptimizerStateKey = void*;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }
#else
using OptimizerStateKey = std::string;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}
#endif

// A c10d store of gradsync's own. clone() (a second handle on the same store, for another thread) is pure virtual
// since 2.8 and absent in 1.13: such a store defines clone_store(), which serves it where it exists.
class OwnStore : public c10d::Store {
 public:
  using Store::Store;
  virtual c10::intrusive_ptr<c10d::Store> clone_store() = 0;
#if GRADSYNC_TORCH2
  c10::intrusive_ptr<c10d::Store> clone() override { return clone_store(); }
#endif
};

// `store`'s clone(), where c10d has it (2.x); 1.13 never asks a store for one.
inline c10::intrusive_ptr<c10d::Store> clone_of(const c10::intrusive_ptr<c10d::Store>& store) {
#if GRADSYNC_TORCH2
  return store->clone();
#else
  (void)store;
  throw std::logic_error("c10d::Store::clone() does not exist in libtorch 1.13");
#endif
}

// c10d's ProcessGroupGloo for gradsync's own collectives on its worker threads (GlooGroup): since 2.x each work
// carries the group's next sequence number, as c10d's own collectives do.
class GlooGroupBase : public c10d::ProcessGroupGloo {
 public:
  using ProcessGroupGloo::ProcessGroupGloo;

 protected:
#if GRADSYNC_TORCH2
  uint64_t next_seq() { return ++seq_; }
#else
  uint64_t next_seq() { return 0; }
#endif
};

// A collective of gradsync's own on those threads: the base AsyncWork takes the context, the sequence number and
// the timeout since 2.x, and a work reports its tensors itself (pure virtual getInputTensors / getOutputTensors).
class GlooGroupWork : public c10d::ProcessGroupGloo::AsyncWork {
 public:
  // `tensor` is both input and output (an in-place collective).
  GlooGroupWork(std::shared_ptr<::gloo::Context> context, at::Tensor tensor, uint64_t seq,
                std::chrono::milliseconds timeout, const char* title)
#if GRADSYNC_TORCH2
      : AsyncWork(std::move(context), {{tensor}}, c10d::OpType::ALLREDUCE, seq, timeout, title,
                  std::vector<at::Tensor>{tensor}),
#else
      : AsyncWork({{tensor}}, title),
#endif
        tensor_(std::move(tensor)) {
  }

#if GRADSYNC_TORCH2
  const std::vector<at::Tensor> getInputTensors() override { return {tensor_}; }
  const std::vector<at::Tensor> getOutputTensors() override { return {tensor_}; }
#endif

 protected:
  at::Tensor tensor_;
};

}  // namespace gradsync::compat
