// defines: the res:IN-H-B-OUT model, a residual network that is not a Sequential, defined exactly as this Python
// module (tests/reference/torch_train.py holds the same code):
//
//   class Block(nn.Module):                        # h + fc(relu(norm(h)))
//       def __init__(self, h): super().__init__(); self.norm = nn.LayerNorm(h); self.fc = nn.Linear(h, h)
//   class Res(nn.Module):                          # inp, blocks[0..B-1], out
//       def __init__(self, din, h, nblocks, dout):
//           self.inp = nn.Linear(din, h); self.blocks = nn.ModuleList([Block(h) ...]); self.out = nn.Linear(h, dout)
//
// Keys inp.*, blocks.<i>.norm.*, blocks.<i>.fc.*, out.*, registered in Python's order (so DDP's buckets are
// PyTorch's). The blocks are a torch::nn::Sequential here: the same keys as Python's ModuleList, and the slots FSDP
// runs its units in (every Block its own unit by default; inp and out form the root unit).
#pragma once
#include <cstdint>

#include <torch/torch.h>

namespace gradsync::cli::res {

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(int64_t h);
  torch::Tensor forward(const torch::Tensor& h);

 private:
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

class ResImpl : public torch::nn::Module {
 public:
  ResImpl(int64_t din, int64_t h, int64_t nblocks, int64_t dout);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear inp{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Res);

}  // namespace gradsync::cli::res
