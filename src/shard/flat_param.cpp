// One unit's flat, padded, sharded parameter (see flat_param.h).
#include "shard/flat_param.h"

#include <ATen/native/Resize.h>
#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

void resize_storage(const torch::Tensor& t, int64_t bytes) {
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), static_cast<size_t>(bytes));
}

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// n values of t from `offset` on, as a tensor of its own on t's storage rather than an autograd view: what a
// gradient may be, since optimizer.zero_grad() detaches gradients in place and views refuse that.
torch::Tensor alias_of(const torch::Tensor& t, int64_t offset, int64_t n) {
  torch::NoGradGuard no_grad;
  return torch::empty({0}, t.options()).set_(t.storage(), t.storage_offset() + offset, {n}, {1});
}

}  // namespace

FlatParam::FlatParam(const UnitPlan& plan, int rank, int world, bool sharded, const MixedPrecision& precision)
    : name_(plan.name), params_(plan.params), rank_(rank), world_(world), sharded_(sharded), precision_(precision) {
  if (params_.empty()) throw ConfigError(fmt::format("FSDP unit '{}' has no parameters", name_));
  master_dtype_ = params_.front().scalar_type();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    if (!p.requires_grad()) {
      throw ConfigError(fmt::format("FSDP unit '{}': parameter '{}' does not require grad; frozen parameters are "
                                    "not supported in a flat parameter", name_, plan.param_names[i]));
    }
    if (p.scalar_type() != master_dtype_ || !p.is_floating_point()) {
      throw ConfigError(fmt::format("FSDP unit '{}': parameter '{}' is {}, the unit's first is {}; a unit needs one "
                                    "floating dtype", name_, plan.param_names[i], c10::toString(p.scalar_type()),
                                    c10::toString(master_dtype_)));
    }
    entries_.push_back({plan.param_names[i], p.sizes().vec(), numel_, p.numel()});
    numel_ += p.numel();
  }
  compute_dtype_ = precision_.compute(master_dtype_);
  padded_numel_ = sharded_ ? round_up(numel_, world_) : numel_;
  shard_numel_ = sharded_ ? padded_numel_ / world_ : numel_;
  shard_offset_ = sharded_ ? rank_ * shard_numel_ : 0;

  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  for (const auto& p : params_) parts.push_back(p.detach().reshape({-1}));
  if (padded_numel_ > numel_) parts.push_back(torch::zeros({padded_numel_ - numel_}, parts.front().options()));
  auto full_master = torch::cat(parts);

  aliases_master_ = shard_numel_ == padded_numel_ && compute_dtype_ == master_dtype_;
  if (aliases_master_) {
    shard_ = full_master;
    full_ = shard_.detach();  // same storage: the parameters are views of the master itself
  } else {
    shard_ = full_master.narrow(0, shard_offset_, shard_numel_).clone();
    full_ = full_master.to(compute_dtype_).contiguous();  // every rank has the full values here: no gather
  }
  shard_.requires_grad_(true);
  gathered_ = true;
  bind_params_to_full();
  make_pieces();
}

// [lo, hi) of each parameter within this rank's shard, as views of the shard's storage: what an optimizer over the
// original parameters steps in place.
void FlatParam::make_pieces() {
  for (const auto& e : entries_) {
    const int64_t lo = std::max(e.offset, shard_offset_);
    const int64_t hi = std::min(e.offset + e.numel, shard_offset_ + shard_numel_);
    auto piece = shard_.detach().narrow(0, hi > lo ? lo - shard_offset_ : 0, std::max<int64_t>(hi - lo, 0));
    piece.requires_grad_(true);
    pieces_.push_back(piece);
  }
}

int64_t FlatParam::piece_offset(size_t i) const { return pieces_[i].storage_offset() - shard_.storage_offset(); }

void FlatParam::bind_piece_grads() {
  const auto& grad = shard_.grad();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    auto& piece = pieces_[i];
    piece.mutable_grad() = grad.defined() ? alias_of(grad, piece_offset(i), piece.numel()) : torch::Tensor();
  }
}

void FlatParam::clear_shard_grad() {
  shard_.mutable_grad() = torch::Tensor();
  bind_piece_grads();
}

void FlatParam::bind_params_to_full() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = entries_[i];
    auto& p = params_[i];
    // set_data keeps the parameter's identity (module registration, autograd meta); a dtype change resets its
    // gradient accumulator, so hooks are installed after this (fsdp.cpp).
    p.set_data(full_.narrow(0, e.offset, e.numel).view(e.shape));
    p.mutable_grad() = torch::Tensor();
  }
}

