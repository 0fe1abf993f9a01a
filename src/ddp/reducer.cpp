// The DDP gradient engine (see reducer.h for one gradient's path).
#include "ddp/reducer.h"

#include <chrono>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "ddp/bucket.h"
#include "common/consistency.h"
#include "gradsync/error.h"

namespace gradsync {

using Clock = std::chrono::steady_clock;

struct Reducer::State {
  struct Slot {
    size_t bucket = 0;
    torch::Tensor view;  // this parameter's region of its bucket, shaped like the parameter
    bool ready = false;  // its gradient has been copied into the bucket in this backward
  };
  struct Bucket {
    torch::Tensor flat;
    std::vector<size_t> params;
    size_t pending = 0;  // parameters whose gradient is not in the bucket yet
    PendingWork work;
  };

  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  DdpOptions options;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> buffers;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // hooks live only while these do
  std::vector<Slot> slots;
  std::vector<Bucket> buckets;

  std::mutex mutex;
  bool require_backward_sync = true;   // false inside no_sync()
  bool require_forward_param_sync = true;  // PyTorch: broadcast buffers before a forward following a synced one
  bool expect_hooks = false;           // a synced forward armed the coming backward
  bool callback_queued = false;
  size_t next_launch = 0;              // buckets launch strictly in index order on every rank
  bool rebuilt = false;                // the layout follows the observed gradient order (once)
  std::vector<size_t> ready_order;     // gradient order seen in the first synchronised backward
  std::optional<int64_t> global_items; // Reduction::GlobalMean: items in this step over all ranks
  Clock::time_point backward_start;
  BackwardTimeline timeline;

  int rank() const { return world->rank(); }
  int size() const { return world->size(); }
  double ms_since_start() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - backward_start).count();
  }

  void mark_ready(size_t index, const std::weak_ptr<State>& self);
  void copy_into_bucket(size_t index);
  void launch_ready_buckets();
  void finalize(bool joined);
  double bucket_scale() const;
  std::vector<size_t> zero_unused();
  std::vector<bool> globally_used(const std::vector<size_t>& unused);
  void write_back(const std::vector<bool>& used_anywhere);
  void reset();
  void build_buckets(const std::vector<BucketPlan>& layout);
  void maybe_rebuild_buckets();
};

namespace {

// Called by autograd after AccumulateGrad has updated .grad, once per backward per parameter.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<Reducer::State> state, size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto state = state_.lock()) state->mark_ready(index_, state_);
    return outputs;
  }

 private:
  std::weak_ptr<Reducer::State> state_;  // the hook outlives the reducer inside autograd's graph
  size_t index_;
};

}  // namespace

void Reducer::State::mark_ready(size_t index, const std::weak_ptr<State>& self) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!expect_hooks) return;  // no_sync, or no synced forward armed this backward
  if (!callback_queued) {
    if (options.reduction == Reduction::GlobalMean && !global_items) {
      throw ConfigError(fmt::format(
          "DistributedDataParallel on rank {}: Reduction::GlobalMean needs the step's item count over all ranks "
          "before the synchronising backward; use gradsync::accumulate_global_mean() or "
          "Reducer::set_global_item_count()", rank()));
    }
    callback_queued = true;
    backward_start = Clock::now();
    timeline = BackwardTimeline{};
    ready_order.clear();
    // Runs once the autograd engine has finished this backward, before backward() returns.
    torch::autograd::Engine::get_default_engine().queue_callback([self] {
      if (auto state = self.lock()) state->finalize(/*joined=*/false);
    });
  }
  auto& slot = slots[index];
  if (slot.ready) {
    throw DistributedError(fmt::format("DistributedDataParallel on rank {}: parameter '{}' received a gradient "
                                       "twice in one backward; call forward again before another backward",
                                       rank(), names[index]));
  }
  if (!rebuilt && !options.find_unused_parameters) ready_order.push_back(index);
  copy_into_bucket(index);
  slot.ready = true;
  timeline.last_hook_ms = ms_since_start();
  if (--buckets[slot.bucket].pending == 0) launch_ready_buckets();
}

// The factor folded into the copy of .grad into its bucket (see Note [Where the division happens]).
double Reducer::State::bucket_scale() const {
  switch (options.reduction) {
    case Reduction::Mean: return 1.0 / size();
    case Reduction::Sum: return 1.0;
    case Reduction::GlobalMean: return *global_items > 0 ? 1.0 / static_cast<double>(*global_items) : 0.0;
  }
  return 1.0;
}

