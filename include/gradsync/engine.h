// defines: Engine, the one interface every gradsync engine offers (DistributedDataParallel, FullyShardedDataParallel,
// Zero1DataParallel, LocalEngine), NoSyncGuard, and accumulate(): K micro-batches per optimizer step.
//
// A training loop is written once against Engine; switching engines changes the line that constructs it:
//
//   gradsync::DistributedDataParallel engine(model, world);    // or FullyShardedDataParallel, Zero1DataParallel,
//                                                              // LocalEngine engine(model)
//   torch::optim::SGD optimizer(engine.parameters(), 0.1);     // what this rank steps (shards for FSDP and ZeRO)
//   engine.track_optimizer(&optimizer);                        // its state counts in engine.memory()
//   for (...) {
//     engine.zero_grad();
//     gradsync::accumulate(engine, K, [&](int64_t k) { return loss_fn(engine.forward(x[k]), y[k]); });
//     engine.clip_grad_norm(1.0);                              // optional: the norm of the whole gradient
//     optimizer.step();
//   }
//   auto state = engine.state_dict();                          // the unwrapped model's, Python's keys
//
// The rules every engine follows (see docs/semantics.md):
//  - when backward() returns after a synchronised forward, the gradient of parameters() is reduced over ranks as
//    the engine's Reduction says (Mean: 1/N then SUM, see Note [Where the division happens]);
//  - a forward inside no_sync() makes the coming backward accumulate locally; the next synchronised backward
//    reduces the sum. A forward with grad disabled builds no graph and decides nothing (the coming backward is an
//    earlier forward's, synchronised as that one decided, as in PyTorch DDP);
//  - rank 0's buffers are broadcast before a forward that follows a synchronised one (PyTorch DDP's rule);
//  - accumulate() divides each micro-batch loss by K because .grad sums; nothing divides by K anywhere else;
//  - a rank with no micro-batch in a step calls accumulate(engine, 0, ...): it joins the step's collectives with
//    zero gradients, still counted in the 1/N of Mean (as PyTorch's Join).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"
#include "gradsync/reduction.h"
#include "gradsync/state_dict.h"
#include "gradsync/stats.h"
#include "gradsync/trace.h"

namespace gradsync {

namespace detail {
template <typename Impl, typename = void>
struct HasTensorForward : std::false_type {};
template <typename Impl>
struct HasTensorForward<Impl, std::void_t<decltype(torch::Tensor(std::declval<Impl&>().forward(
                                  std::declval<const torch::Tensor&>())))>> : std::true_type {};
}  // namespace detail

// The module an engine trains: any torch::nn module holder (torch::nn::Sequential, your TORCH_MODULE) or a
// shared_ptr to a module. Its forward(Tensor), when it has one, is what Engine::forward(x) runs.
struct ModuleRef {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;  // empty when the module has no forward(Tensor)

  template <typename Impl, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, Impl>>>
  ModuleRef(std::shared_ptr<Impl> impl) : module(impl) {  // NOLINT: implicit, so engines take holders or pointers
    if constexpr (detail::HasTensorForward<Impl>::value) {
      forward = [impl](const torch::Tensor& x) -> torch::Tensor { return impl->forward(x); };
    }
  }
  template <typename Holder, typename = decltype(std::declval<const Holder&>().ptr())>
  ModuleRef(const Holder& holder) : ModuleRef(holder.ptr()) {}  // NOLINT: implicit, see above
};

class Engine;

// RAII: forward/backward passes in scope accumulate locally without communication (engine.no_sync()).
class NoSyncGuard {
 public:
  explicit NoSyncGuard(Engine& engine);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  Engine& engine_;
  bool previous_;
};

class Engine {
 public:
  virtual ~Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- forward ---------------------------------------------------------------------------------------------
  // The module's forward(x) between the engine's forward hooks. FSDP drives a torch::nn::Sequential unit by unit.
  virtual torch::Tensor forward(const torch::Tensor& input);
  torch::Tensor operator()(const torch::Tensor& input) { return forward(input); }
  // Any forward: body() computes it (FSDP: calling unit(name, fn) around each unit's part).
  template <typename Body>
  auto forward_with(Body&& body) {
    TraceSpan span(tracer(), "forward");
    begin_forward();
    try {
      auto output = body();
      end_forward();
      return output;
    } catch (...) {
      abort_forward();
      throw;
    }
  }

  // ---- synchronisation -------------------------------------------------------------------------------------
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }
  virtual bool require_sync() const = 0;
  virtual void set_require_sync(bool sync) = 0;

