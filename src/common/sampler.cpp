// DistributedSampler with Python's exact arithmetic (see sampler.h).
#include "gradsync/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
#include <utility>
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

int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor t;
  archive.read(key, t);
  return t.item<int64_t>();
}

}  // namespace

// What a DataLoader's copy and the user's sampler share. `resume` is a position load() restored for `epoch`, taken
// up by the next reset() (the loader's begin()) instead of 0.
struct DistributedSampler::Progress {
  int64_t epoch = 0;
  size_t position = 0;
  std::optional<size_t> resume;
  std::vector<int64_t> cached;  // indices() of `cached_epoch`, computed at reset()
  int64_t cached_epoch = -1;
};

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      progress_(std::make_shared<Progress>()) {
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

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch < 0) throw ConfigError(fmt::format("DistributedSampler: epoch {} is invalid; expected >= 0", epoch));
  if (epoch == progress_->epoch) return;
  progress_->epoch = epoch;
  progress_->position = 0;
  progress_->resume.reset();
}

int64_t DistributedSampler::epoch() const { return progress_->epoch; }
int64_t DistributedSampler::position() const { return static_cast<int64_t>(progress_->position); }

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size && static_cast<int64_t>(*new_size) != dataset_size_) {
    throw ConfigError(fmt::format("DistributedSampler: the data set has {} samples but the sampler was made for {}",
                                  *new_size, dataset_size_));
  }
  auto& p = *progress_;
  if (p.cached_epoch != p.epoch) {
    p.cached = indices();
    p.cached_epoch = p.epoch;
  }
  p.position = p.resume.value_or(0);
  p.resume.reset();
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  auto& p = *progress_;
  if (p.cached_epoch != p.epoch) reset();  // used without a DataLoader: start the epoch
  if (p.position >= p.cached.size()) return c10::nullopt;
  const size_t end = std::min(p.cached.size(), p.position + batch_size);
  std::vector<size_t> batch(p.cached.begin() + static_cast<std::ptrdiff_t>(p.position),
                            p.cached.begin() + static_cast<std::ptrdiff_t>(end));
  p.position = end;
  return batch;
}

// The configuration, then the position: a saved position means nothing for another data set or world.
void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  const std::vector<std::pair<const char*, int64_t>> fields{
      {"dataset_size", dataset_size_}, {"num_replicas", num_replicas_}, {"rank", rank_},
      {"shuffle", shuffle_}, {"seed", static_cast<int64_t>(seed_)}, {"drop_last", drop_last_}, {"pad", pad_},
      {"epoch", progress_->epoch}, {"position", static_cast<int64_t>(progress_->position)}};
  for (const auto& [key, value] : fields) archive.write(key, torch::tensor(value, torch::kLong));
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  const std::vector<std::pair<const char*, int64_t>> expected{
      {"dataset_size", dataset_size_}, {"num_replicas", num_replicas_}, {"rank", rank_},
      {"shuffle", shuffle_}, {"seed", static_cast<int64_t>(seed_)}, {"drop_last", drop_last_}, {"pad", pad_}};
  for (const auto& [key, value] : expected) {
    const int64_t saved = read_int(archive, key);
    if (saved != value) {
      throw ConfigError(fmt::format("DistributedSampler: the saved position is for {}={}, this sampler has {}={}",
                                    key, saved, key, value));
    }
  }
  const int64_t epoch = read_int(archive, "epoch"), position = read_int(archive, "position");
  if (epoch < 0 || position < 0 || position > num_samples_) {
    throw ConfigError(fmt::format("DistributedSampler: saved epoch {} / position {} is invalid; expected "
                                  "epoch >= 0 and 0 <= position <= {}", epoch, position, num_samples_));
  }
  progress_->epoch = epoch;
  progress_->position = static_cast<size_t>(position);
  progress_->resume = static_cast<size_t>(position);
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> all(static_cast<size_t>(dataset_size_));
  if (shuffle_) {
    // Same generator state as Python's torch.Generator().manual_seed(seed + epoch), same randperm kernel.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(progress_->epoch));
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
