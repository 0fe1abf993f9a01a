// Join for DistributedDataParallel (see join.h). The ranks' collectives must pair up exactly: a training rank's
// step is [who-is-training allreduce] [buffer broadcast] [bucket allreduces]; a joined rank's shadow step is the same
// sequence with zero gradients (begin_forward, end_forward, join_backward), until the allreduce says nobody trains.
#include "gradsync/join.h"

#include <fmt/format.h>

#include "ddp/reducer.h"
#include "engine/replica.h"
#include "gradsync/error.h"
#include "norm/sync_batch_norm_path.h"

namespace gradsync {
namespace {

// The highest rank whose entry is set; -1 if none.
int highest(const torch::Tensor& one_hot) {
  auto a = one_hot.accessor<float, 1>();
  for (int64_t r = one_hot.numel() - 1; r >= 0; --r) {
    if (a[r] > 0.5f) return static_cast<int>(r);
  }
  return -1;
}

}  // namespace

Join::Join(DistributedDataParallel& ddp, JoinOptions options) : ddp_(ddp), options_(options) {
  // A joined rank's shadow step runs no forward, so it could not meet a SyncBatchNorm's collectives (PyTorch's Join
  // does not support SyncBatchNorm either). Every rank holds the same model: every rank fails here.
  if (const auto path = norm::sync_batch_norm_path(*ddp_.reducer_->module); !path.empty()) {
    throw ConfigError(fmt::format("Join: the model's SyncBatchNorm '{}' communicates in every forward and backward, "
                                  "which a joined rank does not run; give a rank short of data empty batches (zero "
                                  "rows, their loss times 0) instead of joining", path));
  }
}

Join::~Join() {
  auto& r = *ddp_.reducer_;
  r.buffers.set_root(0);
  r.join_divisor.reset();
}

torch::Tensor Join::exchange(bool training) {
  auto& comm = ddp_.reducer_->world->comm();
  auto flags = torch::zeros({comm.size()}, torch::kFloat);
  if (training) flags[comm.rank()] = 1.0f;
  comm.allreduce(flags, Reduction::Sum);
  return flags;
}

int64_t Join::notify() {
  if (joined_) throw ConfigError("Join::notify: this rank has already joined (join() ends its training)");
  const auto flags = exchange(/*training=*/true);
  const auto active = static_cast<int64_t>(flags.sum().item<float>() + 0.5f);
  auto& r = *ddp_.reducer_;
  r.buffers.set_root(highest(flags));
  if (!options_.divide_by_initial_world_size()) r.join_divisor = active;
  return active;
}

int64_t Join::join() {
  if (joined_) throw ConfigError("Join::join: called twice");
  joined_ = true;
  auto& r = *ddp_.reducer_;
  int64_t shadowed = 0;
  while (true) {
    const auto flags = exchange(/*training=*/false);
    const int root = highest(flags);
    if (root < 0) break;
    r.buffers.set_root(root);
    ddp_.begin_step(0);
    ddp_.begin_forward();
    ddp_.end_forward();
    ddp_.join_backward();
    ++shadowed;
  }
  // The last rank(s) to join never shadowed a step; the highest of them holds the model every rank takes.
  const auto last = exchange(/*training=*/shadowed == 0);
  std::vector<torch::Tensor> state;
  for (const auto& p : r.module->parameters()) state.push_back(p.detach());
  for (const auto& b : r.module->buffers()) state.push_back(b);
  torch::NoGradGuard no_grad;
  if (r.size() > 1) r.world->comm().broadcast_coalesced(state, highest(last));
  r.buffers.set_root(0);
  return shadowed;
}

}  // namespace gradsync
