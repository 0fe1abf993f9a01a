// gpt: your own GPT, written the usual libtorch way, trained with FullyShardedDataParallel (FULL_SHARD) and every
// transformer block a unit, with the exact token mean (Reduction::GlobalMean) over ragged sequences.
//
// The model is what a libtorch user writes, with two lines changed (marked CHANGED): the blocks live in a
// torch::nn::Sequential instead of a torch::nn::ModuleList (same state-dict keys, blocks.0.*, blocks.1.*, ...), and the
// loop calls each element's forward() through the Sequential. C++ modules have no forward pre-hooks, so FSDP runs a
// unit from the Sequential's slot it sits in; the loop is still yours. wte, wpe and ln_f form the root unit, gathered
// for the whole step, which is why the tied wte (the first and the last layer) needs nothing special.
//
// Each rank's micro-batches hold sequences with different numbers of valid tokens (targets -100 past them). The
// step's gradient is that of the mean loss over every valid token of the step, on all ranks and micro-batches, so
// the result equals one process on the global batch; a mean of per-micro-batch token means would not.
//
// Usage: gpt   (as N ranks: gradsync launch -n 2 -- gpt)
#include <cmath>
#include <cstdio>
#include <exception>

#include <gradsync/gradsync.h>
#include <torch/torch.h>

namespace {

namespace nn = torch::nn;
constexpr int64_t kVocab = 32, kContext = 16, kWidth = 32, kHeads = 4, kBlocks = 2;

struct BlockImpl : nn::Module {
  BlockImpl() {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({kWidth})));
    qkv = register_module("qkv", nn::Linear(nn::LinearOptions(kWidth, 3 * kWidth).bias(false)));
    proj = register_module("proj", nn::Linear(kWidth, kWidth));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({kWidth})));
    fc = register_module("fc", nn::Linear(kWidth, 4 * kWidth));
    out = register_module("out", nn::Linear(4 * kWidth, kWidth));
  }
  torch::Tensor attention(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), hd = kWidth / kHeads;
    auto parts = qkv(x).split(kWidth, 2);
    auto heads = [&](const torch::Tensor& p) { return p.view({b, t, kHeads, hd}).transpose(1, 2); };
    auto att = torch::matmul(heads(parts[0]), heads(parts[1]).transpose(-2, -1)) / std::sqrt(double(hd));
    att = att.masked_fill(torch::ones({t, t}, torch::kBool).tril().logical_not(), -INFINITY).softmax(-1);
    return proj(torch::matmul(att, heads(parts[2])).transpose(1, 2).reshape({b, t, kWidth}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + attention(ln1(x));
    return h + out(torch::gelu(fc(ln2(h))));
  }
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : nn::Module {
  GptImpl() {
    wte = register_module("wte", nn::Embedding(kVocab, kWidth));
    wpe = register_module("wpe", nn::Embedding(kContext, kWidth));
    blocks = register_module("blocks", nn::Sequential());  // CHANGED: was nn::ModuleList()
    for (int64_t i = 0; i < kBlocks; ++i) blocks->push_back(Block());
    ln_f = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({kWidth})));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte(idx) + wpe(torch::arange(idx.size(1)));
    for (auto& block : *blocks) x = block.forward(x);  // CHANGED: was block->as<Block>()->forward(x)
    return torch::matmul(ln_f(x), wte->weight.t());    // tied output layer
  }
  nn::Embedding wte{nullptr}, wpe{nullptr};
  nn::Sequential blocks{nullptr};
  nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

// The summed cross-entropy of the valid tokens (targets != -100) and how many there are.
gradsync::ItemLoss token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  namespace F = nn::functional;
  auto loss = F::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}),
                               F::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  return {loss, targets.ne(-100).sum().item<int64_t>()};
}

}  // namespace

int main() try {
  torch::set_num_threads(1);
  auto world = gradsync::init();
  const int64_t n = world->size(), rank = world->rank(), k = 2, b = 4, steps = 5, per_step = n * k * b;
  torch::manual_seed(1);
  const auto inputs = torch::randint(kVocab, {steps, per_step, kContext});
  const auto lengths = torch::randint(kContext + 1, {steps, per_step, 1});  // 0..T valid tokens per sequence
  const auto targets = torch::randint(kVocab, {steps, per_step, kContext})
                           .masked_fill(torch::arange(kContext).ge(lengths), -100);

  torch::manual_seed(0);
  Gpt model;
  torch::manual_seed(0);
  Gpt reference;
  // float64, so that the comparison below shows the arithmetic itself: in float32 the ranks' sums in another order
  // differ by rounding, which Adam's division by sqrt(v) amplifies where a gradient is tiny.
  model->to(torch::kDouble);
  reference->to(torch::kDouble);
  const auto options = gradsync::FsdpOptions()
                           .wrap(gradsync::WrapPolicy::types({"Block"}))  // every Block a unit
                           .reduction(gradsync::Reduction::GlobalMean);   // 1/T over the step's valid tokens
  gradsync::FullyShardedDataParallel fsdp(model, world, options);
  torch::optim::AdamW optimizer(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW reference_optimizer(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t s = 0; s < steps; ++s) {
    fsdp.zero_grad();
    const auto mine = torch::arange(rank * k * b, (rank + 1) * k * b);  // this rank's K micro-batches of b
    auto step = gradsync::accumulate_global_mean(fsdp, k, [&](int64_t m) {
      const auto rows = mine.narrow(0, m * b, b);
      return token_loss(fsdp.forward(inputs[s].index_select(0, rows)), targets[s].index_select(0, rows));
    });
    fsdp.clip_grad_norm(1.0);
    optimizer.step();
    reference_optimizer.zero_grad();
    auto all = token_loss(reference->forward(inputs[s]), targets[s]);
    (all.summed_loss / static_cast<double>(all.items)).backward();
    nn::utils::clip_grad_norm_(reference->parameters(), 1.0);
    reference_optimizer.step();
    if (world->is_main()) {
      std::printf("step %lld: %lld valid tokens of %lld, loss %.4f\n", static_cast<long long>(s),
                  static_cast<long long>(step.total_items), static_cast<long long>(per_step * kContext),
                  step.mean_loss);
    }
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
    std::printf("\nFSDP on your GPT equals one process on the global batch: %s\n",
                worst < 1e-10 ? "yes (relative difference < 1e-10)" : "NO");
  }
  return worst < 1e-10 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gpt: %s\n", e.what());
  return 1;
}
