// defines: DistributedSampler, whose order is bit-identical to Python's
// torch.utils.data.DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last) with set_epoch.
// (libtorch's DistributedRandomSampler is not: contiguous blocks, mt19937(epoch), and tail indices that are never
// yielded when duplicates are off.)
#pragma once
#include <cstdint>
#include <vector>

namespace gradsync {

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);

  // The no-padding mode (not in PyTorch): every sample exactly once per epoch, the same permutation, rank r
  // taking positions r, r+N, ... of it without wrap-around duplicates. Ranks then hold uneven counts (some may
  // hold none); pair it with Reduction::GlobalMean for an unbiased gradient.
  static DistributedSampler without_padding(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                            bool shuffle = true, uint64_t seed = 0);

  // Epoch e shuffles with a generator seeded with seed + e, as Python's set_epoch does.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch: a permutation of 0..n-1 (or 0..n-1 in order without shuffle),
  // padded by repeating it from the start to a multiple of num_replicas (or truncated when drop_last), then
  // every num_replicas-th element starting at rank.
  std::vector<int64_t> indices() const;

  int64_t num_samples() const { return num_samples_; }  // this rank's count
  // Length of the padded (or truncated) list the ranks take from; the dataset size without padding.
  int64_t total_size() const { return pad_ ? num_samples_ * num_replicas_ : dataset_size_; }
  // The count of any rank: equal for all ranks unless without padding.
  int64_t num_samples_of(int64_t rank) const;

 private:
  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
  bool pad_ = true;
  int64_t num_samples_;
};

}  // namespace gradsync
