// defines: DistributedSampler, whose order is bit-identical to Python's
// torch.utils.data.DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last) with set_epoch, and
// which plugs into libtorch's DataLoader (a torch::data::samplers::Sampler<>):
//
//   gradsync::DistributedSampler sampler(dataset.size().value(), world->size(), world->rank());
//   auto loader = torch::data::make_data_loader(dataset, sampler, torch::data::DataLoaderOptions(64));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);                  // seen by the loader's copy: the order changes every epoch
//     for (auto& batch : *loader) { ... }
//   }
//
// (libtorch's DistributedRandomSampler is not Python's: contiguous blocks, mt19937(epoch), tail indices that are
// never yielded when duplicates are off, and -- because make_data_loader copies the sampler -- the same order
// every epoch. Copies of this sampler share its epoch and position.)
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);

  // The no-padding mode (not in PyTorch): every sample exactly once per epoch, the same permutation, rank r
  // taking positions r, r+N, ... of it without wrap-around duplicates. Ranks then hold uneven counts (some may
  // hold none); pair it with Reduction::GlobalMean for an unbiased gradient.
  static DistributedSampler without_padding(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                            bool shuffle = true, uint64_t seed = 0);

  // Epoch e shuffles with a generator seeded with seed + e, as Python's set_epoch does. A new epoch starts at
  // its first index; setting the epoch a position was load()ed for keeps that position (the resume loop).
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  // This rank's indices for the current epoch: a permutation of 0..n-1 (or 0..n-1 in order without shuffle),
  // padded by repeating it from the start to a multiple of num_replicas (or truncated when drop_last), then
  // every num_replicas-th element starting at rank.
  std::vector<int64_t> indices() const;

  int64_t num_samples() const { return num_samples_; }  // this rank's count
  // Length of the padded (or truncated) list the ranks take from; the dataset size without padding.
  int64_t total_size() const { return pad_ ? num_samples_ * num_replicas_ : dataset_size_; }
  // The count of any rank: equal for all ranks unless without padding.
  int64_t num_samples_of(int64_t rank) const;

  // ---- torch::data::samplers::Sampler<> (what the DataLoader calls) ------------------------------------------
  // At the loader's begin(): back to the epoch's first index, or to the position load() restored. new_size, when
  // given, must equal the dataset size (a ConfigError otherwise).
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // The next batch_size indices of this epoch (fewer at its end), nullopt once the epoch is exhausted.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  // Epoch and position, with the configuration they belong to (dataset size, replicas, rank, shuffle, seed,
  // drop_last, padding); load() refuses a different configuration, naming the field.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  // Indices of the current epoch handed out by next() so far.
  int64_t position() const;

 private:
  struct Progress;  // epoch, position, the epoch's indices: shared by the copies a DataLoader makes

  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  bool pad_ = true;
  int64_t num_samples_;
  std::shared_ptr<Progress> progress_;
};

}  // namespace gradsync
