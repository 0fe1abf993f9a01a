// my_trainer: a program of your own built against an installed gradsync (see README.md, "Your own program").
// A small regression model trained with DistributedDataParallel on a libtorch DataLoader whose sampler is
// gradsync's DistributedSampler. Run it as one process or as N ranks: with a global batch of 64, N ranks of 64/N
// samples each compute the same steps as one process of 64 (DDP averages the ranks' mean gradients), so the
// saved parameters agree up to float rounding.
//
//   my_trainer OUT.pt          one process, or N ranks under gradsync launch / torchrun / mpirun
#include <cstdio>
#include <exception>

#include <gradsync/gradsync.h>
#include <torch/torch.h>

// 256 samples of y = x . w + noise, the same on every rank (fixed seed).
struct Regression : torch::data::datasets::Dataset<Regression> {
  torch::Tensor x, y;
  Regression() {
    torch::manual_seed(0);
    x = torch::randn({256, 8});
    y = x.matmul(torch::randn({8, 1})) + 0.1 * torch::randn({256, 1});
  }
  torch::data::Example<> get(size_t i) override { return {x[i], y[i]}; }
  torch::optional<size_t> size() const override { return x.size(0); }
};

int main(int argc, char** argv) try {
  if (argc != 2) {
    std::fprintf(stderr, "usage: my_trainer OUT.pt\n");
    return 2;
  }
  torch::set_num_threads(1);
  auto world = gradsync::init();  // torchrun's, mpirun's or gradsync launch's environment; none: one process
  const int64_t global_batch = 64;
  if (global_batch % world->size() != 0) {
    std::fprintf(stderr, "the global batch of %lld does not split over %d ranks\n",
                 static_cast<long long>(global_batch), world->size());
    return 2;
  }

  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  gradsync::DistributedDataParallel ddp(model, world);  // Reduction::Mean, as PyTorch DDP
  torch::optim::SGD optimizer(ddp.parameters(), torch::optim::SGDOptions(0.05));

  Regression data;
  gradsync::DistributedSampler sampler(*data.size(), world->size(), world->rank());
  auto loader = torch::data::make_data_loader(data.map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions(global_batch / world->size()));
  double loss_value = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    sampler.set_epoch(epoch);  // a new order every epoch, the same as Python's DistributedSampler
    for (auto& batch : *loader) {
      ddp.zero_grad();
      auto loss = torch::mse_loss(ddp.forward(batch.data), batch.target);
      loss.backward();  // the gradient is the mean over ranks when backward() returns
      optimizer.step();
      loss_value = loss.item<double>();
    }
  }
  if (world->is_main()) {
    gradsync::save_state_dict(ddp.state_dict(), argv[1]);
    std::printf("ranks %d, last loss %.6f, saved %s\n", world->size(), loss_value, argv[1]);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "my_trainer: %s\n", e.what());
  return 1;
}