  // ---- what the optimizer sees -----------------------------------------------------------------------------
  // This rank's trainable tensors: the module's parameters (DDP, local) or this rank's shards (FSDP, ZeRO-1).
  virtual std::vector<torch::Tensor> parameters() const = 0;
  // The same under the original parameters' state-dict names, for optimizer parameter groups: the module's
  // trainable parameters (DDP, local), or this rank's part of each of them (FSDP, ZeRO-1: views of the shards).
  virtual torch::OrderedDict<std::string, torch::Tensor> named_parameters();
  // Gradients zeroed in place (local) or released (DDP, FSDP, ZeRO-1: .grad undefined until the next backward).
  virtual void zero_grad() = 0;
  // After the synchronising backward: scales the gradient so the norm of the whole (unsharded, reduced) gradient
  // is <= max_norm, as torch::nn::utils::clip_grad_norm_; returns that norm, the same on every rank.
  virtual double clip_grad_norm(double max_norm, double norm_type = 2.0) = 0;
  // The optimizer whose state memory() counts (not owned; pass nullptr before destroying it).
  virtual void track_optimizer(const torch::optim::Optimizer* optimizer) = 0;

  // ---- state -------------------------------------------------------------------------------------------------
  // Collective. The unwrapped module's parameters and buffers with Python's keys and order (buffers: rank 0's
  // for sharded engines, this rank's own for DDP and local), on every rank, or only on rank 0 with rank0_only
  // (other ranks get an empty one: no rank but 0 then holds the whole model).
  virtual StateDict state_dict(bool rank0_only = false) = 0;
  // Collective. The reduced gradient of every trainable parameter under its state-dict name, whole, on every rank
  // (the sharded engines all-gather their shards' gradients); zeros where a parameter has none. For checking a
  // gradient (gradsync train --verify-every), not for training: it costs a whole gradient per rank.
  virtual StateDict full_gradients();
  // Collective. The optimizer's state of every original parameter, whole, under the parameters' state-dict names,
  // in PyTorch's FSDP.full_optim_state_dict layout ({"state": {name: {"step", "exp_avg", ...}}, "param_groups":
  // [{..., "params": [names]}]}; src/engine/full_optim_state.h): on every rank, or only on rank 0 with rank0_only
  // (the others get an empty dict). The optimizer (SGD, Adam, AdamW) steps parameters() or named_parameters().
  virtual c10::IValue full_optim_state_dict(const torch::optim::Optimizer& optimizer, bool rank0_only = true);
  // Loads such a dict -- the whole dict on every rank, e.g. read_torch_file() of what save_torch_file() wrote --
  // into this rank's part of the optimizer's state (no communication). Parameters the dict has no state for start
  // afresh; a mis-sized tensor is a ConfigError naming it.
  virtual void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state);
  // Collective. Loads rank 0's `state` everywhere (other ranks may pass an empty one). Strict: a missing,
  // unexpected or mis-shaped key fails on every rank, naming it, and nothing is modified.
  virtual void load_state_dict(const StateDict& state) = 0;
  // What else a bit-exact resume needs of the engine itself, the same on every rank: DDP's bucket order once its
  // buckets were rebuilt (a different bucket layout sums across three or more ranks in another order). Empty for
  // the other engines. load_layout_state() takes what the same kind of engine returned, before the first forward,
  // on every rank (collective: DDP's buffers for the new buckets are agreed on by all ranks);
  // a state that does not fit (other parameters) is a ConfigError naming it.
  virtual StateDict layout_state() const { return {}; }
  virtual void load_layout_state(const StateDict& state) {}

  // ---- what it costs ---------------------------------------------------------------------------------------
  virtual MemoryStats memory() const = 0;  // parameters, gradients, optimizer state held by this rank
  virtual CommStats traffic() const = 0;   // bytes this rank sent in gradient/parameter collectives

  // ---- identity ----------------------------------------------------------------------------------------------
  virtual torch::nn::Module& module() = 0;  // the unwrapped module (for FSDP: its parameters are views of units)
  virtual Reduction reduction() const = 0;
  virtual const char* name() const = 0;     // "DistributedDataParallel", ... for messages
  // The communicator of this engine's ranks; null for the local engine.
  virtual Collectives* comm() = 0;
  // Its tracer (Collectives::set_tracer), null when none: forward, backward and every collective report to it.
  Tracer* tracer() {
    auto* c = comm();
    return c ? c->tracer() : nullptr;
  }

  // ---- what accumulate() and forward_with() call -------------------------------------------------------------
  virtual void begin_forward() = 0;  // buffer broadcast, gathers; decides nothing yet
  virtual void end_forward() = 0;    // decides whether the coming backward synchronises
  virtual void abort_forward() {}    // the body threw between begin_forward() and end_forward()
  // A micro-step without data (a shadow micro-step): begin_forward(), join_forward(), end_forward(),
  // join_backward() issue the collectives a real micro-step would, with zero gradients, so a rank without data
  // neither stalls the others nor changes their sequence of collectives. Under no_sync it accumulates nothing;
  // synchronised it reduces what the rank's earlier micro-steps accumulated. FSDP replays the forward's unit
  // gathers in join_forward(); the other engines have none.
  virtual void join_forward() {}
  virtual void join_backward() = 0;
  // Sharded accumulation that reduces every micro-step (FSDP's ReduceEveryMicroStep): accumulate() then runs
  // every micro-batch synchronised and calls continue_accumulation() between them.
  virtual bool reduces_every_micro_step() const { return false; }
  // The next forward continues the current step: no buffer broadcast, as after a no_sync forward.
  virtual void continue_accumulation() {}
  // Reducing every micro-step: whether this micro-step's backward completes the step's reduction. Hybrid sharding
  // reduce-scatters every micro-step and all-reduces across replicas only when it does; accumulate() sets it for
  // the last micro-step. The other engines have nothing to defer.
  virtual void set_requires_all_reduce(bool /*all_reduce*/) {}
  // Reduction::GlobalMean: the step's item count over all ranks, before the synchronising backward.
  virtual void set_global_item_count(int64_t items);
  // accumulate() calls it first with this rank's micro-batch count and runs the micro-steps it returns: this
  // rank's own, then shadow micro-steps (see join_forward) up to the count. Most engines return max(count, 1): a
  // rank without data joins the one synchronised micro-step. FSDP gathers parameters in every forward, so every
  // rank runs the largest count (one small all-gather); it fails on every rank, naming them, where a rank has no
  // micro-step of its own to replay.
  virtual int64_t begin_step(int64_t micro_batches) { return std::max<int64_t>(micro_batches, 1); }

 protected:
  explicit Engine(const ModuleRef& module) : module_forward_(module.forward) {}

 private:
  std::function<torch::Tensor(const torch::Tensor&)> module_forward_;
};

