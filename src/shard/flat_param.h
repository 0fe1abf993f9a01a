// defines: FlatParam, one FSDP unit's parameters as a single flat buffer padded to a multiple of the world size:
// the master shard each rank owns (what the optimizer steps), the gathered full buffer the module's parameters
// are views of (what forward and backward compute with), and the unsharded gradient buffer their .grad are views
// of until it is reduced into the shard's gradient.
//
//   full buffer  [ p0 | p1 | ... | padding ]       padded_numel = N * shard_numel, compute dtype
//   rank r owns  [ r*shard_numel, (r+1)*shard_numel )  as a separate tensor (master dtype): shard()
//
// Freeing the full buffer releases its storage in place (at::native::resize_bytes_cpu to 0 bytes); gathering
// re-allocates it and lets the all-gather write into it. Tensors autograd saved in forward are views of that same
// storage, so they see the re-gathered values in backward (libtorch 1.13 keeps the storage object, not its bytes).
// Values are never written through the parameters themselves: that would bump their autograd version counters.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"
#include "gradsync/stats.h"
#include "gradsync/reduction.h"
#include "shard/mixed_precision.h"
#include "shard/sharded_checkpoint.h"
#include "shard/wrap_policy.h"

namespace gradsync {

struct FlatEntry {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel = 0;
};

class FlatParam {
 public:
  // Takes over the unit's parameters: their current values become the flat buffer's, and each parameter becomes a
  // view of the full buffer (gathered on return). `sharded`: each rank owns 1/world of it (FULL_SHARD,
  // SHARD_GRAD_OP); otherwise every rank owns all of it (NO_SHARD). Every parameter must require grad and share
  // one floating dtype (ConfigError otherwise).
  FlatParam(const UnitPlan& plan, int rank, int world, bool sharded, const MixedPrecision& precision);

