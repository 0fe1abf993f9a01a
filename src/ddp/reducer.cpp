// The DDP gradient engine (see reducer.h; one gradient's path is drawn in ddp.h).
#include "ddp/reducer.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>

#include "engine/grad_hook.h"
#include "gradsync/error.h"

namespace gradsync {

void Reducer::queue_finalize(const std::weak_ptr<Reducer>& self) {
  require_item_count("DistributedDataParallel", rank(), options.reduction(), global_items);
  callback_queued = true;
  backward_start = Clock::now();
  timeline = BackwardTimeline{};
  ready_order.clear();
  // Runs once the autograd engine has finished this backward, before backward() returns.
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto reducer = self.lock()) reducer->finalize(/*joined=*/false);
  });
}

void Reducer::mark_ready(size_t index, const std::weak_ptr<Reducer>& self) {
  std::lock_guard<std::mutex> lock(mutex);
  // As PyTorch's local_used_map: a gradient in a no_sync micro-step makes the parameter used in this step.
  if (params[index].grad().defined()) slots[index].used_since_sync = true;
  if (!expect_hooks) return;  // no_sync, or no synced forward armed this backward
  if (!callback_queued) queue_finalize(self);
  auto& slot = slots[index];
  if (slot.ready) {
    throw DistributedError(fmt::format("DistributedDataParallel on rank {}: parameter '{}' received a gradient "
                                       "twice in one backward; call forward again before another backward",
                                       rank(), names[index]));
  }
  if (!rebuilt && !options.find_unused_parameters()) ready_order.push_back(index);
  copy_into_bucket(index);
  slot.ready = true;
  timeline.last_hook_ms = ms_since_start();
  if (--buckets[slot.bucket].pending == 0) launch_ready_buckets();
}

// What the reduction divides by: N ranks (or the ranks still training, under Join without
// divide_by_initial_world_size), 1, or the step's item count.
double Reducer::divisor() const {
  switch (options.reduction()) {
    case Reduction::Mean: return static_cast<double>(join_divisor.value_or(size()));
    case Reduction::Sum: return 1.0;
    case Reduction::GlobalMean: return static_cast<double>(std::max<int64_t>(*global_items, 1));
  }
  return 1.0;
}

// The factor folded into the copy of .grad into its bucket (see Note [Where the division happens]). With a
// communication hook the copy is plain: the hook divides (as PyTorch's hooks do).
double Reducer::bucket_scale() const {
  if (comm_hook) return 1.0;
  return gradient_factor(options.reduction(), join_divisor.value_or(size()), global_items);
}

void Reducer::copy_into_bucket(size_t index) {
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
  // As PyTorch: .grad becomes the bucket here, so backward's fresh gradient is freed now, not held beside the
  // buckets until backward ends.
  if (options.gradient_as_bucket_view() && !aliased) params[index].mutable_grad() = view;
}

void Reducer::launch_ready_buckets() {
  // Collectives must be issued in the same order on every rank: bucket i waits for buckets < i.
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
    auto& bucket = buckets[next_launch];
    // The factor folded into the copy, or the hook's own 1/N (every hook of comm_hook.h divides by divisor()).
    auto* tracer = world->comm().tracer();
    TraceLabel label(tracer, tracer ? fmt::format("bucket {}", next_launch) : std::string(),
                     comm_hook ? 1.0 / static_cast<double>(divisor()) : bucket_scale());
    bucket.work = comm_hook ? run_comm_hook(next_launch) : world->comm().allreduce_sum_async(bucket.flat);
    traffic.add_allreduce(bucket.flat.numel() * static_cast<int64_t>(bucket.flat.element_size()), size());
    timeline.bucket_launch_ms.push_back(ms_since_start());
    ++next_launch;
  }
}

std::vector<std::string> Reducer::bucket_names(size_t bucket) const {
  std::vector<std::string> out;
  for (size_t p : buckets[bucket].params) out.push_back(names[p]);
  return out;
}

PendingWork Reducer::run_comm_hook(size_t index) {
  GradBucket view{index, index + 1 == buckets.size(), buckets[index].flat, divisor(), bucket_names(index)};
  return comm_hook(world->comm(), view);
}

