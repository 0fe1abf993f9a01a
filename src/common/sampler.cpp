// DistributedSampler with Python's exact arithmetic (see sampler.h).
#include "gradsync/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Python: math.ceil((n - N) / N) when drop_last and n % N != 0, else math.ceil(n / N).
int64_t samples_per_replica(int64_t n, int64_t replicas, bool drop_last) {
  if (drop_last && n % replicas != 0) return n >= replicas ? ceil_div(n - replicas, replicas) : 0;
  return ceil_div(n, replicas);
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  if (dataset_size < 1) {
    throw ConfigError(fmt::format("DistributedSampler: dataset size {} is invalid; expected at least 1 sample",
                                  dataset_size));
  }
  if (num_replicas < 1) {
    throw ConfigError(fmt::format("DistributedSampler: num_replicas={} is invalid; expected >= 1", num_replicas));
  }
  if (rank < 0 || rank >= num_replicas) {
    throw ConfigError(fmt::format("DistributedSampler: rank={} is out of range for num_replicas={}; expected "
                                  "0 <= rank < {}", rank, num_replicas, num_replicas));
  }
  num_samples_ = samples_per_replica(dataset_size, num_replicas, drop_last);
}

DistributedSampler DistributedSampler::without_padding(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                                       bool shuffle, uint64_t seed) {
  DistributedSampler sampler(dataset_size, num_replicas, rank, shuffle, seed, /*drop_last=*/false);
  sampler.pad_ = false;
  sampler.num_samples_ = sampler.num_samples_of(rank);
  return sampler;
}

int64_t DistributedSampler::num_samples_of(int64_t rank) const {
  if (pad_) return num_samples_;
  return rank < dataset_size_ ? ceil_div(dataset_size_ - rank, num_replicas_) : 0;  // positions r, r+N, ... < n
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> all(static_cast<size_t>(dataset_size_));
  if (shuffle_) {
    // Same generator state as Python's torch.Generator().manual_seed(seed + epoch), same randperm kernel.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(epoch_));
    auto perm = torch::randperm(dataset_size_, generator, torch::kLong);
    std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + dataset_size_, all.begin());
  } else {
    for (int64_t i = 0; i < dataset_size_; ++i) all[static_cast<size_t>(i)] = i;
  }
  const auto total = static_cast<size_t>(total_size());
  // Padding repeats the list from its start (cycling when the padding is longer than the list); drop_last
  // truncates instead. Either way the length becomes a multiple of num_replicas.
  std::vector<int64_t> padded(total);
  for (size_t i = 0; i < total; ++i) padded[i] = all[i % all.size()];
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_)) {
    mine.push_back(padded[i]);
  }
  return mine;
}

}  // namespace gradsync
