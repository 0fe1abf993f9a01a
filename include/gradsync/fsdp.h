// defines: FullyShardedDataParallel (FSDP): data parallelism that shards parameters, gradients and optimizer state
// over the ranks, unit by unit (ZeRO stages 2 and 3), or keeps them whole (NO_SHARD, DDP's arithmetic).
//
//   auto world = gradsync::init();
//   gradsync::FullyShardedDataParallel fsdp(model, world);           // FULL_SHARD, units grouped to >= 25 MiB, mean
//   torch::optim::Adam optimizer(fsdp.parameters(), 1e-3);          // over this rank's shards only
//   fsdp.track_optimizer(&optimizer);                                // its state counts in fsdp.memory()
//   auto loss = loss_fn(fsdp.forward(x), y);
//   loss.backward();                       // on return, each shard's .grad holds its part of the mean gradient
//   optimizer.step();
//   fsdp.zero_grad();
//
// The engine interface (engine.h) is DDP's: no_sync(), accumulate(), clip_grad_norm(), state_dict() (gathered),
// memory() and traffic(); a training loop written for one engine runs this one unchanged.
//
// One unit's life in a FULL_SHARD step (a unit is a group of children chosen by the wrap policy; its parameters
// are one flat buffer, src/shard/flat_param.h):
//   forward   all-gather -> run the unit's children -> free (reshard) once the next unit runs; a hook goes on
//             the unit's output. The forward's last unit stays gathered: the backward starts with it.
//   backward  output hook: all-gather again (not the last unit), allocate the unsharded gradient buffer
//             AccumulateGrad fills it; when the unit's last parameter gradient is in: x 1/N, reduce-scatter (SUM),
//             add into the shard's .grad, free the buffer and the parameters
//   end of backward (queued callback): units that got no gradient contribute zeros; remaining frees
// SHARD_GRAD_OP keeps the parameters gathered from the unit's forward to the end of backward (no second
// all-gather). NO_SHARD keeps everything whole and allreduces, like DDP. Parameters no unit took form the root
// unit, gathered for the whole forward and backward.
//
// Forward needs FSDP to know where units start and end; C++ modules have no forward pre-hooks, so FSDP puts a
// caller into each unit's slot of the torch::nn::Sequential that holds it (at any depth: a Sequential model, or a
// Sequential of blocks inside your own module), and forward(x) runs your module's forward unchanged. A unit that is
// not an element of a Sequential has no slot: run such a model with forward_with(body), calling unit(name, fn)
// around each unit's part (src/shard/wrap_policy.h, Note [Unit slots]). Frozen parameters (requires_grad false)
// belong to no unit: they stay whole on every rank and are never communicated after construction.
//
// Semantics (see Note [Where the division happens]): Reduction::Mean multiplies by 1/N, then SUM-reduces, exactly
// as DDP; the optimizer, elementwise (SGD, Adam), updates each rank's slice with that slice's mean gradient,
// which is the unsharded update. Accumulation: FsdpOptions::accumulation.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/engine.h"
#include "gradsync/stats.h"
#include "gradsync/reduction.h"
#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"

namespace gradsync {

struct WrapPolicy {
  enum class Kind {
    Children,   // every element of the outermost Sequentials (the module itself if it is one) with trainable
                // parameters is a unit (PyTorch: wrap each layer); a module without a Sequential: its children
    MinParams,  // consecutive elements of those Sequentials grouped until a group holds >= min_params parameters
    List,       // the named modules (qualified names: "3", "blocks.0"), one unit each
    Types,      // every module of the named types ("Block", "Linear"), recursively, not inside another unit
  };
  Kind kind = Kind::Children;
  int64_t min_params = 0;
  std::vector<std::string> names;

  static WrapPolicy children();
  static WrapPolicy at_least(int64_t min_params);
  static WrapPolicy list(std::vector<std::string> names);
  static WrapPolicy types(std::vector<std::string> names);
  // The text parse_wrap_policy() reads: "children", "params:N", "list:A,B,...", "type:T,U,...".
  std::string to_string() const;
};

// Parses "children", "params:N" (N >= 1), "list:NAME[,NAME...]" or "type:TYPE[,TYPE...]"; throws ConfigError
// naming the spec otherwise. A unit holds trainable parameters only; the rest form the root unit (wrap_policy.h).
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
  // Hybrid sharding: FullShard / ShardGradOp inside a shard group of S ranks (one host's), the R = N / S groups
  // replicas of each other (FsdpOptions::replicas, src/runtime/mesh.h). A unit's gradient is reduce-scattered in the
  // shard group, and the shard all-reduced across the replicas (Note [Hybrid sharding] in docs/semantics.md).
  HybridShard,
  HybridShardGradOp,
};
const char* to_string(ShardingStrategy strategy);  // "full_shard", ..., "hybrid_shard", "hybrid_shard_grad_op"
bool is_hybrid(ShardingStrategy strategy);
// FullShard and HybridShard: a unit's parameters are freed after each use (ZeRO-3); the others keep them.
bool frees_after_use(ShardingStrategy strategy);