std::vector<size_t> Reducer::zero_unused(bool joined) {
  std::vector<size_t> unused;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].ready) continue;
    unused.push_back(i);
    // As PyTorch: a gradient this rank already holds (micro-steps under no_sync) is reduced; without one, or on a
    // rank that joined (Join: zeros for every parameter), the parameter contributes zeros, still counted in 1/N.
    if (!joined && params[i].grad().defined()) {
      copy_into_bucket(i);
    } else {
      slots[i].view.zero_();
    }
    slots[i].ready = true;
    --buckets[slots[i].bucket].pending;
  }
  return unused;
}

// PyTorch leaves .grad untouched for a parameter unused on every rank; that needs one small allreduce.
std::vector<bool> Reducer::globally_used(const std::vector<size_t>& unused, bool joined) {
  std::vector<bool> used(params.size(), true);
  if (!options.find_unused_parameters()) return used;
  auto local = torch::ones({static_cast<int64_t>(params.size())}, torch::kLong);
  for (size_t i : unused) {
    if (joined || !slots[i].used_since_sync) local[static_cast<int64_t>(i)] = 0;
  }
  world->comm().allreduce(local, Reduction::Sum);
  for (size_t i = 0; i < params.size(); ++i) used[i] = local[static_cast<int64_t>(i)].item<int64_t>() > 0;
  return used;
}

// Released gradients (zero_grad()) cost no pass at all: AccumulateGrad takes backward's fresh gradient as .grad
// instead of adding it to zeros, the scaled copy into the bucket is the one pass over it, and with
// gradient_as_bucket_view .grad then becomes the bucket (measured in docs/performance.md). A parameter released and
// then unused on every rank gets its bucket's zeros back: after backward every .grad is what zeroing in place gives.
void Reducer::release_grads() {
  std::lock_guard<std::mutex> lock(mutex);
  sample_memory();  // the step's gradients count in memory()'s peak, as they did before being released
  for (size_t i = 0; i < params.size(); ++i) {
    auto& grad = params[i].mutable_grad();
    if (!grad.defined()) continue;
    grad.reset();
    slots[i].released = true;
  }
}

void Reducer::write_back(const std::vector<bool>& used_anywhere) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& param = params[i];
    auto& grad = param.mutable_grad();
    const bool restore = std::exchange(slots[i].released, false) && !grad.defined();
    if (!used_anywhere[i] && !restore) continue;  // PyTorch leaves it untouched
    const auto& view = slots[i].view;  // zeros for a released parameter unused here (zero_unused)
    if (options.gradient_as_bucket_view()) {
      if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = view;
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
}

// Ends a synchronised backward (joined: this rank had no data and contributes zeros for every parameter).
void Reducer::finalize(bool joined) {
  std::lock_guard<std::mutex> lock(mutex);
  timeline.finalize_ms = ms_since_start();
  auto unused = zero_unused(joined);
  launch_ready_buckets();
  try {
    for (auto& bucket : buckets) bucket.work.wait();
    write_back(globally_used(unused, joined));
  } catch (...) {
    for (auto& slot : slots) slot.used_since_sync = false;
    reset();
    join_divisor.reset();
    throw;
  }
  for (auto& slot : slots) slot.used_since_sync = false;  // the next step's no_sync micro-steps start afresh
  reset();
  join_divisor.reset();  // set by Join::notify() for this step only (after_forward's reset() keeps it)
  synced_once = true;
  if (!joined && !unused.empty() && !options.find_unused_parameters()) {
    std::vector<std::string> unused_names;
    for (size_t i : unused) unused_names.push_back(names[i]);
    throw DistributedError(fmt::format(
        "DistributedDataParallel on rank {}: parameter(s) {} received no gradient in this backward (they did not "
        "take part in computing the loss). Construct with find_unused_parameters=true if some parameters are "
        "unused in some iterations, or remove them from the model",
        rank(), fmt::join(unused_names, ", ")));
  }
}

