// One rank of the lab's DDP experiment: `gradsync lab-rank` (hidden; `gradsync lab` starts it through launch()).
// The rank measures, on its own share of the global batch, the gradient before synchronisation (a pass under
// no_sync) and the gradient DistributedDataParallel leaves in .grad (Reduction::Mean, the default, as PyTorch
// DDP), first with equal shares, then with shares proportional to rank+1. On the uneven shares it also measures
// a second copy of the model under DDP with Reduction::GlobalMean (accumulate_global_mean, the summed loss of
// its share and its sample count). On the even shares it finally measures FullyShardedDataParallel (FullShard):
// one forward/backward and one SGD step (lr = 1) on this rank's shards; initial - updated parameters, gathered
// with state_dict(), is the gradient FSDP applied; the same with K micro-batches (accumulate()) in both
// ShardedAccumulation modes; and the gradient of a fresh DDP when the rank's loss is the SUM over its share. It
// writes the gradients to rank<r>.pt and its measurements to rank<r>.json; judging them is the parent's work
// (analyse_ddp), which compares them with gradients it computes itself in one process.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <numeric>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradsync/engine.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"
#include "lab/lab.h"

namespace gradsync::cli {
namespace {

using Ddp = DistributedDataParallel;

// This rank's rows [offset, offset + size) of the global batch for the given split.
std::pair<torch::Tensor, torch::Tensor> my_rows(const torch::Tensor& x, const torch::Tensor& y,
                                                const std::vector<int64_t>& sizes, int rank) {
  const int64_t offset = std::accumulate(sizes.begin(), sizes.begin() + rank, int64_t{0});
  const int64_t size = sizes[static_cast<size_t>(rank)];
  return {x.narrow(0, offset, size), y.narrow(0, offset, size)};
}

// Adds "<tag>.local" (before sync) and "<tag>.synced" (after DDP's backward) to `out`.
void measure(Ddp& ddp, const torch::Tensor& x, const torch::Tensor& y, const std::string& tag, StateDict& out) {
  auto loss = [&] { return torch::nn::functional::cross_entropy(ddp.forward(x), y); };
  ddp.zero_grad();
  {
    auto guard = ddp.no_sync();  // hooks stay quiet: .grad is this rank's own gradient
    loss().backward();
  }
  out.emplace_back(tag + ".local", flat_gradient(ddp.module()));
  ddp.zero_grad();
  loss().backward();  // DDP: .grad is reduced across the ranks when backward() returns
  out.emplace_back(tag + ".synced", flat_gradient(ddp.module()));
}

// Adds "<tag>.global_mean": the gradient DDP with Reduction::GlobalMean leaves in .grad when this rank's loss is
// the SUM of its samples' losses. Returns the step's item count over all ranks.
int64_t measure_global_mean(Ddp& ddp, const torch::Tensor& x, const torch::Tensor& y, const std::string& tag,
                            StateDict& out) {
  namespace F = torch::nn::functional;
  ddp.zero_grad();
  const auto step = accumulate_global_mean(ddp, x.size(0) > 0 ? 1 : 0, [&](int64_t) {
    auto summed = F::cross_entropy(ddp.forward(x), y, F::CrossEntropyFuncOptions().reduction(torch::kSum));
    return ItemLoss{summed, x.size(0)};
  });
  out.emplace_back(tag + ".global_mean", flat_gradient(ddp.module()));
  return step.total_items;
}

// The gradient FullyShardedDataParallel (with `options`) applied in one step, read back through the parameters:
// `backward` fills the shard gradients, one SGD step with lr = 1 moves each parameter by exactly its (sharded,
// reduced) gradient, so initial - updated, gathered with state_dict(), is that gradient whole, in parameter order.
torch::Tensor fsdp_applied(const LabRankArgs& a, const std::shared_ptr<World>& world, const FsdpOptions& options,
                           const std::function<void(FullyShardedDataParallel&)>& backward) {
  auto reference = lab_model(a.model, a.init_state);  // the initial parameters, in parameter order
  FullyShardedDataParallel fsdp(lab_model(a.model, a.init_state), world, options);
  torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(1.0));
  fsdp.zero_grad();
  backward(fsdp);
  optimizer.step();
  const auto updated = fsdp.state_dict();
  std::vector<torch::Tensor> parts;
  for (const auto& [name, initial] : reference->named_parameters().pairs()) {
    const auto it = std::find_if(updated.begin(), updated.end(), [&name = name](const auto& kv) {
      return kv.first == name;
    });
    if (it == updated.end()) throw Error(fmt::format("lab-rank: FSDP's full state dict has no '{}'", name));
    parts.push_back((initial.detach() - it->second.detach().to(initial.dtype())).flatten());
  }
  return torch::cat(parts);
}

// Adds "<tag>.fsdp_full": what FSDP (FullShard, Reduction::Mean) applied after one forward/backward.
void measure_fsdp(const LabRankArgs& a, const std::shared_ptr<World>& world, const torch::Tensor& x,
                  const torch::Tensor& y, const std::string& tag, StateDict& out) {
  FsdpOptions options;
  options.strategy(ShardingStrategy::FullShard);
  out.emplace_back(tag + ".fsdp_full", fsdp_applied(a, world, options, [&](FullyShardedDataParallel& fsdp) {
                     torch::nn::functional::cross_entropy(fsdp.forward(x), y).backward();
                   }));
}

// Adds "<tag>.fsdp_accum_full" (ShardedAccumulation::UnshardedGradients) and "<tag>.fsdp_accum_sharded"
// (ReduceEveryMicroStep): what FSDP applied after accumulate() over K = a.accumulate micro-batches of
// x.size(0) / K rows each (the first K of them; analyse_ddp's reference uses the same rows).
void measure_fsdp_accumulation(const LabRankArgs& a, const std::shared_ptr<World>& world, const torch::Tensor& x,
                               const torch::Tensor& y, const std::string& tag, StateDict& out) {
  const int64_t k = a.accumulate, b = x.size(0) / k;
  if (b < 1) {
    throw ConfigError(fmt::format("lab-rank: {} samples cannot make {} micro-batches", x.size(0), k));
  }
  for (const auto& [mode, key] : {std::pair{ShardedAccumulation::UnshardedGradients, ".fsdp_accum_full"},
                                  std::pair{ShardedAccumulation::ReduceEveryMicroStep, ".fsdp_accum_sharded"}}) {
    FsdpOptions options;
    options.strategy(ShardingStrategy::FullShard);
    options.accumulation(mode);
    out.emplace_back(tag + key, fsdp_applied(a, world, options, [&](FullyShardedDataParallel& fsdp) {
                       gradsync::accumulate(fsdp, k, [&](int64_t i) {
                         return torch::nn::functional::cross_entropy(fsdp.forward(x.narrow(0, i * b, b)),
                                                                     y.narrow(0, i * b, b));
                       });
                     }));
  }
}

// Adds "<tag>.ddp_summed_loss": the gradient a fresh DDP (Reduction::Mean) leaves in .grad when this rank's loss
// is the SUM of its samples' losses.
void measure_summed_loss(const LabRankArgs& a, const std::shared_ptr<World>& world, const torch::Tensor& x,
                         const torch::Tensor& y, const std::string& tag, StateDict& out) {
  namespace F = torch::nn::functional;
  Ddp ddp(lab_model(a.model, a.init_state), world);
  ddp.zero_grad();
  F::cross_entropy(ddp.forward(x), y, F::CrossEntropyFuncOptions().reduction(torch::kSum)).backward();
  out.emplace_back(tag + ".ddp_summed_loss", flat_gradient(ddp.module()));
}

}  // namespace