void Reducer::State::copy_into_bucket(size_t index) {
  torch::NoGradGuard no_grad;
  const auto& grad = params[index].grad();
  auto& view = slots[index].view;
  const bool aliased = grad.defined() && grad.data_ptr() == view.data_ptr();
  const double scale = bucket_scale();
  if (scale != 1.0) {
    // One pass over the gradient: the scaling happens while copying, as in PyTorch DDP.
    if (aliased) {
      view.mul_(scale);
    } else {
      at::mul_out(view, grad, c10::scalar_to_tensor(c10::Scalar(scale)));
    }
  } else if (!aliased) {
    view.copy_(grad);
  }
}

void Reducer::State::launch_ready_buckets() {
  // Collectives must be issued in the same order on every rank: bucket i waits for buckets < i.
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
    auto& bucket = buckets[next_launch];
    bucket.work = world->comm().allreduce_sum_async(bucket.flat);
    timeline.bucket_launch_ms.push_back(ms_since_start());
    ++next_launch;
  }
}

std::vector<size_t> Reducer::State::zero_unused() {
  std::vector<size_t> unused;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].ready) continue;
    unused.push_back(i);
    slots[i].view.zero_();  // an unused parameter contributes zeros, still counted in the 1/N
    slots[i].ready = true;
    --buckets[slots[i].bucket].pending;
  }
  return unused;
}

// PyTorch leaves .grad untouched for a parameter unused on every rank; that needs one small allreduce.
std::vector<bool> Reducer::State::globally_used(const std::vector<size_t>& unused) {
  std::vector<bool> used(params.size(), true);
  if (!options.find_unused_parameters) return used;
  auto local = torch::ones({static_cast<int64_t>(params.size())}, torch::kLong);
  for (size_t i : unused) local[static_cast<int64_t>(i)] = 0;
  world->comm().allreduce(local, Reduction::Sum);
  for (size_t i = 0; i < params.size(); ++i) used[i] = local[static_cast<int64_t>(i)].item<int64_t>() > 0;
  return used;
}

void Reducer::State::write_back(const std::vector<bool>& used_anywhere) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!used_anywhere[i]) continue;
    auto& param = params[i];
    const auto& view = slots[i].view;
    auto& grad = param.mutable_grad();
    if (options.gradient_as_bucket_view) {
      if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = view;
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
}

// Ends a synchronised backward (joined: this rank had no data and contributes zeros for every parameter).
void Reducer::State::finalize(bool joined) {
  std::lock_guard<std::mutex> lock(mutex);
  timeline.finalize_ms = ms_since_start();
  auto unused = zero_unused();
  launch_ready_buckets();
  try {
    for (auto& bucket : buckets) bucket.work.wait();
    write_back(globally_used(unused));
  } catch (...) {
    reset();
    throw;
  }
  reset();
  if (!joined && !unused.empty() && !options.find_unused_parameters) {
    std::vector<std::string> unused_names;
    for (size_t i : unused) unused_names.push_back(names[i]);
    throw DistributedError(fmt::format(
        "DistributedDataParallel on rank {}: parameter(s) {} received no gradient in this backward (they did not "
        "take part in computing the loss). Construct with find_unused_parameters=true if some parameters are "
        "unused in some iterations, or remove them from the model",
        rank(), fmt::join(unused_names, ", ")));
  }
}

void Reducer::State::reset() {
  for (auto& slot : slots) slot.ready = false;
  for (auto& bucket : buckets) {
    bucket.pending = bucket.params.size();
    bucket.work = PendingWork();
  }
  next_launch = 0;
  expect_hooks = false;
  callback_queued = false;
  global_items.reset();
}

void Reducer::State::build_buckets(const std::vector<BucketPlan>& layout) {
  torch::NoGradGuard no_grad;
  buckets.clear();
  slots.assign(params.size(), Slot{});
  for (const auto& plan : layout) {
    Bucket bucket;
    bucket.flat = torch::zeros({plan.numel}, torch::TensorOptions().dtype(plan.dtype));
    for (const auto& entry : plan.entries) {
      auto& slot = slots[entry.param];
      slot.bucket = buckets.size();
      slot.view = bucket.flat.narrow(0, entry.offset, entry.numel).view(params[entry.param].sizes());
      bucket.params.push_back(entry.param);
      // Gradients that alias the old buckets move into the new ones.
      auto& grad = params[entry.param].mutable_grad();
      if (options.gradient_as_bucket_view && grad.defined()) {
        slot.view.copy_(grad);
        grad = slot.view;
      }
    }
    bucket.pending = bucket.params.size();
    buckets.push_back(std::move(bucket));
  }
}

