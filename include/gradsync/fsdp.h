// defines: FullyShardedDataParallel (FSDP): data parallelism that shards parameters, gradients and optimizer state
// over the ranks, unit by unit (ZeRO stages 2 and 3), or keeps them whole (NO_SHARD, DDP's arithmetic).
//
//   auto world = gradsync::init();
//   gradsync::FullyShardedDataParallel fsdp(model, world);           // FULL_SHARD, a unit per child, mean
//   torch::optim::Adam optimizer(fsdp.parameters(), 1e-3);          // over this rank's shards only
//   fsdp.track_optimizer(&optimizer);                                // its state counts in fsdp.memory()
//   auto loss = loss_fn(fsdp.forward(x), y);
//   loss.backward();                       // on return, each shard's .grad holds its part of the mean gradient
//   optimizer.step();
//   fsdp.zero_grad();
//
// One unit's life in a FULL_SHARD step (a unit is a group of children chosen by the wrap policy; its parameters
// are one flat buffer, see flat_param.h):
//   forward   all-gather -> run the unit's children -> free (reshard); a hook goes on the unit's output
//   backward  output hook: all-gather again, allocate the unsharded gradient buffer
//             AccumulateGrad fills it; when the unit's last parameter gradient is in: x 1/N, reduce-scatter (SUM),
//             add into the shard's .grad, free the buffer and the parameters
//   end of backward (queued callback): units that got no gradient contribute zeros; remaining frees
// SHARD_GRAD_OP keeps the parameters gathered from the unit's forward to the end of backward (no second
// all-gather). NO_SHARD keeps everything whole and allreduces, like DDP. Parameters no unit took form the root
// unit, gathered for the whole forward and backward.
//
// Forward needs FSDP to know where units start and end; C++ modules have no forward pre-hooks, so FSDP drives the
// forward: forward(x) runs a torch::nn::Sequential child by child; for any other module, forward_with(body) runs
// your forward, which calls unit(name, fn) around each unit's part.
//
// Semantics (see Note [Where the division happens]): Reduction::Mean multiplies by 1/N, then SUM-reduces, exactly
// as DDP; the optimizer, elementwise (SGD, Adam), updates each rank's slice with that slice's mean gradient,
// which is the unsharded update. Accumulation: see accumulate() at the end of this file.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fmt/format.h>

#include "gradsync/error.h"
#include "gradsync/stats.h"
#include "gradsync/reduction.h"
#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"

namespace gradsync {

struct WrapPolicy {
  enum class Kind {
    Children,   // every direct child that has parameters is a unit (PyTorch: wrap each layer)
    MinParams,  // consecutive children grouped until the group holds >= min_params parameters
    List,       // the named direct children, one unit each; the other children's parameters go to the root
  };
  Kind kind = Kind::Children;
  int64_t min_params = 0;
  std::vector<std::string> names;

  static WrapPolicy children();
  static WrapPolicy at_least(int64_t min_params);
  static WrapPolicy list(std::vector<std::string> names);
  // The CLI spelling: "children", "params:N", "list:A,B,...".
  std::string to_string() const;
};

// Parses "children", "params:N" (N >= 1) or "list:NAME[,NAME...]"; throws ConfigError naming the spec otherwise.
WrapPolicy parse_wrap_policy(const std::string& spec);

// See Note [Mixed precision on Gloo] (src/shard/mixed_precision.h): bfloat16 over a backend without it.
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;   // default: the model's own dtype (no casting)
  std::optional<c10::ScalarType> reduce_dtype;  // default: param_dtype

  c10::ScalarType compute(c10::ScalarType master) const { return param_dtype.value_or(master); }
  c10::ScalarType reduce(c10::ScalarType master) const { return reduce_dtype.value_or(compute(master)); }
};

// "fp32"/"float32", "fp64"/"float64", "fp16"/"float16", "bf16"/"bfloat16"; throws ConfigError otherwise.
c10::ScalarType parse_dtype(const std::string& name);
std::string dtype_name(c10::ScalarType dtype);

// Whether every rank checks that the ranks issue the same unit collectives in the same order (a mismatch would
// pair different units' collectives): in the first step only (the default), always, or never.
enum class OrderChecking { FirstStep, Always, Never };

enum class ShardingStrategy {
  FullShard,    // ZeRO-3: parameters, gradients and optimizer state sharded; parameters gathered per unit use
  ShardGradOp,  // ZeRO-2: gradients and optimizer state sharded; parameters gathered from forward to backward's end
  NoShard,      // DDP-equivalent: nothing sharded, gradients allreduced
};
const char* to_string(ShardingStrategy strategy);  // "full_shard", "shard_grad_op", "no_shard"

struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  WrapPolicy wrap = WrapPolicy::children();
  MixedPrecision mixed_precision;        // see Note [Mixed precision on Gloo]
  Reduction reduction = Reduction::Mean;  // PyTorch DDP/FSDP: mean
  bool broadcast_buffers = true;         // rank 0's buffers before a forward that follows a synced one (as DDP)
  OrderChecking order_checking = OrderChecking::FirstStep;
};

struct UnitInfo {
  std::string name;
  std::vector<std::string> params;
  int64_t numel = 0, padded_numel = 0, shard_numel = 0;
  int64_t full_bytes = 0;  // gathered parameters in the compute dtype
};

class FsdpNoSyncGuard;