// How K micro-batches combine under FSDP. Both give the same gradient (sum over micro-batches of loss_k/K, mean
// over ranks); they trade memory for communication. Under hybrid sharding the all-reduce across replicas runs once
// per step in both, on the last micro-step:
enum class ShardedAccumulation {
  // K-1 micro-steps under no_sync(): each unit's unsharded gradient buffer stays allocated and sums locally, one
  // reduction per step. Costs a full gradient (Psi x compute dtype) per rank between micro-steps.
  UnshardedGradients,
  // Every micro-step reduce-scatters and adds into the shard gradient: gradient memory stays 1/N, K reductions per
  // step. A rank with fewer micro-batches runs shadow micro-steps (engine.h, begin_step). Not with GlobalMean.
  // Hybrid: the reduce-scattered shards sum over the micro-steps, all-reduced across replicas on the last one.
  ReduceEveryMicroStep,
};

// The default units: consecutive elements grouped until a unit holds this many parameters, 25 MiB of float32, the
// size of DDP's buckets and for the same reason: every collective pays a fixed cost (0.3 ms on Gloo at 2 ranks, ms
// at 4 on 2 cores; docs/performance.md), which units of one small layer each pay many times a step. A model below
// it is one unit, as in PyTorch FSDP without an auto-wrap policy; WrapPolicy::children() gives a unit per layer.
// A module without a Sequential keeps its direct children one unit each (forward_with() runs them by name).
inline constexpr int64_t kDefaultUnitParams = 25 * 1024 * 1024 / 4;

// PyTorch FSDP's constructor arguments, chained like libtorch's options:
//   gradsync::FsdpOptions().strategy(gradsync::ShardingStrategy::ShardGradOp).wrap(gradsync::WrapPolicy::at_least(1 << 20))
struct FsdpOptions {
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::FullShard;
  TORCH_ARG(WrapPolicy, wrap) = WrapPolicy::at_least(kDefaultUnitParams);
  TORCH_ARG(MixedPrecision, mixed_precision);                   // see Note [Mixed precision on Gloo]
  TORCH_ARG(Reduction, reduction) = Reduction::Mean;            // PyTorch DDP/FSDP: mean
  // Rank 0's buffers before a forward that follows a synced one (as DDP).
  TORCH_ARG(bool, broadcast_buffers) = true;
  TORCH_ARG(OrderChecking, order_checking) = OrderChecking::FirstStep;
  TORCH_ARG(ShardedAccumulation, accumulation) = ShardedAccumulation::UnshardedGradients;  // what accumulate() does
  // FULL_SHARD: start the next unit's all-gather while this one computes, in forward (a Sequential's next child
  // unit) and in backward (the unit backward reaches next), with at most two units gathered besides the root
  // (PyTorch's limit_all_gathers). false: one unit at a time, the lowest peak. Reduce-scatters always overlap the
  // rest of backward (one in flight), collected before backward() returns.
  TORCH_ARG(bool, prefetch) = true;
  // Hybrid strategies: R, the number of replicas (N / R ranks shard each); 0: one per host (world size / local
  // world size). R = 1 is FullShard / ShardGradOp over the world, R = N replicates like NoShard.
  TORCH_ARG(int, replicas) = 0;
  // Hybrid strategies: allow a shard group to span hosts (ConfigError otherwise): its all-gathers and
  // reduce-scatters then cross the link between them every unit.
  TORCH_ARG(bool, shard_across_hosts) = false;
};

struct UnitInfo {
  std::string name;
  std::vector<std::string> params;
  int64_t numel = 0, padded_numel = 0, shard_numel = 0;
  int64_t full_bytes = 0;  // gathered parameters in the compute dtype
};

class ShardedUnits;  // the units and when they are gathered, freed and reduced; private to the library

