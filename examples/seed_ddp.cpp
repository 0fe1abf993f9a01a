// seed_ddp: the program from the question that started gradsync, in C++. Linear(10, 10), MSELoss,
// SGD(lr=0.001), a DistributedSampler reshuffled every epoch, DistributedDataParallel with its default
// Reduction::Mean. Rank 0 prints each epoch's loss; at the end every rank prints a checksum of its parameters.
// The checksums are identical: DDP hands every rank the same gradient (the mean over ranks), so the same steps
// keep the copies bit-for-bit equal. With N ranks an epoch has N times fewer steps, each on the mean gradient of
// 16 * N samples, so at the same learning rate the loss falls more slowly per epoch; were the gradient a sum over
// ranks, each step would instead be N times larger.
//
//   build/gradsync launch -n 2 -- build/examples/seed_ddp   # 2 ranks
//   build/examples/seed_ddp                                 # no launcher environment: a world of one process
//
// torchrun: Debian's /usr/bin/torchrun (PyTorch 1.13.1, Python 3.11) crashes with its default options
// ("AttributeError: 'NoneType' object has no attribute 'get'": it cannot parse its own default "0" for
// --redirects/--tee). Passing both with the value 1 avoids that bug, and then it runs this program:
//   torchrun --standalone --nproc_per_node 2 --redirects 1 --tee 1 --no_python build/examples/seed_ddp
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/gradsync.h"

namespace {

constexpr int64_t kSamples = 256;
constexpr int64_t kFeatures = 10;
constexpr int64_t kBatchPerRank = 16;  // like DataLoader(batch_size=16) in every process: global batch 16 * N
constexpr int64_t kEpochs = 5;
constexpr double kLearningRate = 0.001;
constexpr uint64_t kDataSeed = 1234;

struct Data {
  torch::Tensor inputs, targets;
};

// Every rank builds the same data set (same seed); the sampler decides which rows are whose.
Data make_data() {
  torch::manual_seed(kDataSeed);
  auto inputs = torch::randn({kSamples, kFeatures});
  auto teacher = torch::randn({kFeatures, kFeatures}) / std::sqrt(static_cast<double>(kFeatures));
  auto targets = inputs.matmul(teacher) + 0.1 * torch::randn({kSamples, kFeatures});
  return {inputs, targets};
}

// Sum of the parameters, and an FNV-1a hash of their bytes: equal hashes mean bit-identical models.
std::string checksum(torch::nn::Module& module) {
  double sum = 0;
  uint64_t hash = 1469598103934665603ull;
  for (const auto& p : module.parameters()) {
    auto t = p.detach().contiguous();
    sum += t.sum().item<double>();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  }
  return fmt::format("sum {:.9f}  fnv1a {:016x}", sum, hash);
}

int run() {
  auto world = gradsync::init();
  const Data data = make_data();

  // Each rank starts from a different random model on purpose: DDP's constructor broadcasts rank 0's.
  torch::manual_seed(1000 + world->rank());
  torch::nn::Linear model(kFeatures, kFeatures);
  gradsync::DistributedDataParallel ddp(model, world);  // Reduction::Mean, as PyTorch DDP
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(kLearningRate));
  torch::nn::MSELoss loss_fn;

  gradsync::DistributedSampler sampler(kSamples, world->size(), world->rank(), /*shuffle=*/true, /*seed=*/0);
  if (world->is_main()) {
    fmt::print("{} rank(s), {} samples, {} per rank per step, SGD lr {}\n", world->size(), kSamples, kBatchPerRank,
               kLearningRate);
    std::fflush(stdout);
  }
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);  // without it every epoch would repeat epoch 0's order
    auto indices = torch::tensor(sampler.indices(), torch::kLong);
    double loss_sum = 0;  // sum over this rank's samples of the per-sample loss
    for (int64_t start = 0; start < indices.size(0); start += kBatchPerRank) {
      auto batch = indices.narrow(0, start, std::min(kBatchPerRank, indices.size(0) - start));
      auto x = data.inputs.index_select(0, batch);
      auto y = data.targets.index_select(0, batch);
      optimizer.zero_grad();
      auto loss = loss_fn(ddp.forward(x), y);  // mean over this rank's micro-batch
      loss.backward();                         // returns with .grad = mean over ranks of the local gradients
      optimizer.step();
      loss_sum += loss.item<double>() * static_cast<double>(batch.size(0));
    }
    // Every rank has sampler.num_samples() samples, so the mean over ranks of the per-rank means is the
    // epoch's mean loss over all samples.
    auto epoch_loss = torch::tensor({loss_sum / static_cast<double>(sampler.num_samples())}, torch::kDouble);
    world->comm().allreduce(epoch_loss, gradsync::Reduction::Mean);
    if (world->is_main()) {
      fmt::print("epoch {}  loss {:.6f}\n", epoch, epoch_loss.item<double>());
      std::fflush(stdout);  // a pipe to the launcher is block-buffered: show progress as it happens
    }
  }
  world->comm().barrier();  // the checksum lines come after every epoch line
  fmt::print("rank {} of {}: parameters {}\n", world->rank(), world->size(), checksum(*model));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "seed_ddp: error: {}\n", e.what());
    return 1;
  }
}