inline NoSyncGuard::NoSyncGuard(Engine& engine) : engine_(engine), previous_(engine.require_sync()) {
  engine_.set_require_sync(false);
}
inline NoSyncGuard::~NoSyncGuard() { engine_.set_require_sync(previous_); }

// ---- accumulate() --------------------------------------------------------------------------------------------
//
// Why the loss is scaled by 1/K: backward() *adds* into .grad. After K backward passes .grad holds the SUM of the
// K micro-batch gradients, K times the gradient of the mean loss. Dividing each micro-batch's (per-sample mean)
// loss by K turns that sum into the mean over the K micro-batches, which for equal micro-batches is the gradient
// of the mean loss over all K*b samples. The engine then averages over ranks (Reduction::Mean), so the step's
// gradient is that of the mean loss over the whole global batch of N*K*b samples. Communication happens once, on
// the last micro-batch: the first K-1 run under no_sync() (unless the engine reduces every micro-step).
//
// The 1/K rule gives the global mean only when every micro-batch and every rank holds the same number of items;
// accumulate_global_mean() gives it for any counts (Reduction::GlobalMean, see reduction.h).

namespace detail {
void check_micro_batches(int64_t micro_batches, int64_t minimum);
// A model with a SyncBatchNorm (sync_batch_norm.h) communicates in every forward and backward, which a shadow
// micro-step does not run: every rank must bring the same micro-batch count (a rank short of data passes empty
// batches). One allgather of the counts per step, only for such models; a difference fails every rank, naming the
// counts.
void check_sync_batch_norm_steps(Engine& engine, int64_t micro_batches);
}  // namespace detail

// One process without an engine: micro_loss(k) returns micro-batch k's loss (a per-sample mean, with its graph).
// Returns the step's loss, the sum over k of loss_k / K.
template <typename LossFn>
double accumulate(int64_t micro_batches, LossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches, 1);
  double total = 0;
  for (int64_t k = 0; k < micro_batches; ++k) {
    auto scaled = micro_loss(k) / static_cast<double>(micro_batches);
    scaled.backward();
    total += scaled.template item<double>();
  }
  return total;
}

