// fsdp_layers: FullyShardedDataParallel (FULL_SHARD) on a module of several layers. Each Linear is its own unit
// (WrapPolicy::children(), PyTorch's "wrap each layer"): between its forward and backward a rank holds only its
// 1/N shard of every unit's parameters but the last unit's (the backward starts with it), and the step equals one
// process training on the global batch.
//
// Usage: fsdp_layers   (as N ranks: gradsync launch -n 2 -- fsdp_layers)
#include <cmath>
#include <cstdio>
#include <exception>

#include <gradsync/gradsync.h>
#include <torch/torch.h>

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 4));
}

int64_t numel(const std::vector<torch::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

}  // namespace

int main() try {
  torch::set_num_threads(1);
  auto world = gradsync::init();
  const int64_t n = world->size(), rank = world->rank(), global_batch = 64, steps = 10;
  torch::manual_seed(1);
  const auto x = torch::randn({steps, global_batch, 32});
  const auto y = torch::randn({steps, global_batch, 4});

  auto sharded_model = make_model();
  gradsync::FullyShardedDataParallel fsdp(
      sharded_model, world,
      gradsync::FsdpOptions().strategy(gradsync::ShardingStrategy::FullShard).wrap(gradsync::WrapPolicy::children()));
  torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.05));  // this rank's shards
  auto reference = make_model();                     // one process on the global batch, on every rank
  torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.05));
  const int64_t b = global_batch / n;
  for (int64_t s = 0; s < steps; ++s) {
    fsdp.zero_grad();
    torch::mse_loss(fsdp.forward(x[s].narrow(0, rank * b, b)), y[s].narrow(0, rank * b, b)).backward();
    optimizer.step();
    reference_optimizer.zero_grad();
    torch::mse_loss(reference->forward(x[s]), y[s]).backward();
    reference_optimizer.step();
  }
  const auto full = fsdp.state_dict();  // collective: every rank gathers the whole model
  const auto expected = gradsync::state_dict(*reference);
  double worst = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    const double scale = expected[i].second.abs().max().item<double>();
    worst = std::max(worst, (full[i].second - expected[i].second).abs().max().item<double>() / scale);
  }
  if (world->is_main()) {
    std::printf("%lld ranks, %zu units: each rank steps %lld of the model's %lld parameters\n",
                static_cast<long long>(n), fsdp.units().size(), static_cast<long long>(numel(fsdp.parameters())),
                static_cast<long long>(numel(reference->parameters())));
    std::printf("after %lld steps FSDP equals one process on the global batch of %lld: %s\n",
                static_cast<long long>(steps), static_cast<long long>(global_batch),
                worst < 1e-5 ? "yes (relative difference < 1e-5)" : "NO");
  }
  return worst < 1e-5 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "fsdp_layers: %s\n", e.what());
  return 1;
}
