// defines: GlooGroup, c10d's ProcessGroupGloo with an allreduce of its own for two ranks that keeps both
// directions of the TCP connection busy (see Note [The two-rank allreduce] in gloo_group.cpp).
#pragma once
#include "torch_compat.h"

namespace gradsync {

class GlooGroup : public compat::GlooGroupBase {
 public:
  using GlooGroupBase::GlooGroupBase;

  // In-place sum over the ranks, on the group's worker threads and Gloo context like every c10d collective.
  c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor tensor);

  // Below this size the ring's fewer, larger messages cost less than the pipeline's segments.
  static constexpr int64_t kPipelinedBytes = 1 << 20;

 private:
  // Whether allreduce_sum() takes the two-rank path for `tensor`: two ranks, float32 or float64, at least
  // kPipelinedBytes. Otherwise it is c10d's allreduce (Gloo's ring).
  bool pipelines(const at::Tensor& tensor) const;
};

}  // namespace gradsync
