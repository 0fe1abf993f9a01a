// Benchmarks of the DDP reducer's own cost, in one process:
//   BM_LocalStep            forward + backward + SGD step of a 784-512-512-10 MLP on 64 random inputs
//   BM_DdpStepWorld1        the same step through DistributedDataParallel on a single-process world; the
//                           difference to BM_LocalStep is the reducer's overhead (bucket copies, the
//                           end-of-backward wait and write-back)
//   BM_BucketCopyMean       a 4M-element float gradient copied into its bucket view with the 1/N scale folded
//                           in (at::mul_out with a wrapped scalar, as src/ddp/reducer.cpp does)
//   BM_BucketCopyThenScale  the same as copy_ followed by mul_: two passes over the bucket
//
//   build/bench/bench_reducer --benchmark_min_time=0.2
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "gradsync/ddp.h"
#include "gradsync/runtime.h"

namespace {

constexpr int64_t kBatch = 64;
constexpr int64_t kBucketElements = int64_t{4} << 20;  // 4M floats = 16 MiB
constexpr double kWorldSize = 4;                       // N in the 1/N folded into the bucket copy

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 512), torch::nn::ReLU(), torch::nn::Linear(512, 512),
                               torch::nn::ReLU(), torch::nn::Linear(512, 10));
}

struct Batch {
  torch::Tensor x = torch::randn({kBatch, 784});
  torch::Tensor y = torch::randint(0, 10, {kBatch}, torch::kLong);
};

void BM_LocalStep(benchmark::State& state) {
  auto model = make_mlp();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  Batch batch;
  for (auto _ : state) {
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(batch.x), batch.y);
    loss.backward();
    optimizer.step();
    benchmark::DoNotOptimize(loss.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_LocalStep)->Unit(benchmark::kMicrosecond);

void BM_DdpStepWorld1(benchmark::State& state) {
  static const auto world = gradsync::init();  // no launcher environment: a world of size 1
  if (world->size() != 1) {
    state.SkipWithError("expected a single-process world; run without RANK/WORLD_SIZE in the environment");
    return;
  }
  auto model = make_mlp();
  gradsync::DistributedDataParallel ddp(model, world);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  Batch batch;
  for (auto _ : state) {
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(ddp.forward(batch.x), batch.y);
    loss.backward();  // returns after the reducer's end-of-backward callback
    optimizer.step();
    benchmark::DoNotOptimize(loss.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_DdpStepWorld1)->Unit(benchmark::kMicrosecond);

struct CopyFixture {
  torch::Tensor grad = torch::randn({kBucketElements});
  torch::Tensor bucket = torch::zeros({kBucketElements + 1024});
  torch::Tensor view = bucket.narrow(0, 512, kBucketElements);  // a parameter's region of its bucket
};

void set_bytes(benchmark::State& state) {
  // One read of the gradient and one write of the bucket per iteration (the minimum either variant needs).
  state.SetBytesProcessed(state.iterations() * kBucketElements * int64_t{2} * static_cast<int64_t>(sizeof(float)));
}

void BM_BucketCopyMean(benchmark::State& state) {
  torch::NoGradGuard no_grad;
  CopyFixture f;
  const auto scale = c10::scalar_to_tensor(c10::Scalar(1.0 / kWorldSize));
  for (auto _ : state) {
    at::mul_out(f.view, f.grad, scale);
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}
BENCHMARK(BM_BucketCopyMean)->Unit(benchmark::kMicrosecond);

void BM_BucketCopyThenScale(benchmark::State& state) {
  torch::NoGradGuard no_grad;
  CopyFixture f;
  for (auto _ : state) {
    f.view.copy_(f.grad);
    f.view.mul_(1.0 / kWorldSize);
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}
BENCHMARK(BM_BucketCopyThenScale)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);  // repeatable numbers: no intra-op thread pool
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
