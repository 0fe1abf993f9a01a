// The gpt model (see gpt_model.h).
#include "data/gpt_model.h"

#include <cmath>

namespace gradsync::cli::gpt {

namespace nn = torch::nn;

AttentionImpl::AttentionImpl(int64_t d, int64_t heads)
    : heads_(heads),
      qkv(register_module("qkv", nn::Linear(nn::LinearOptions(d, 3 * d).bias(false)))),
      proj(register_module("proj", nn::Linear(d, d))) {}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads_;
  auto parts = qkv(x).split(d, /*dim=*/2);
  auto heads = [&](const torch::Tensor& p) { return p.view({b, t, heads_, hd}).transpose(1, 2); };
  auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  const auto future = torch::ones({t, t}, torch::kBool).tril().logical_not();
  att = att.masked_fill(future, -std::numeric_limits<double>::infinity()).softmax(-1);
  return proj(torch::matmul(att, v).transpose(1, 2).reshape({b, t, d}));
}

MlpImpl::MlpImpl(int64_t d)
    : fc(register_module("fc", nn::Linear(d, 4 * d))), proj(register_module("proj", nn::Linear(4 * d, d))) {}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) { return proj(torch::gelu(fc(x))); }  // erf GELU

BlockImpl::BlockImpl(int64_t d, int64_t heads)
    : ln1(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})))),
      attn(register_module("attn", Attention(d, heads))),
      ln2(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})))),
      mlp(register_module("mlp", Mlp(d))) {}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  auto h = x + attn(ln1(x));
  return h + mlp(ln2(h));
}

GptImpl::GptImpl(const GptSizes& s)
    : sizes_(s),
      wte(register_module("wte", nn::Embedding(s.vocab, s.width))),
      wpe(register_module("wpe", nn::Embedding(s.context, s.width))),
      blocks(register_module("blocks", nn::Sequential())),
      ln_f(register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({s.width})))) {
  for (int64_t i = 0; i < s.blocks; ++i) blocks->push_back(Block(s.width, s.heads));
  init_weights(*this);
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) {
  const auto positions = torch::arange(idx.size(1), torch::kLong);
  auto x = wte(idx) + wpe(positions);
  x = blocks->forward(x);
  return torch::matmul(ln_f(x), wte->weight.t());
}

void init_weights(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  // Not the model itself (it holds no weight of its own): called from its constructor, before a shared_ptr owns it.
  for (const auto& m : model.modules(/*include_self=*/false)) {
    if (auto* linear = m->as<nn::Linear>()) {
      linear->weight.normal_(0.0, 0.02);
      if (linear->bias.defined()) linear->bias.zero_();
    } else if (auto* embedding = m->as<nn::Embedding>()) {
      embedding->weight.normal_(0.0, 0.02);
    }
  }
}

std::vector<int64_t> generate(GptImpl& model, std::vector<int64_t> tokens, int64_t count, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto generator = at::detail::createCPUGenerator(seed);
  const bool was_training = model.is_training();
  model.eval();
  for (int64_t i = 0; i < count; ++i) {
    const auto keep = std::min<int64_t>(static_cast<int64_t>(tokens.size()), model.sizes().context);
    std::vector<int64_t> window(tokens.end() - keep, tokens.end());
    auto logits = model.forward(torch::tensor(window, torch::kLong).unsqueeze(0));
    auto probs = logits[0][keep - 1].to(torch::kDouble).softmax(-1);
    tokens.push_back(torch::multinomial(probs, 1, false, generator).item<int64_t>());
  }
  model.train(was_training);
  return tokens;
}

}  // namespace gradsync::cli::gpt