class FullyShardedDataParallel {
 public:
  // Checks that every rank has the same model and unit plan (DistributedError otherwise), broadcasts rank 0's
  // parameters and buffers, flattens each unit and keeps this rank's shard. Parameters must require grad and share
  // one dtype per unit.
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<World> world,
                           FsdpOptions options = {});
  template <typename ModuleHolder, typename = decltype(std::declval<ModuleHolder>().ptr())>
  FullyShardedDataParallel(const ModuleHolder& module, std::shared_ptr<World> world, FsdpOptions options = {})
      : FullyShardedDataParallel(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(world),
                                 std::move(options)) {}
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // The module must be a torch::nn::Sequential (ConfigError otherwise). A floating input is cast to the
  // param dtype; the output is in the param dtype.
  torch::Tensor forward(const torch::Tensor& input);
  torch::Tensor operator()(const torch::Tensor& input) { return forward(input); }
  // Any module: `body` computes the forward and calls unit() around each unit's part, in the same order on every
  // rank (checked in the first step, see order_check.h).
  torch::Tensor forward_with(const std::function<torch::Tensor()>& body);
  torch::Tensor unit(const std::string& name, const std::function<torch::Tensor()>& fn);

  // Gradient synchronisation on/off for the coming forward/backward (accumulation micro-steps).
  [[nodiscard]] FsdpNoSyncGuard no_sync();
  bool require_sync() const;
  void set_require_sync(bool sync);
  // The next forward continues the current optimizer step (a synchronised accumulation micro-step): like a forward
  // after no_sync, it does not re-broadcast buffers, so BatchNorm statistics follow DDP's once-per-step rule.
  void continue_accumulation();

  // This rank's shards, one per unit (leaves that require grad): what the optimizer steps.
  std::vector<torch::Tensor> parameters() const;
  // Shard gradients become undefined and unsharded gradient buffers are released.
  void zero_grad();
  // The optimizer whose state memory() counts (not owned; pass nullptr before destroying it).
  void track_optimizer(const torch::optim::Optimizer* optimizer);
  // Clips the shard gradients so the norm of the whole gradient is <= max_norm (see clip_grad.h); call after the
  // synchronising backward. Returns the total norm (the unsharded one), equal on every rank.
  double clip_grad_norm(double max_norm, double norm_type = 2.0);

  // Collective. The unwrapped module's state dict (Python's keys and order, master dtype) on rank 0, or on every
  // rank with all_ranks; other ranks get an empty one. Buffers are rank 0's.
  StateDict full_state_dict(bool all_ranks = false);
  // Collective. Loads rank 0's `state` (other ranks may pass an empty one) and re-shards it. Strict: a missing,
  // unexpected or mis-shaped key fails on every rank. Optimizer state is not touched.
  void load_full_state_dict(const StateDict& state);
  // Collective. This rank's shards (and the optimizer state of them, if given) in DIR (see sharded_checkpoint.h).
  void save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer = nullptr);
  void load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer = nullptr);

  MemoryStats memory() const;
  void reset_peak_memory();
  CommStats comm_stats() const;  // bytes this rank sent in unit collectives since construction
  std::vector<UnitInfo> units() const;
  // Bytes of the largest unit's gathered parameters plus its unsharded gradient: what one unit adds at its peak.
  int64_t largest_unit_bytes() const;
  const FsdpOptions& options() const;
  torch::nn::Module& module();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

class FsdpNoSyncGuard {
 public:
  explicit FsdpNoSyncGuard(FullyShardedDataParallel& fsdp) : fsdp_(fsdp), previous_(fsdp.require_sync()) {
    fsdp_.set_require_sync(false);
  }
  ~FsdpNoSyncGuard() { fsdp_.set_require_sync(previous_); }
  FsdpNoSyncGuard(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(const FsdpNoSyncGuard&) = delete;

 private:
  FullyShardedDataParallel& fsdp_;
  bool previous_;
};

inline FsdpNoSyncGuard FullyShardedDataParallel::no_sync() { return FsdpNoSyncGuard(*this); }

// How K micro-batches combine under FSDP. Both give the same gradient (sum over micro-batches of loss_k/K, mean
// over ranks); they trade memory for communication:
enum class ShardedAccumulation {
  // K-1 micro-steps under no_sync(): each unit's unsharded gradient buffer stays allocated and sums locally, one
  // reduction per step. Costs a full gradient (Psi x compute dtype) per rank between micro-steps.
  UnshardedGradients,
  // Every micro-step reduce-scatters and adds into the shard gradient: gradient memory stays Psi/N, but the
  // reduce-scatter traffic is paid K times.
  ReduceEveryMicroStep,
};

// accumulate() for FSDP: micro_loss(k) runs fsdp.forward itself and returns micro-batch k's loss; each is divided
// by K because .grad sums (see accumulate.h). Returns the step's loss.
template <typename LossFn>
double accumulate(FullyShardedDataParallel& fsdp, int64_t micro_batches, LossFn&& micro_loss,
                  ShardedAccumulation mode = ShardedAccumulation::UnshardedGradients) {
  if (micro_batches < 1) {
    throw ConfigError(fmt::format("accumulate: {} micro-batches requested; expected at least 1", micro_batches));
  }
  double total = 0;
  for (int64_t k = 0; k < micro_batches; ++k) {
    auto step = [&] {
      auto scaled = micro_loss(k) / static_cast<double>(micro_batches);
      scaled.backward();
      total += scaled.template item<double>();
    };
    const bool last = k + 1 == micro_batches;
    if (!last && mode == ShardedAccumulation::UnshardedGradients) {
      auto guard = fsdp.no_sync();
      step();
    } else {
      step();
      if (!last) fsdp.continue_accumulation();
    }
  }
  return total;
}

}  // namespace gradsync