namespace detail {
// A micro-step without data (see Engine::join_forward), synchronised unless under no_sync.
inline void shadow_forward(Engine& engine) {
  engine.begin_forward();
  try {
    engine.join_forward();
  } catch (...) {
    engine.abort_forward();
    throw;
  }
  engine.end_forward();
}
inline void shadow_micro_step(Engine& engine) {
  shadow_forward(engine);
  TraceSpan span(engine.tracer(), "backward", TraceEvent::Kind::Compute, "shadow");
  engine.join_backward();
}
// backward() of a micro-step's loss, a "backward" span on the engine's tracer.
inline void traced_backward(Engine& engine, const torch::Tensor& loss) {
  TraceSpan span(engine.tracer(), "backward");
  loss.backward();
}
}  // namespace detail

// Any engine: micro_loss(k) runs engine.forward itself (so no_sync covers the forward too) and returns micro-batch
// k's loss. micro_batches may be 0 on a rank without data in this step: it joins with zero gradients. Ranks may
// hold different counts K_r: each divides by its own (see docs/semantics.md, the K' rule).
template <typename LossFn>
double accumulate(Engine& engine, int64_t micro_batches, LossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches, 0);
  detail::check_sync_batch_norm_steps(engine, micro_batches);
  const int64_t steps = engine.begin_step(micro_batches);  // this rank's micro-batches, then shadow ones
  double total = 0;
  for (int64_t k = 0; k < steps; ++k) {
    auto step = [&] {
      if (k >= micro_batches) return detail::shadow_micro_step(engine);
      auto scaled = micro_loss(k) / static_cast<double>(micro_batches);
      detail::traced_backward(engine, scaled);
      total += scaled.template item<double>();
    };
    const bool last = k + 1 == steps;
    if (engine.reduces_every_micro_step()) engine.set_requires_all_reduce(last);
    if (last) {
      step();
    } else if (engine.reduces_every_micro_step()) {
      step();
      engine.continue_accumulation();
    } else {
      auto guard = engine.no_sync();
      step();
    }
  }
  return total;
}

// One micro-batch's contribution under Reduction::GlobalMean: the SUM of its per-item losses and how many items
// (samples, non-padding tokens, ...) it holds.
struct ItemLoss {
  torch::Tensor summed_loss;
  int64_t items = 0;
};

struct GlobalStepLoss {
  double mean_loss = 0;     // sum of all items' losses / total items, over all ranks
  int64_t total_items = 0;  // T: items in the step over all ranks and micro-batches
};

namespace detail {
// One allreduce of (items, loss sum) over the engine's ranks; hands T to the engine.
GlobalStepLoss global_totals(Engine& engine, int64_t items, double loss_sum);
// The engine reduces with GlobalMean, once per step (the item count is known only before the last micro-step).
void require_global_mean(const Engine& engine);
}  // namespace detail

// Reduction::GlobalMean: every micro-batch backpropagates its summed loss (no scaling: .grad sums per-item
// gradients), micro-batches 0..K-2 under no_sync(). Before the last backward one allreduce of two numbers gives the
// step's total item count T (and loss sum), and the engine folds 1/T into its reduction. The gradient is then
// exactly that of the mean loss over all T items, whatever the per-rank and per-micro-batch counts.
// micro_batches may be 0 on a rank without data in this step; it contributes zero items and zero gradients.
template <typename ItemLossFn>
GlobalStepLoss accumulate_global_mean(Engine& engine, int64_t micro_batches, ItemLossFn&& micro_loss) {
  detail::check_micro_batches(micro_batches, 0);
  detail::require_global_mean(engine);
  detail::check_sync_batch_norm_steps(engine, micro_batches);
  const int64_t steps = engine.begin_step(micro_batches);  // this rank's micro-batches, then shadow ones
  int64_t items = 0;
  double loss_sum = 0;
  for (int64_t k = 0; k + 1 < steps; ++k) {
    auto guard = engine.no_sync();
    if (k >= micro_batches) {
      detail::shadow_micro_step(engine);
      continue;
    }
    ItemLoss part = micro_loss(k);
    items += part.items;
    loss_sum += part.summed_loss.template item<double>();
    detail::traced_backward(engine, part.summed_loss);
  }
  if (micro_batches < steps) {  // the synchronised micro-step is a shadow one
    detail::shadow_forward(engine);
    auto out = detail::global_totals(engine, items, loss_sum);
    TraceSpan span(engine.tracer(), "backward", TraceEvent::Kind::Compute, "shadow");
    engine.join_backward();
    return out;
  }
  ItemLoss last = micro_loss(micro_batches - 1);  // synchronised forward
  items += last.items;
  loss_sum += last.summed_loss.template item<double>();
  auto out = detail::global_totals(engine, items, loss_sum);
  detail::traced_backward(engine, last.summed_loss);
  return out;
}

}  // namespace gradsync
