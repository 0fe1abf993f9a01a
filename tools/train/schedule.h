// defines: BatchSchedule, which micro-batches every rank trains on in every step of an epoch — what a Python
// DataLoader(batch_size=b) over DistributedSampler yields on each rank, grouped K per optimizer step.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace gradsync::cli {

class BatchSchedule {
 public:
  // pad=true: PyTorch's DistributedSampler (wrap-around duplicates, equal counts); pad=false: every sample once,
  // ranks may hold uneven counts (see DistributedSampler::without_padding).
  BatchSchedule(int64_t dataset_size, int world_size, int64_t micro_batch, int64_t accumulate, bool shuffle,
                uint64_t seed, bool pad);

  void set_epoch(int64_t epoch);
  // The same on every rank: the longest rank's micro-batch count, K per step (the last step may hold fewer).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // Rank r's micro-batches (int64 index tensors) in step s of the current epoch: K of them, fewer in the last step
  // of an epoch, none when the rank has run out of samples (only without padding).
  std::vector<torch::Tensor> step(int rank, int64_t step_in_epoch) const;
  int world_size() const { return world_size_; }

 private:
  int64_t dataset_size_;
  int world_size_;
  int64_t micro_batch_;
  int64_t accumulate_;
  bool shuffle_;
  uint64_t seed_;
  bool pad_;
  int64_t steps_per_epoch_ = 0;
  std::vector<std::vector<torch::Tensor>> micro_;  // [rank][m] for the current epoch
};

}  // namespace gradsync::cli