// PyTorch rebuilds its buckets once, before the forward that follows the first synchronised backward, in the
// order gradients became ready; rank 0's order is broadcast so every rank uses the same layout.
void Reducer::State::maybe_rebuild_buckets() {
  if (rebuilt || options.find_unused_parameters || ready_order.size() != params.size()) return;
  auto order = torch::tensor(std::vector<int64_t>(ready_order.begin(), ready_order.end()), torch::kLong);
  if (size() > 1) world->comm().broadcast(order, /*root=*/0);
  std::vector<size_t> agreed(params.size());
  for (size_t i = 0; i < agreed.size(); ++i) agreed[i] = static_cast<size_t>(order[static_cast<int64_t>(i)].item<int64_t>());
  build_buckets(rebuilt_bucket_layout(params, agreed, options.first_bucket_bytes, options.bucket_cap_bytes));
  rebuilt = true;
  ready_order.clear();
}

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<World> world, DdpOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.module = std::move(module);
  s.world = std::move(world);
  s.options = options;
  for (const auto& item : s.module->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;  // frozen parameters are neither reduced nor hooked
    s.names.push_back(item.key());
    s.params.push_back(item.value());
  }
  for (const auto& item : s.module->named_buffers(/*recurse=*/true)) s.buffers.push_back(item.value());
  auto& comm = s.world->comm();
  // Same parameters and buffers (names, dtypes, shapes) on every rank, or every rank fails naming the difference.
  check_same_on_every_rank(comm, "DistributedDataParallel", describe_module(*s.module));
  std::vector<torch::Tensor> everything = s.params;
  everything.insert(everything.end(), s.buffers.begin(), s.buffers.end());
  comm.broadcast_coalesced(everything, /*root=*/0);

  s.build_buckets(initial_bucket_layout(s.params, options.find_unused_parameters, options.first_bucket_bytes,
                                        options.bucket_cap_bytes));
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);
    accumulator->add_post_hook(std::make_unique<ReadyHook>(state_, i));
    s.accumulators.push_back(std::move(accumulator));
  }
}

Reducer::~Reducer() = default;

void Reducer::before_forward() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (torch::GradMode::is_enabled() && !s.callback_queued) s.maybe_rebuild_buckets();
  if (s.options.broadcast_buffers && s.require_forward_param_sync && !s.buffers.empty() && s.size() > 1) {
    s.world->comm().broadcast_coalesced(s.buffers, /*root=*/0);
  }
}

void Reducer::after_forward() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  // Mirrors PyTorch: the sync decision is taken at forward time, and a forward that will not sync (no_sync or
  // no grad mode) also skips the buffer broadcast before the next forward.
  const bool sync = torch::GradMode::is_enabled() && s.require_backward_sync;
  s.require_forward_param_sync = sync;
  if (sync && !s.callback_queued) {
    s.reset();
    s.expect_hooks = true;
  } else if (!sync && !s.callback_queued) {
    s.expect_hooks = false;
  }
}

void Reducer::join_backward() {
  auto& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.expect_hooks) {
      throw ConfigError(fmt::format("rank {}: join_backward() needs a preceding synchronised after_forward()",
                                    s.rank()));
    }
    s.backward_start = Clock::now();
    s.timeline = BackwardTimeline{};
  }
  s.finalize(/*joined=*/true);
}

void Reducer::set_global_item_count(int64_t items) {
  if (items < 0) throw ConfigError(fmt::format("global item count {} is invalid; expected >= 0", items));
  state_->global_items = items;
}

World& Reducer::world() { return *state_->world; }

bool Reducer::require_sync() const { return state_->require_backward_sync; }
void Reducer::set_require_sync(bool sync) { state_->require_backward_sync = sync; }

void Reducer::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& param : state_->params) {
    if (param.grad().defined()) param.mutable_grad().zero_();
  }
}

const DdpOptions& Reducer::options() const { return state_->options; }
size_t Reducer::bucket_count() const { return state_->buckets.size(); }

std::vector<std::vector<std::string>> Reducer::bucket_parameter_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& bucket : state_->buckets) {
    out.emplace_back();
    for (size_t i : bucket.params) out.back().push_back(state_->names[i]);
  }
  return out;
}

BackwardTimeline Reducer::last_timeline() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->timeline;
}

}  // namespace gradsync
