// ddp_fashion_mnist: PyTorch's DDP tutorial program, in C++, on Fashion-MNIST with libtorch's DataLoader.
//
//   Python                                                   here
//   dist.init_process_group("gloo")                          auto world = gradsync::init();
//   model = DDP(Net())                                       gradsync::DistributedDataParallel ddp(model, world);
//   sampler = DistributedSampler(train)                      gradsync::DistributedSampler sampler(n, N, rank);
//   loader = DataLoader(train, batch_size=32, sampler=...)   torch::data::make_data_loader(train, sampler, 32)
//   for epoch ...: sampler.set_epoch(epoch)                  sampler.set_epoch(epoch);
//       loss = F.cross_entropy(model(x), y); loss.backward(); opt.step()   (the same)
//
// Usage: ddp_fashion_mnist DIR [EPOCHS]   (run as N ranks: gradsync launch -n 2 -- ddp_fashion_mnist DIR)
// DIR holds the unpacked IDX files that torch::data::datasets::MNIST reads (train-images-idx3-ubyte, ...):
//   mkdir -p fmnist && for f in /usr/share/datasets/fashion-mnist/*.gz; do gunzip -c "$f" > fmnist/$(basename "$f" .gz); done
// Every epoch, rank 0 prints the training loss (mean over all ranks' batches) and the test accuracy.
#include <cstdio>
#include <exception>
#include <string>

#include <gradsync/gradsync.h>
#include <torch/torch.h>

namespace {

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 128), torch::nn::ReLU(),
                               torch::nn::Linear(128, 10));
}

// Every rank holds the whole model (DDP replicas), so each can classify the test set alone; rank 0 reports.
double test_accuracy(torch::nn::Sequential& model, const std::string& dir) {
  torch::NoGradGuard no_grad;
  model->eval();
  torch::data::datasets::MNIST test(dir, torch::data::datasets::MNIST::Mode::kTest);
  const auto images = test.images(), labels = test.targets();
  const auto correct = model->forward(images).argmax(1).eq(labels).sum().item<int64_t>();
  model->train();
  return 100.0 * static_cast<double>(correct) / static_cast<double>(labels.size(0));
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: ddp_fashion_mnist DIR [EPOCHS]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const int epochs = argc == 3 ? std::stoi(argv[2]) : 1;
  torch::set_num_threads(1);
  auto world = gradsync::init();
  torch::manual_seed(0);
  auto model = make_net();
  gradsync::DistributedDataParallel ddp(model, world);  // rank 0's initial parameters everywhere; mean gradients
  torch::optim::SGD optimizer(ddp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto train = torch::data::datasets::MNIST(dir).map(torch::data::transforms::Stack<>());
  gradsync::DistributedSampler sampler(static_cast<int64_t>(*train.size()), world->size(), world->rank());
  auto loader = torch::data::make_data_loader(std::move(train), sampler, torch::data::DataLoaderOptions(32));
  for (int epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);
    auto sum = torch::zeros({2}, torch::kDouble);  // this rank's loss sum and batch count
    for (auto& batch : *loader) {
      ddp.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp.forward(batch.data), batch.target);
      loss.backward();  // the gradient is the mean over the ranks' batches when backward() returns
      optimizer.step();
      sum[0] += loss.item<double>();
      sum[1] += 1;
    }
    world->comm().allreduce(sum, gradsync::Reduction::Sum);
    if (world->is_main()) {
      std::printf("epoch %d: train loss %.4f, test accuracy %.2f%% (%d ranks)\n", epoch + 1,
                  sum[0].item<double>() / sum[1].item<double>(), test_accuracy(model, dir), world->size());
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddp_fashion_mnist: %s\n", e.what());
  return 1;
}
