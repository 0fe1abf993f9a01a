// defines: the gpt:V-T-D-L-H model, a decoder-only transformer over tokens, defined exactly as this Python module
// (tests/reference/gpt.py holds the same code; its parity is tested):
//
//   class Attention(nn.Module):   # causal self-attention, written out: qkv = Linear(D, 3D, bias=False), proj
//   class Mlp(nn.Module):         # fc = Linear(D, 4D), exact (erf) GELU, proj = Linear(4D, D)
//   class Block(nn.Module):       # x = x + attn(ln1(x)); x = x + mlp(ln2(x))
//   class Gpt(nn.Module):         # wte = Embedding(V, D), wpe = Embedding(T, D), blocks, ln_f = LayerNorm(D)
//       def forward(self, idx):   # idx int64 [B, L], L <= T -> logits [B, L, V]
//           x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
//           for b in self.blocks: x = b(x)
//           return self.ln_f(x) @ self.wte.weight.t()        # the output layer is wte itself (tied)
//
// Keys wte.weight, wpe.weight, blocks.<i>.{ln1,ln2}.*, blocks.<i>.attn.qkv.weight, blocks.<i>.attn.proj.*,
// blocks.<i>.mlp.{fc,proj}.*, ln_f.*, registered in Python's order so that DDP's buckets are PyTorch's. The blocks
// are a torch::nn::Sequential (the same keys as Python's ModuleList): each Block is a slot FSDP can run as a unit
// (--wrap type:Block); wte, wpe and ln_f form the root unit, gathered for the whole forward and backward, which is
// why the tied wte, used by the first and the last layer, needs nothing special under any strategy.
//
// Initialisation (GPT-2's): Linear and Embedding weights ~ N(0, 0.02), Linear biases 0, LayerNorm weight 1 and
// bias 0, drawn from the global generator (torch::manual_seed) in module order.
#pragma once
#include <cstdint>

#include <torch/torch.h>

namespace gradsync::cli::gpt {

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(int64_t d, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  int64_t heads_;
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(int64_t d);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear fc{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::LayerNorm ln1{nullptr};
  Attention attn{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

struct GptSizes {
  int64_t vocab = 0, context = 0, width = 0, blocks = 0, heads = 0;
};

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptSizes& sizes);
  // idx: int64 [B, L] token ids in [0, V), L <= T. Returns logits [B, L, V] in the parameters' dtype.
  torch::Tensor forward(const torch::Tensor& idx);
  const GptSizes& sizes() const { return sizes_; }

 private:
  GptSizes sizes_;
  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

// GPT-2's initialisation (see the top of this file), in place.
void init_weights(torch::nn::Module& model);

// `count` bytes the model generates after `prompt` (token ids), sampling each next token from the softmax of the
// last position's logits with `generator` seeded by `seed`; the context slides over the last T tokens.
std::vector<int64_t> generate(GptImpl& model, std::vector<int64_t> prompt, int64_t count, uint64_t seed);

}  // namespace gradsync::cli::gpt