std::string lab_rank_tensors(const std::string& dir, int rank) { return fmt::format("{}/rank{}.pt", dir, rank); }
std::string lab_rank_json(const std::string& dir, int rank) { return fmt::format("{}/rank{}.json", dir, rank); }

void run_lab_rank(const LabRankArgs& a) {
  const auto start = std::chrono::steady_clock::now();
  InitOptions options;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_seconds * 1000));
  auto world = init(options);
  const int n = world->size(), rank = world->rank();
  if (a.global_batch % n != 0) {
    throw ConfigError(fmt::format("lab-rank: --global-batch {} is not a multiple of the world size {}",
                                  a.global_batch, n));
  }
  auto model = lab_model(a.model, a.init_state);
  auto [x, y] = read_batch(a.batch_file, a.global_batch);
  Ddp ddp(model, world);  // DdpOptions{}: Reduction::Mean

  StateDict out;
  const auto even = even_split(a.global_batch, n);
  auto [xe, ye] = my_rows(x, y, even, rank);
  measure(ddp, xe, ye, "even", out);
  std::vector<int64_t> uneven;
  int64_t global_items = 0;
  if (n >= 2) {
    uneven = uneven_split(a.global_batch, n);
    auto [xu, yu] = my_rows(x, y, uneven, rank);
    measure(ddp, xu, yu, "uneven", out);
    // A separate copy of the model: its own reducer, the same initial state.
    DdpOptions options;
    options.reduction(Reduction::GlobalMean);
    Ddp global_ddp(lab_model(a.model, a.init_state), world, options);
    global_items = measure_global_mean(global_ddp, xu, yu, "uneven", out);
  }
  // Sharded: FullyShardedDataParallel (FullShard) over a fresh copy, on the even shares.
  measure_fsdp(a, world, xe, ye, "even", out);
  measure_fsdp_accumulation(a, world, xe, ye, "even", out);
  measure_summed_loss(a, world, xe, ye, "even", out);
  save_state_dict(out, lab_rank_tensors(a.out_dir, rank));

  nlohmann::json meta{{"rank", rank},
                      {"world_size", n},
                      {"even_samples", even[static_cast<size_t>(rank)]},
                      {"uneven_samples", n >= 2 ? uneven[static_cast<size_t>(rank)] : 0},
                      {"uneven_global_mean_items", global_items},
                      {"threads", at::get_num_threads()},
                      {"pid", static_cast<int64_t>(getpid())},
                      {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}};
  const auto path = lab_rank_json(a.out_dir, rank);
  std::ofstream file(path);
  file << meta.dump(2) << "\n";
  if (!file.flush()) throw Error(fmt::format("lab-rank: cannot write {}", path));
  world->comm().barrier();  // no rank leaves while another may still need it
}

void add_lab_rank_command(CLI::App& root, int& exit_code) {
  auto args = std::make_shared<LabRankArgs>();
  auto* cmd = root.add_subcommand("lab-rank", "one rank of `gradsync lab`'s DDP experiment (internal)");
  cmd->group("");  // hidden from --help: only `gradsync lab` starts it
  cmd->add_option("--out", args->out_dir)->required();
  cmd->add_option("--init", args->init_state)->required();
  cmd->add_option("--batch", args->batch_file)->required();
  cmd->add_option("--model", args->model)->required();
  cmd->add_option("--global-batch", args->global_batch)->required();
  cmd->add_option("--accumulate", args->accumulate)->check(CLI::PositiveNumber);
  cmd->add_option("--timeout", args->timeout_seconds);
  cmd->callback([args, &exit_code] {
    run_lab_rank(*args);
    exit_code = 0;
  });
}

}  // namespace gradsync::cli