class FullyShardedDataParallel : public Engine {
 public:
  // Checks that every rank has the same model and unit plan (DistributedError otherwise), broadcasts rank 0's
  // parameters and buffers, flattens each unit and keeps this rank's shard. A unit's parameters must share
  // one floating dtype.
  FullyShardedDataParallel(const ModuleRef& module, std::shared_ptr<World> world, FsdpOptions options = {});
  ~FullyShardedDataParallel() override;

  // The module's forward(x), each unit gathered around its slot; ConfigError when a unit has no slot. A floating
  // input is cast to the param dtype; the output is in the param dtype. A unit without a slot: forward_with(body),
  // where body calls unit() around each unit's part, in the same order on every rank (checked in the first step,
  // see OrderChecking).
  torch::Tensor forward(const torch::Tensor& input) override;
  torch::Tensor unit(const std::string& name, const std::function<torch::Tensor()>& fn);

  bool require_sync() const override;
  void set_require_sync(bool sync) override;
  // This rank's shards, one per unit (leaves that require grad): what the optimizer steps.
  std::vector<torch::Tensor> parameters() const override;
  // This rank's part of each original parameter under its state-dict name (1-D, views of the shards, empty where
  // the parameter lies on other ranks), with gradients after each reduction: build optimizer parameter groups over
  // these (e.g. no weight decay on norms and biases) instead of over parameters(), never both.
  torch::OrderedDict<std::string, torch::Tensor> named_parameters() override;
  // Shard gradients become undefined and unsharded gradient buffers are released.
  void zero_grad() override;
  // Clips the shard gradients so the norm of the whole gradient is <= max_norm; call after the synchronising
  // backward. Returns the total norm (the unsharded one), equal on every rank.
  double clip_grad_norm(double max_norm, double norm_type = 2.0) override;
  void track_optimizer(const torch::optim::Optimizer* optimizer) override;
  // Collective: every unit is gathered (master dtype). Buffers are rank 0's.
  StateDict state_dict(bool rank0_only = false) override;
  // Collective: rank 0's state re-sharded. Optimizer state is not touched.
  void load_state_dict(const StateDict& state) override;
  StateDict full_gradients() override;  // collective: one all-gather of shard gradients per unit
  // Collective: one all-gather per unit and state tensor (src/engine/full_optim_state.h).
  c10::IValue full_optim_state_dict(const torch::optim::Optimizer& optimizer, bool rank0_only = true) override;
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state) override;
  MemoryStats memory() const override;
  // Bytes this rank sent in unit collectives since construction; hybrid: the all-reduce across replicas apart
  // (CommStats::across_replicas), the rest inside the shard group.
  CommStats traffic() const override;
  torch::nn::Module& module() override;
  Reduction reduction() const override;
  const char* name() const override { return "FullyShardedDataParallel"; }
  Collectives* comm() override;

  void begin_forward() override;
  void end_forward() override;
  void abort_forward() override;
  // A shadow micro-step replays this rank's last completed micro-step (its unit gathers, frees and reductions, in
  // order) with zero gradients: forward part, then backward part. A rank needs one micro-step of its own first
  // (ConfigError otherwise: the order of units is known only once a forward and backward have run).
  void join_forward() override;
  void join_backward() override;
  void set_global_item_count(int64_t items) override;
  bool reduces_every_micro_step() const override;
  void continue_accumulation() override;
  // Hybrid, reducing every micro-step: whether this micro-step's backward all-reduces the accumulated shard
  // gradients across replicas (accumulate() sets it for the last micro-step only). true by default.
  void set_requires_all_reduce(bool all_reduce) override;
  // One small all-gather of every rank's micro-batch count (and whether it has a micro-step to replay): every rank
  // runs the largest count, a rank with fewer adds shadow micro-steps after its own; ConfigError on every rank
  // where a rank has none of its own to replay.
  int64_t begin_step(int64_t micro_batches) override;

  // Collective. This rank's shards (and the optimizer state of them, if given) in DIR: shard-<rank>-of-<N>.pt, a
  // dict Python's torch.load reads. Loading needs the same world size and units (use state_dict() to change them).
  void save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer = nullptr);
  void load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer = nullptr);

  void reset_peak_memory();
  std::vector<UnitInfo> units() const;
  // Bytes of the largest unit's gathered parameters plus its unsharded gradient: what one unit adds at its peak.
  int64_t largest_unit_bytes() const;
  const FsdpOptions& options() const;

 private:
  std::shared_ptr<ShardedUnits> units_;  // autograd hooks hold weak references to it
};

}  // namespace gradsync