void Reducer::reset() {
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

void Reducer::build_buckets(const std::vector<BucketPlan>& layout) {
  torch::NoGradGuard no_grad;
  // Zeros, on MPI maybe shared memory. Collective, so all of them first: a rank whose allocation fails (a peer gone)
  // keeps its old buckets whole.
  std::vector<torch::Tensor> flats;
  for (const auto& plan : layout) flats.push_back(world->comm().reduction_buffer(plan.numel, plan.dtype));
  buckets.clear();
  slots.assign(params.size(), Slot{});
  for (size_t b = 0; b < layout.size(); ++b) {
    const auto& plan = layout[b];
    Bucket bucket;
    bucket.flat = flats[b];
    for (const auto& entry : plan.entries) {
      auto& slot = slots[entry.param];
      slot.bucket = buckets.size();
      slot.view = bucket.flat.narrow(0, entry.offset, entry.numel).view(params[entry.param].sizes());
      bucket.params.push_back(entry.param);
      // Gradients that alias the old buckets move into the new ones.
      auto& grad = params[entry.param].mutable_grad();
      if (options.gradient_as_bucket_view() && grad.defined()) {
        slot.view.copy_(grad);
        grad = slot.view;
      }
    }
    bucket.pending = bucket.params.size();
    buckets.push_back(std::move(bucket));
  }
}

// PyTorch rebuilds its buckets once, before the forward that follows the first synchronised backward, in the
// order gradients became ready; rank 0's order is broadcast so every rank uses the same layout. Every rank takes
// that decision at the same forward, whether or not it had data in that backward (a rank that joined has no order
// of its own and receives rank 0's): one side deciding alone would leave the other waiting in the broadcast. If
// rank 0 itself joined, it has no order to give, and every rank keeps the initial layout.
void Reducer::maybe_rebuild_buckets() {
  if (rebuilt || options.find_unused_parameters() || !(synced_once || rebuild_due)) return;
  std::vector<int64_t> mine(params.size(), -1);
  if (ready_order.size() == params.size()) std::copy(ready_order.begin(), ready_order.end(), mine.begin());
  auto order = torch::tensor(mine, torch::kLong);
  if (size() > 1) world->comm().broadcast(order, /*root=*/0);
  rebuilt = true;
  ready_order.clear();
  if (params.empty() || order[0].item<int64_t>() < 0) return;
  std::vector<size_t> agreed(params.size());
  for (size_t i = 0; i < agreed.size(); ++i) agreed[i] = static_cast<size_t>(order[static_cast<int64_t>(i)].item<int64_t>());
  rebuild_buckets(agreed);
}

void Reducer::rebuild_buckets(const std::vector<size_t>& order) {
  build_buckets(rebuilt_bucket_layout(params, order, options.first_bucket_bytes(), options.bucket_cap_bytes()));
  rebuilt_order = order;
  rebuilt = true;
  ready_order.clear();
}

void Reducer::set_up(const std::shared_ptr<Reducer>& self) {
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;  // frozen parameters are neither reduced nor hooked
    names.push_back(item.key());
    params.push_back(item.value());
  }
  // Same parameters and buffers (names, dtypes, shapes) on every rank, or every rank fails naming the difference.
  buffers = BufferSync(set_up_replica(world->comm(), "DistributedDataParallel", *module), options.broadcast_buffers());
  build_buckets(initial_bucket_layout(params, options.find_unused_parameters(), options.first_bucket_bytes(),
                                      options.bucket_cap_bytes()));
  const std::weak_ptr<Reducer> weak = self;  // the hooks outlive the reducer inside autograd's graph
  for (size_t i = 0; i < params.size(); ++i) {
    accumulators.push_back(on_gradient_accumulated(params[i], [weak, i] {
      if (auto reducer = weak.lock()) reducer->mark_ready(i, weak);
    }));
  }
  sample_memory();
}

void Reducer::sample_memory() const { meter.sample(module_memory(*module, optimizer)); }

void Reducer::before_forward() {
  std::lock_guard<std::mutex> lock(mutex);
  if (torch::GradMode::is_enabled() && !callback_queued) maybe_rebuild_buckets();
  buffers.before_forward(world->comm());
}

void Reducer::after_forward() {
  std::lock_guard<std::mutex> lock(mutex);
  // Mirrors PyTorch: the sync decision is taken at forward time, and a forward that will not sync (no_sync or
  // no grad mode) also skips the buffer broadcast before the next forward.
  const bool grad = torch::GradMode::is_enabled();
  const bool sync = grad && require_backward_sync;
  buffers.after_forward(sync);
  // A forward without grad (an evaluation between a forward and its backward) builds no graph: the coming backward
  // keeps the decision of the forward that built its graph, as in PyTorch, whose reducer such a forward never arms.
  if (!grad || callback_queued) return;
  if (sync) reset();
  expect_hooks = sync;
}

void Reducer::join_backward() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!expect_hooks) {
      throw ConfigError(fmt::format("DistributedDataParallel on rank {}: a step without data needs a preceding "
                                    "synchronised forward (begin_forward/end_forward outside no_sync)", rank()));
    }
    backward_start = Clock::now();
    timeline = BackwardTimeline{};
  }
  finalize(/*joined=*/true);
}

}  // namespace gradsync
