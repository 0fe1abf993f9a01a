// ZeRO stage 1 (see zero.h).
#include "gradsync/zero.h"

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/clip_grad.h"
#include "common/consistency.h"
#include "gradsync/error.h"
#include "shard/flat_param.h"
#include "shard/sharded_checkpoint.h"

namespace gradsync {
namespace {
constexpr const char* kWho = "Zero1";
}

struct Zero1::State {
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<World> world;
  ZeroOptions options;
  std::unique_ptr<FlatParam> flat;  // every parameter, sharded; the full buffer stays gathered
  std::vector<torch::Tensor> buffers;
  const torch::optim::Optimizer* optimizer = nullptr;
  MemoryMeter meter;
  CommStats traffic;
  bool reduced = false;  // this step's gradient is already in the slice's .grad
  bool require_backward_sync = true;
  bool require_forward_param_sync = true;

  Collectives& comm() { return world->comm(); }
  void sample_memory() {
    StorageBytes params, grads;
    flat->count_params(params);
    flat->count_grads(grads);
    meter.sample({params.bytes(), grads.bytes(), optimizer ? optimizer_state_bytes(*optimizer) : 0});
  }
  // The full parameters again from every rank's slice.
  void regather() {
    flat->free();
    flat->gather(comm(), traffic);
  }
};

Zero1::Zero1(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<World> world, ZeroOptions options)
    : state_(std::make_unique<State>()) {
  auto& s = *state_;
  s.module = std::move(module);
  s.world = std::move(world);
  s.options = options;
  if (options.reduction != Reduction::Mean && options.reduction != Reduction::Sum) {
    throw ConfigError(fmt::format("{}: reduction {} is not supported; expected mean or sum", kWho,
                                  gradsync::to_string(options.reduction)));
  }
  check_same_on_every_rank(s.comm(), kWho, describe_module(*s.module));
  std::vector<torch::Tensor> everything;
  for (const auto& p : s.module->parameters()) everything.push_back(p);
  for (const auto& b : s.module->buffers()) s.buffers.push_back(b);
  everything.insert(everything.end(), s.buffers.begin(), s.buffers.end());
  s.comm().broadcast_coalesced(everything, /*root=*/0);

  UnitPlan all;
  all.name = "all";
  for (const auto& p : s.module->named_parameters(/*recurse=*/true)) {
    all.param_names.push_back(p.key());
    all.params.push_back(p.value());
  }
  s.flat = std::make_unique<FlatParam>(all, s.world->rank(), s.world->size(), /*sharded=*/true, MixedPrecision{});
  s.flat->ensure_grad_buffer();
  s.sample_memory();
}

Zero1::~Zero1() = default;

void Zero1::before_forward() {
  auto& s = *state_;
  if (s.options.broadcast_buffers && s.require_forward_param_sync && s.world->size() > 1 && !s.buffers.empty()) {
    s.comm().broadcast_coalesced(s.buffers, /*root=*/0);
  }
  if (torch::GradMode::is_enabled()) s.flat->ensure_grad_buffer();
}

void Zero1::after_forward() {
  auto& s = *state_;
  s.require_forward_param_sync = torch::GradMode::is_enabled() && s.require_backward_sync;
  s.sample_memory();
}

bool Zero1::require_sync() const { return state_->require_backward_sync; }
void Zero1::set_require_sync(bool sync) { state_->require_backward_sync = sync; }

std::vector<torch::Tensor> Zero1::parameters() const { return {state_->flat->shard()}; }

void Zero1::reduce_gradients() {
  auto& s = *state_;
  if (s.reduced) return;
  s.sample_memory();  // full local gradient and the state of the previous step: the usual peak
  s.flat->reduce_grads(s.comm(), s.options.reduction, s.traffic);
  s.reduced = true;
  s.sample_memory();
}

void Zero1::step(torch::optim::Optimizer& optimizer) {
  auto& s = *state_;
  reduce_gradients();
  s.optimizer = &optimizer;
  optimizer.step();
  s.sample_memory();
  s.regather();
  s.reduced = false;
}

void Zero1::zero_grad() {
  auto& s = *state_;
  s.flat->shard().mutable_grad() = torch::Tensor();
  s.flat->release_grad_buffer();
  s.reduced = false;
  s.sample_memory();
}

double Zero1::clip_grad_norm(double max_norm, double norm_type) {
  reduce_gradients();
  return gradsync::clip_grad_norm(parameters(), max_norm, norm_type, &state_->comm());
}

void Zero1::track_optimizer(const torch::optim::Optimizer* optimizer) { state_->optimizer = optimizer; }

StateDict Zero1::full_state_dict(bool all_ranks) {
  auto& s = *state_;
  // Parameters are whole and equal on every rank; buffers (BatchNorm statistics) are rank 0's.
  std::vector<torch::Tensor> buffer_copies;
  for (const auto& b : s.buffers) buffer_copies.push_back(b.detach().clone());
  if (all_ranks) s.comm().broadcast_coalesced(buffer_copies, /*root=*/0);
  if (!all_ranks && s.world->rank() != 0) return {};
  std::map<const void*, torch::Tensor> buffer_of;
  for (size_t i = 0; i < s.buffers.size(); ++i) buffer_of[s.buffers[i].unsafeGetTensorImpl()] = buffer_copies[i];
  StateDict out;
  for (const auto& [name, tensor] : state_dict(*s.module)) {
    auto b = buffer_of.find(tensor.unsafeGetTensorImpl());
    out.emplace_back(name, b != buffer_of.end() ? b->second : tensor.detach().clone());
  }
  return out;
}

void Zero1::load_full_state_dict(const StateDict& state) {
  auto& s = *state_;
  std::string problem;
  if (s.world->rank() == 0) {
    try {
      // load_into is strict and copies parameters and buffers; the slice is then refreshed from the parameters.
      load_into(*s.module, state);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  fail_together(s.comm(), fmt::format("{}: load_full_state_dict", kWho), problem);
  torch::NoGradGuard no_grad;
  auto full = torch::zeros({s.flat->padded_numel()}, torch::TensorOptions().dtype(s.flat->master_dtype()));
  if (s.world->rank() == 0) {
    const auto& entries = s.flat->entries();
    for (size_t i = 0; i < entries.size(); ++i) {
      full.narrow(0, entries[i].offset, entries[i].numel).copy_(s.flat->params()[i].detach().reshape({-1}));
    }
  }
  s.comm().broadcast(full, /*root=*/0);
  s.flat->load_full_master(full);
  s.regather();
  s.comm().broadcast_coalesced(s.buffers, /*root=*/0);
}

void Zero1::save_sharded(const std::string& dir, const torch::optim::Optimizer* optimizer) {
  auto& s = *state_;
  std::string problem;
  try {
    save_shards(dir, "zero1", s.world->rank(), s.world->size(),
                {{s.flat->name(), s.flat->numel(), s.flat->padded_numel(), s.flat->shard_offset(), s.flat->shard()}},
                optimizer);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  fail_together(s.comm(), fmt::format("{}: save_sharded", kWho), problem);
}

void Zero1::load_sharded(const std::string& dir, torch::optim::Optimizer* optimizer) {
  auto& s = *state_;
  std::string problem;
  try {
    load_shards(dir, s.world->rank(), s.world->size(),
                {{s.flat->name(), s.flat->numel(), s.flat->padded_numel(), s.flat->shard_offset(), s.flat->shard()}},
                optimizer);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  fail_together(s.comm(), fmt::format("{}: load_sharded", kWho), problem);
  s.regather();
}

MemoryStats Zero1::memory() const { return state_->meter.stats(); }
CommStats Zero1::comm_stats() const { return state_->traffic; }
torch::nn::Module& Zero1::module() { return *state_->module; }

}  // namespace gradsync