int64_t FlatParam::full_bytes() const {
  return padded_numel_ * static_cast<int64_t>(c10::elementSize(compute_dtype_));
}

void FlatParam::gather(Collectives& comm, CommStats& stats) {
  start_gather(comm, stats);
  wait_gathered();
}

void FlatParam::start_gather(Collectives& comm, CommStats& stats) {
  if (aliases_master_ || gathered_) return;
  fill_full(comm, stats);
}

void FlatParam::refresh(Collectives& comm, CommStats& stats) {
  if (aliases_master_) return;
  wait_gathered();
  fill_full(comm, stats);
  wait_gathered();
}

// The full buffer's storage (allocated when freed) receives every rank's shard.
void FlatParam::fill_full(Collectives& comm, CommStats& stats) {
  torch::NoGradGuard no_grad;
  if (!gathered_) resize_storage(full_, full_bytes());
  if (!sharded_) {
    full_.copy_(shard_.detach());  // NO_SHARD with a compute dtype: a local cast, no communication
  } else {
    auto input = shard_.detach().to(compute_dtype_).contiguous();
    auto source = gloo_copyable(input);
    auto output = gloo_copyable(full_);
    gather_work_ = comm.allgather_flat_async(source, output);
    stats.add_allgather(full_bytes(), world_);
  }
  gathered_ = true;
}

void FlatParam::wait_gathered() { gather_work_.wait(); }

void FlatParam::free() {
  if (aliases_master_ || !gathered_) return;
  wait_gathered();  // never release storage an all-gather is still writing
  resize_storage(full_, 0);
  gathered_ = false;
}

// Uninitialised, and filled by copies: zeroing the buffer first and letting AccumulateGrad add into the zeros cost
// two more passes over every unsharded gradient per step (docs/performance.md).
void FlatParam::ensure_grad_buffer() {
  if (grad_buffer_.defined()) return;
  grad_buffer_ = torch::empty({padded_numel_}, torch::TensorOptions().dtype(compute_dtype_));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad().defined()) take_grad(i);  // a gradient autograd made before the buffer existed
  }
}

void FlatParam::take_grad(size_t i) {
  ensure_grad_buffer();
  torch::NoGradGuard no_grad;
  const auto& e = entries_[i];
  auto view = grad_buffer_.narrow(0, e.offset, e.numel).view(e.shape);
  auto& grad = params_[i].mutable_grad();
  if (grad.defined() && grad.data_ptr() == view.data_ptr()) return;  // taken: AccumulateGrad added into it in place
  if (grad.defined()) {
    view.copy_(grad);
  } else {
    view.zero_();  // no gradient on this rank: it contributes zeros
  }
  grad = view;
}

void FlatParam::zero_untaken() {
  for (size_t i = 0; i < params_.size(); ++i) take_grad(i);
  if (padded_numel_ > numel_) grad_buffer_.narrow(0, numel_, padded_numel_ - numel_).zero_();
}

void FlatParam::release_grad_buffer() {
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  grad_buffer_ = torch::Tensor();
}

void FlatParam::start_reduce(Collectives& comm, double factor, CommStats& stats) {
  zero_untaken();  // a unit, or a parameter, that received no gradient on this rank contributes zeros
  torch::NoGradGuard no_grad;
  const auto reduce_dtype = precision_.reduce(master_dtype_);
  const auto wire_dtype = gloo_reduce_dtype(reduce_dtype);
  auto grad = grad_buffer_.scalar_type() == reduce_dtype ? grad_buffer_ : grad_buffer_.to(reduce_dtype);
  // See Note [Where the division happens]: x 1/N (or 1/T) first, then a SUM, as DDP does (in the reduce dtype).
  if (factor != 1.0) grad.mul_(factor);
  if (wire_dtype != reduce_dtype) grad = grad.to(wire_dtype);  // See Note [Mixed precision on Gloo]
  if (world_ == 1) {
    reduced_ = grad.narrow(0, 0, shard_numel_);
  } else if (sharded_) {
    reduced_ = torch::empty({shard_numel_}, grad.options());
    reduce_work_ = comm.reduce_scatter_async(grad, reduced_, Reduction::Sum);
    stats.add_reduce_scatter(grad.numel() * static_cast<int64_t>(grad.element_size()), world_);
  } else {
    reduce_work_ = comm.allreduce_sum_async(grad);
    stats.add_allreduce(grad.numel() * static_cast<int64_t>(grad.element_size()), world_);
    reduced_ = grad;
  }
}

