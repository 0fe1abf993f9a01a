// The res model (see res_model.h).
#include "data/res_model.h"

namespace gradsync::cli::res {

BlockImpl::BlockImpl(int64_t h)
    : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})))),
      fc(register_module("fc", torch::nn::Linear(h, h))) {}

torch::Tensor BlockImpl::forward(const torch::Tensor& h) { return h + fc(torch::relu(norm(h))); }

ResImpl::ResImpl(int64_t din, int64_t h, int64_t nblocks, int64_t dout)
    : inp(register_module("inp", torch::nn::Linear(din, h))),
      blocks(register_module("blocks", torch::nn::Sequential())),
      out(register_module("out", torch::nn::Linear(h, dout))) {
  for (int64_t i = 0; i < nblocks; ++i) blocks->push_back(Block(h));
}

torch::Tensor ResImpl::forward(const torch::Tensor& x) {
  auto h = inp(x);
  return out(blocks->is_empty() ? h : blocks->forward(h));  // an empty Sequential refuses forward()
}

}  // namespace gradsync::cli::res