  const std::string& name() const { return name_; }
  const std::vector<FlatEntry>& entries() const { return entries_; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shard_offset() const { return shard_offset_; }
  c10::ScalarType master_dtype() const { return master_dtype_; }
  c10::ScalarType compute_dtype() const { return compute_dtype_; }
  // Bytes of the gathered full buffer: what the unit adds to a rank's memory while it is gathered.
  int64_t full_bytes() const;

  // The master shard: a leaf that requires grad, in the model's dtype. Build the optimizer over these.
  torch::Tensor& shard() { return shard_; }
  const torch::Tensor& shard() const { return shard_; }
  // This rank's part of each parameter (entries() order): 1-D leaves that require grad, views of the shard's storage
  // (empty where the parameter lies outside the shard), their gradients views of the shard's after each
  // reduction. What optimizer parameter groups over the original names step.
  const std::vector<torch::Tensor>& pieces() const { return pieces_; }
  int64_t piece_offset(size_t i) const;  // where piece i starts within the shard
  void clear_shard_grad();  // the shard's gradient and its pieces' become undefined

  bool gathered() const { return gathered_; }
  // The full buffer is the master shard itself (one owner, no casting): nothing to gather or free.
  bool aliases_master() const { return aliases_master_; }
  void gather(Collectives& comm, CommStats& stats);  // start_gather + wait_gathered
  // Starts the all-gather into the full buffer (gathered() is true from here: the storage exists); the values are
  // there once wait_gathered() returns. No-op when gathered.
  void start_gather(Collectives& comm, CommStats& stats);
  void wait_gathered();                              // no-op when no all-gather is in flight
  // All-gathers the shards into the full buffer again, in the storage it has (ZeRO-1 after a step: no free and
  // re-allocation of the whole model every step); returns when done.
  void refresh(Collectives& comm, CommStats& stats);
  void free();                                       // no-op when aliasing the master or already free

  bool has_grad_buffer() const { return grad_buffer_.defined(); }
  // Allocates the unsharded gradient buffer, uninitialised: a parameter's region is written when its gradient is
  // taken (take_grad), and start_reduce() zeroes the regions no gradient reached. A gradient autograd created
  // before the buffer existed is taken at once. No-op when allocated.
  void ensure_grad_buffer();
  // From parameter i's gradient hook: its fresh gradient is copied into its region and .grad becomes that region,
  // so later backwards (no_sync) add into it in place. No-op when .grad already is the region.
  void take_grad(size_t i);
  // Reduces the unsharded gradient over ranks in the reduce dtype (see Note [Mixed precision on Gloo]): multiplied
  // by `factor` first (1/N for Mean, 1 for Sum, 1/T for GlobalMean: Note [Where the division happens]), then
  // SUMmed; adds this rank's part to shard().grad() (sets it when undefined), then releases the buffer:
  // reduce-scatter when sharded, allreduce otherwise. In two halves: the reduction starts (the gradient buffer must
  // not change until finish_reduce(), which waits for it, adds this rank's part into shard().grad() and releases
  // the buffer). finish_reduce() is a no-op when none is in flight.
  void start_reduce(Collectives& comm, double factor, CommStats& stats);
  void finish_reduce();
  // Hybrid sharding (Note [Hybrid sharding] in docs/semantics.md): finish_reduce() adds this rank's reduced part
  // into a pending shard gradient (wire dtype, summed over the micro-steps that reduce) instead of the shard's .grad;
  // all_reduce_pending() SUM-all-reduces it across the replicas, and finish_pending() adds it into .grad.
  void defer_to_replicas() { defers_ = true; }
  bool has_pending() const { return pending_.defined(); }
  void drop_pending() { pending_ = torch::Tensor(); }  // zero_grad(): a step's unfinished sum goes too
  PendingWork all_reduce_pending(Collectives& replicas, CommStats& stats);
  void finish_pending();
  void release_grad_buffer();  // .grad of the parameters becomes undefined

  // The full padded master values, gathered from every rank (a collective when sharded).
  torch::Tensor full_master(Collectives& comm);
  // The same of the shard's gradient (zeros where undefined).
  torch::Tensor full_master_grad(Collectives& comm);
  // Every rank's `mine` (a tensor of shard_numel() values: a shard's gradient, its optimizer state) as one padded
  // whole; a collective when sharded.
  torch::Tensor gather_shards(Collectives& comm, const torch::Tensor& mine) const;
  // Takes this rank's part of `full` (padded_numel master values) as its shard; the full buffer is freed so the
  // next gather sees the new values.
  void load_full_master(const torch::Tensor& full);

  void count_params(StorageBytes& bytes) const;
  void count_grads(StorageBytes& bytes) const;

 private:
  void bind_params_to_full();
  void make_pieces();
  void bind_piece_grads();
  void zero_untaken();  // the regions no gradient was taken into, and the padding
  void add_to_shard_grad(torch::Tensor mine);  // a reduced part (wire dtype) into the shard's .grad, buffer released
  void fill_full(Collectives& comm, CommStats& stats);

  std::string name_;
  std::vector<FlatEntry> entries_;
  std::vector<torch::Tensor> params_;
  int rank_ = 0, world_ = 1;
  bool sharded_ = false;
  MixedPrecision precision_;
  c10::ScalarType master_dtype_ = torch::kFloat, compute_dtype_ = torch::kFloat;
  int64_t numel_ = 0, padded_numel_ = 0, shard_numel_ = 0, shard_offset_ = 0;
  torch::Tensor shard_;        // master shard (leaf, requires grad)
  std::vector<torch::Tensor> pieces_;  // views of shard_, one per entry
  torch::Tensor full_;         // full buffer in the compute dtype; storage freed when not gathered
  torch::Tensor grad_buffer_;  // unsharded gradient (compute dtype), undefined when released
  PendingWork gather_work_;    // the all-gather into full_ in flight, if any
  PendingWork reduce_work_;    // the reduction into reduced_ in flight, if any
  torch::Tensor reduced_;      // this rank's reduced part (wire dtype) until finish_reduce(); undefined otherwise
  torch::Tensor pending_;      // hybrid: reduced parts not yet all-reduced across replicas (wire dtype)
  bool defers_ = false;        // hybrid: see defer_to_replicas()
  bool aliases_master_ = false;
  bool gathered_ = false;
};

// Every flat parameter's pieces under their parameters' names, in the flats' order.
torch::OrderedDict<std::string, torch::Tensor> named_pieces(const std::vector<FlatParam*>& flats);

// What a sharded checkpoint saves of each flat parameter and loads into it (sharded_checkpoint.h), in order.
std::vector<ShardSlot> shard_slots(const std::vector<FlatParam*>& flats);

// Parameters and gradients of these flat parameters (each storage once) and the optimizer's state: what a
// sharded engine holds, sampled whenever it allocates or frees.
MemoryBreakdown count_memory(const std::vector<FlatParam*>& flats, const torch::optim::Optimizer* optimizer);

}  // namespace gradsync