void FlatParam::finish_reduce() {
  if (!reduced_.defined()) return;
  reduce_work_.wait();
  auto mine = std::move(reduced_);
  reduced_ = torch::Tensor();
  if (!defers_) return add_to_shard_grad(std::move(mine));
  torch::NoGradGuard no_grad;
  // May alias the released gradient buffer (one rank per shard group): the pending sum owns it from here.
  pending_ = pending_.defined() ? pending_.add_(mine) : mine.contiguous();
  release_grad_buffer();
}

PendingWork FlatParam::all_reduce_pending(Collectives& replicas, CommStats& stats) {
  if (replicas.size() == 1) return {};
  stats.add_replica_allreduce(pending_.numel() * static_cast<int64_t>(pending_.element_size()), replicas.size());
  return replicas.allreduce_sum_async(pending_);
}

void FlatParam::finish_pending() {
  auto mine = std::move(pending_);
  pending_ = torch::Tensor();
  add_to_shard_grad(std::move(mine));
}

void FlatParam::add_to_shard_grad(torch::Tensor mine) {
  torch::NoGradGuard no_grad;
  const auto reduce_dtype = precision_.reduce(master_dtype_);
  if (mine.scalar_type() != reduce_dtype) mine = mine.to(reduce_dtype);  // See Note [Mixed precision on Gloo]
  if (mine.scalar_type() != master_dtype_) mine = mine.to(master_dtype_);
  auto& shard_grad = shard_.mutable_grad();
  if (shard_grad.defined()) {
    shard_grad.add_(mine);
  } else {
    // May alias the gradient buffer (NO_SHARD, no casting): releasing the buffer below only drops the parameters'
    // views of it, so the shard gradient owns it from here.
    shard_grad = mine.is_contiguous() ? alias_of(mine, 0, mine.numel()) : mine.contiguous();
  }
  bind_piece_grads();
  release_grad_buffer();
}

torch::Tensor FlatParam::gather_shards(Collectives& comm, const torch::Tensor& mine) const {
  torch::NoGradGuard no_grad;
  if (!sharded_ || world_ == 1) return mine;
  auto full = torch::empty({padded_numel_}, mine.options().requires_grad(false));
  auto output = gloo_copyable(full);
  comm.allgather_flat(gloo_copyable(mine), output);
  return full;
}

torch::Tensor FlatParam::full_master(Collectives& comm) { return gather_shards(comm, shard_.detach()); }

torch::Tensor FlatParam::full_master_grad(Collectives& comm) {
  const auto& grad = shard_.grad();
  return gather_shards(comm, grad.defined() ? grad.detach() : torch::zeros_like(shard_.detach()));
}

void FlatParam::load_full_master(const torch::Tensor& full) {
  if (full.numel() != padded_numel_) {
    throw ConfigError(fmt::format("FSDP unit '{}': {} values given for a flat parameter of {}", name_, full.numel(),
                                  padded_numel_));
  }
  torch::NoGradGuard no_grad;
  shard_.detach().copy_(full.narrow(0, shard_offset_, shard_numel_));
  free();
}

void FlatParam::count_params(StorageBytes& bytes) const {
  bytes.add(shard_);
  if (gathered_) bytes.add(full_);
}

void FlatParam::count_grads(StorageBytes& bytes) const {
  bytes.add(shard_.grad());
  bytes.add(grad_buffer_);
  bytes.add(pending_);
}

MemoryBreakdown count_memory(const std::vector<FlatParam*>& flats, const torch::optim::Optimizer* optimizer) {
  StorageBytes params, grads;
  for (const FlatParam* f : flats) {
    f->count_params(params);
    f->count_grads(grads);
  }
  return {params.bytes(), grads.bytes(), optimizer ? optimizer_state_bytes(*optimizer) : 0};
}

torch::OrderedDict<std::string, torch::Tensor> named_pieces(const std::vector<FlatParam*>& flats) {
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto* f : flats) {
    for (size_t i = 0; i < f->entries().size(); ++i) out.insert(f->entries()[i].name, f->pieces()[i]);
  }
  return out;
}

std::vector<ShardSlot> shard_slots(const std::vector<FlatParam*>& flats) {
  std::vector<ShardSlot> slots;
  for (auto* f : flats) slots.push_back({f->name(), f->numel(), f->padded_numel(), f->shard_offset(), f->shard()});
  return slots;
}

}  // namespace gradsync
