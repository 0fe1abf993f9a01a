// fsdp_own_module: FullyShardedDataParallel (FULL_SHARD) on your own TORCH_MODULE, its forward unchanged. The
// module keeps its blocks in a torch::nn::Sequential; FSDP makes every Block a unit (WrapPolicy::types) and runs it
// in its slot of that Sequential, gathered around it. The frozen stem belongs to no unit and is never
// communicated; the optimizer has two parameter groups over the original parameters (no weight decay on biases
// and norm weights), stepping this rank's part of each. The result equals one process on the global batch.
//
// Usage: fsdp_own_module   (as N ranks: gradsync launch -n 2 -- fsdp_own_module)
#include <cstdio>
#include <exception>

#include <gradsync/gradsync.h>
#include <torch/torch.h>

namespace {

// h + fc(relu(norm(h))): a residual block, called by its parent through the Sequential below.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t h)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})))),
        fc(register_module("fc", torch::nn::Linear(h, h))) {}
  torch::Tensor forward(const torch::Tensor& h) { return h + fc(torch::relu(norm(h))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

// stem and head are members the forward calls directly: they form FSDP's root unit (gathered for the whole step).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(0);
    stem = register_module("stem", torch::nn::Linear(16, 32));
    blocks = register_module("blocks", torch::nn::Sequential(Block(32), Block(32), Block(32), Block(32)));
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(torch::tanh(stem(x)))); }
  torch::nn::Linear stem{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

// Weight decay 0.1 on the matrices, none on biases and norm weights (parameters of one dimension).
std::unique_ptr<torch::optim::SGD> optimizer_over(const torch::OrderedDict<std::string, torch::Tensor>& params,
                                                  const torch::nn::Module& model) {
  std::vector<torch::Tensor> decay, no_decay;
  const auto shapes = model.named_parameters();
  for (const auto& p : params) (shapes[p.key()].dim() > 1 ? decay : no_decay).push_back(p.value());
  // The defaults are the group without decay: since libtorch 2.15 a group's weight_decay(0), its type's default,
  // is taken from the optimizer's defaults, so defaults with 0.1 would decay that group too.
  const auto without = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto decaying = torch::optim::SGDOptions(without).weight_decay(0.1);
  groups.emplace_back(decay, std::make_unique<torch::optim::SGDOptions>(decaying));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::SGDOptions>(without));
  return std::make_unique<torch::optim::SGD>(std::move(groups), without);
}

torch::OrderedDict<std::string, torch::Tensor> trainable(const torch::nn::Module& model) {
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& p : model.named_parameters()) {
    if (p.value().requires_grad()) out.insert(p.key(), p.value());
  }
  return out;
}

}  // namespace

int main() try {
  torch::set_num_threads(1);
  auto world = gradsync::init();
  const int64_t n = world->size(), rank = world->rank(), global_batch = 48, steps = 8, b = global_batch / n;
  torch::manual_seed(1);
  const auto x = torch::randn({steps, global_batch, 16});
  const auto y = torch::randint(0, 4, {steps, global_batch});

  Net model, reference;
  for (auto* net : {&model, &reference}) (*net)->stem->weight.set_requires_grad(false);  // frozen
  const auto options = gradsync::FsdpOptions().wrap(gradsync::WrapPolicy::types({"Block"}));  // every Block a unit
  gradsync::FullyShardedDataParallel fsdp(model, world, options);
  auto optimizer = optimizer_over(fsdp.named_parameters(), *model);  // this rank's part of each parameter
  auto reference_optimizer = optimizer_over(trainable(*reference), *reference);
  for (int64_t s = 0; s < steps; ++s) {
    fsdp.zero_grad();
    torch::cross_entropy_loss(fsdp.forward(x[s].narrow(0, rank * b, b)), y[s].narrow(0, rank * b, b)).backward();
    optimizer->step();
    reference_optimizer->zero_grad();
    torch::cross_entropy_loss(reference->forward(x[s]), y[s]).backward();
    reference_optimizer->step();
  }
  const auto full = fsdp.state_dict();  // collective: every rank gathers the whole model
  const auto expected = gradsync::state_dict(*reference);
  double worst = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    const double scale = expected[i].second.abs().max().item<double>() + 1e-12;
    worst = std::max(worst, (full[i].second - expected[i].second).abs().max().item<double>() / scale);
  }
  if (world->is_main()) {
    std::printf("%lld ranks, units:", static_cast<long long>(n));
    for (const auto& u : fsdp.units()) std::printf(" %s", u.name.c_str());
    std::printf("\nafter %lld steps FSDP on Net equals one process on the global batch: %s\n",
                static_cast<long long>(steps), worst < 1e-5 ? "yes (relative difference < 1e-5)" : "NO");
  }
  return worst < 1e-5 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "fsdp_own_module: %s\n", e.what());
  return 1;
}
