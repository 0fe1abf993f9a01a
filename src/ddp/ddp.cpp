// DistributedDataParallel: the engine interface over a Reducer (see ddp.h).
#include "gradsync/ddp.h"

#include <fmt/format.h>

#include <cmath>

#include "common/clip_grad.h"
#include "common/consistency.h"
#include "ddp/reducer.h"
#include "engine/replica.h"
#include "gradsync/error.h"

namespace gradsync {

DistributedDataParallel::DistributedDataParallel(const ModuleRef& module, std::shared_ptr<World> world,
                                                 DdpOptions options)
    : Engine(module), reducer_(std::make_shared<Reducer>()) {
  if (!(options.bucket_cap_mb() > 0) || !std::isfinite(options.bucket_cap_mb())) {
    throw ConfigError(fmt::format("DistributedDataParallel: bucket_cap_mb={} is invalid; expected a finite "
                                  "number > 0 (PyTorch's default is 25)", options.bucket_cap_mb()));
  }
  reducer_->module = module.module;
  reducer_->world = std::move(world);
  reducer_->options = options;
  reducer_->set_up(reducer_);
}

DistributedDataParallel::~DistributedDataParallel() = default;

bool DistributedDataParallel::require_sync() const { return reducer_->require_backward_sync; }
void DistributedDataParallel::set_require_sync(bool sync) { reducer_->require_backward_sync = sync; }
std::vector<torch::Tensor> DistributedDataParallel::parameters() const { return reducer_->params; }

// Releases the gradients, as FSDP and ZeRO-1 do (and PyTorch 2's set_to_none=True); see Reducer::release_grads().
void DistributedDataParallel::zero_grad() { reducer_->release_grads(); }

double DistributedDataParallel::clip_grad_norm(double max_norm, double norm_type) {
  return gradsync::clip_grad_norm(reducer_->params, max_norm, norm_type, /*spread_over=*/nullptr);
}

void DistributedDataParallel::track_optimizer(const torch::optim::Optimizer* optimizer) {
  reducer_->optimizer = optimizer;
  reducer_->sample_memory();
}

StateDict DistributedDataParallel::state_dict(bool rank0_only) {
  if (rank0_only && reducer_->rank() != 0) return {};
  StateDict out;
  for (const auto& [name, tensor] : gradsync::state_dict(*reducer_->module)) {
    out.emplace_back(name, tensor.detach().clone());
  }
  return out;
}

void DistributedDataParallel::load_state_dict(const StateDict& state) {
  auto& comm = reducer_->world->comm();
  // Strict on rank 0 (load_into checks every key first); its values then overwrite every replica's.
  fail_together_on_throw(comm, "DistributedDataParallel: load_state_dict", [&] {
    if (comm.rank() == 0) load_into(*reducer_->module, state);
  });
  broadcast_from_rank0(comm, *reducer_->module);
}

MemoryStats DistributedDataParallel::memory() const {
  reducer_->sample_memory();
  return reducer_->meter.stats();
}

CommStats DistributedDataParallel::traffic() const { return reducer_->traffic; }
torch::nn::Module& DistributedDataParallel::module() { return *reducer_->module; }
Reduction DistributedDataParallel::reduction() const { return reducer_->options.reduction(); }
Collectives* DistributedDataParallel::comm() { return &reducer_->world->comm(); }
void DistributedDataParallel::begin_forward() { reducer_->before_forward(); }
void DistributedDataParallel::end_forward() { reducer_->after_forward(); }
void DistributedDataParallel::join_backward() { reducer_->join_backward(); }

void DistributedDataParallel::set_global_item_count(int64_t items) {
  if (items < 0) throw ConfigError(fmt::format("global item count {} is invalid; expected >= 0", items));
  reducer_->global_items = items;
}

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  auto& r = *reducer_;
  if (!hook) throw ConfigError("DistributedDataParallel::register_comm_hook: the hook is empty");
  if (r.comm_hook) throw ConfigError("DistributedDataParallel::register_comm_hook: a hook is already registered");
  if (r.synced_once || r.expect_hooks) {
    throw ConfigError("DistributedDataParallel::register_comm_hook: register the hook before the first forward");
  }
  r.comm_hook = std::move(hook);
}

const DdpOptions& DistributedDataParallel::options() const { return reducer_->options; }
World& DistributedDataParallel::world() { return *reducer_->world; }
size_t DistributedDataParallel::bucket_count() const { return reducer_->buckets.size(); }

// Three states: rebuilt ("bucket_order": the order; empty when the initial layout was kept because rank 0 joined),
// a rebuild due at the next forward ("ready_order": rank 0's gradient order, which that rebuild will broadcast), or
// nothing yet (no entry). Never with find_unused_parameters, where buckets are not rebuilt.
StateDict DistributedDataParallel::layout_state() const {
  std::lock_guard<std::mutex> lock(reducer_->mutex);
  const auto& r = *reducer_;
  const auto as_tensor = [](const std::vector<size_t>& order) {
    return torch::tensor(std::vector<int64_t>(order.begin(), order.end()), torch::kLong);
  };
  if (r.options.find_unused_parameters()) return {};
  if (r.rebuilt) return {{"bucket_order", as_tensor(r.rebuilt_order)}};
  if (r.synced_once && r.ready_order.size() == r.params.size()) return {{"ready_order", as_tensor(r.ready_order)}};
  return {};
}

namespace {

// A permutation of 0..n-1 (empty allowed for bucket_order: the initial layout), or a ConfigError.
std::vector<size_t> order_of(const std::string& name, const torch::Tensor& t, size_t n) {
  std::vector<size_t> order;
  std::vector<bool> seen(n, false);
  bool valid = t.dim() == 1 && t.scalar_type() == torch::kLong &&
               (t.numel() == static_cast<int64_t>(n) || (name == "bucket_order" && t.numel() == 0));
  for (int64_t i = 0; valid && i < t.numel(); ++i) {
    const int64_t p = t[i].item<int64_t>();
    valid = p >= 0 && p < static_cast<int64_t>(n) && !seen[static_cast<size_t>(p)];
    if (valid) seen[static_cast<size_t>(p)] = true;
    order.push_back(static_cast<size_t>(p));
  }
  if (!valid) {
    throw ConfigError(fmt::format("DistributedDataParallel: layout state '{}' is not an order of this model's {} "
                                  "trainable parameters (a permutation of 0..{})", name, n, n - 1));
  }
  return order;
}

}  // namespace

// Every rank loads the same state (a checkpoint's), so the layouts agree without a broadcast.
void DistributedDataParallel::load_layout_state(const StateDict& state) {
  std::lock_guard<std::mutex> lock(reducer_->mutex);
  auto& r = *reducer_;
  if (state.empty() || r.options.find_unused_parameters()) return;
  const auto& [name, tensor] = state.front();
  if (state.size() != 1 || (name != "bucket_order" && name != "ready_order")) {
    throw ConfigError(fmt::format("DistributedDataParallel: layout state has {} entries (first '{}'); expected one, "
                                  "bucket_order or ready_order", state.size(), name));
  }
  auto order = order_of(name, tensor, r.params.size());
  if (name == "ready_order") {
    r.ready_order = std::move(order);
    r.rebuild_due = true;  // the next forward rebuilds, as after this run's own first synchronised backward
  } else if (order.empty()) {
    r.rebuilt = true;  // the initial layout stays
  } else {
    r.rebuild_buckets(order);
  }
}

BackwardTimeline DistributedDataParallel::last_timeline() const {
  std::lock_guard<std::mutex> lock(reducer_->mutex);
  return reducer_->timeline;
}

}  // namespace gradsync
