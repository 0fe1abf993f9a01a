// accumulation: gradient accumulation with DDP. Each rank runs K micro-batches per optimizer step; accumulate()
// divides every micro-batch's (mean) loss by K because .grad sums over backward passes, runs the first K-1 under
// no_sync() and lets the K-th backward average the accumulated gradient over the ranks. The step then equals one
// process on the whole global batch of N x K x b samples -- and without the 1/K it would be K times too large.
//
// Usage: accumulation   (as N ranks: gradsync launch -n 2 -- accumulation)
#include <cmath>
#include <cstdio>
#include <exception>

#include <gradsync/gradsync.h>
#include <torch/torch.h>

namespace {

constexpr int64_t kMicroBatches = 4, kMicroBatch = 8, kSteps = 5;

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 3));
}

double max_relative_difference(const gradsync::StateDict& a, const gradsync::StateDict& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = b[i].second.abs().max().item<double>();
    worst = std::max(worst, (a[i].second - b[i].second).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace

int main() try {
  torch::set_num_threads(1);
  auto world = gradsync::init();
  const int64_t n = world->size(), rank = world->rank(), global_batch = n * kMicroBatches * kMicroBatch;
  torch::manual_seed(1);
  const auto x = torch::randn({kSteps, global_batch, 16});
  const auto y = torch::randint(3, {kSteps, global_batch});
  // Sample order of a step: rank r's micro-batch k holds rows (k * n + r) * b ... + b.
  const auto rows = [&](int64_t k) { return (k * n + rank) * kMicroBatch; };

  auto model = make_model();
  gradsync::DistributedDataParallel ddp(model, world);
  torch::optim::SGD optimizer(ddp.parameters(), torch::optim::SGDOptions(0.1));
  auto reference = make_model();  // one process, one backward on the global batch
  torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1));
  double ratio = 0;  // |gradient| without the 1/K over |gradient| with it, first step
  for (int64_t s = 0; s < kSteps; ++s) {
    ddp.zero_grad();
    gradsync::accumulate(ddp, kMicroBatches, [&](int64_t k) {
      return torch::nn::functional::cross_entropy(ddp.forward(x[s].narrow(0, rows(k), kMicroBatch)),
                                                  y[s].narrow(0, rows(k), kMicroBatch));
    });
    if (s == 0) {  // the same micro-batches summed without dividing by K, in one process
      auto unscaled = make_model();
      for (int64_t k = 0; k < kMicroBatches; ++k) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t at = (k * n + r) * kMicroBatch;
          (torch::nn::functional::cross_entropy(unscaled->forward(x[s].narrow(0, at, kMicroBatch)),
                                                y[s].narrow(0, at, kMicroBatch)) / static_cast<double>(n))
              .backward();
        }
      }
      ratio = unscaled->parameters()[0].grad().norm().item<double>() / model->parameters()[0].grad().norm().item<double>();
    }
    optimizer.step();
    reference_optimizer.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x[s]), y[s]).backward();
    reference_optimizer.step();
  }
  const double worst = max_relative_difference(gradsync::state_dict(*model), gradsync::state_dict(*reference));
  if (world->is_main()) {
    std::printf("%lld ranks x %lld micro-batches x %lld samples = global batch %lld\n", static_cast<long long>(n),
                static_cast<long long>(kMicroBatches), static_cast<long long>(kMicroBatch),
                static_cast<long long>(global_batch));
    std::printf("after %lld steps DDP with accumulate() equals one process on the global batch: %s\n",
                static_cast<long long>(kSteps), worst < 1e-5 ? "yes (relative difference < 1e-5)" : "NO");
    std::printf("without the 1/K the gradient is %.2f times too large (K = %lld)\n", ratio,
                static_cast<long long>(kMicroBatches));
  }
  return worst < 1e-5 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "accumulation: %s\n", e.what());
  return 1;
}
