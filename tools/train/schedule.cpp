// Per-rank micro-batch schedule (see schedule.h).
#include "train/schedule.h"

#include "gradsync/sampler.h"

namespace gradsync::cli {

BatchSchedule::BatchSchedule(int64_t dataset_size, int world_size, int64_t micro_batch, int64_t accumulate,
                             bool shuffle, uint64_t seed, bool pad)
    : dataset_size_(dataset_size),
      world_size_(world_size),
      micro_batch_(micro_batch),
      accumulate_(accumulate),
      shuffle_(shuffle),
      seed_(seed),
      pad_(pad) {
  set_epoch(0);
}

void BatchSchedule::set_epoch(int64_t epoch) {
  micro_.assign(static_cast<size_t>(world_size_), {});
  size_t longest = 0;
  for (int r = 0; r < world_size_; ++r) {
    auto sampler = pad_ ? DistributedSampler(dataset_size_, world_size_, r, shuffle_, seed_, /*drop_last=*/false)
                        : DistributedSampler::without_padding(dataset_size_, world_size_, r, shuffle_, seed_);
    sampler.set_epoch(epoch);
    auto all = torch::tensor(sampler.indices(), torch::kLong);
    auto& mine = micro_[static_cast<size_t>(r)];
    for (int64_t start = 0; start < all.numel(); start += micro_batch_) {
      mine.push_back(all.narrow(0, start, std::min(micro_batch_, all.numel() - start)));
    }
    longest = std::max(longest, mine.size());
  }
  steps_per_epoch_ = (static_cast<int64_t>(longest) + accumulate_ - 1) / accumulate_;
}

std::vector<torch::Tensor> BatchSchedule::step(int rank, int64_t step_in_epoch) const {
  const auto& mine = micro_[static_cast<size_t>(rank)];
  const auto first = static_cast<size_t>(step_in_epoch * accumulate_);
  std::vector<torch::Tensor> out;
  for (size_t m = first; m < mine.size() && m < first + static_cast<size_t>(accumulate_); ++m) out.push_back(mine[m]);
  return out;
}

}  // namespace gradsync::cli
