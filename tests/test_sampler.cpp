// Tests for gradsync::DistributedSampler (include/gradsync/sampler.h): every rank's order equals real Python
// torch.utils.data.DistributedSampler (tests/reference/sampler_reference.py, batch mode, run with
// GRADSYNC_PYTHON under a timeout) over many (n, replicas, seed, epoch, shuffle, drop_last) cases, plus the
// properties of the order (coverage, padding from the start, truncation, epochs) and argument errors.
#include <gtest/gtest.h>

#include "support/error_of.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradsync/error.h"
#include "gradsync/sampler.h"
#include "support/subprocess.h"

namespace {

using gradsync::ConfigError;
using gradsync::DistributedSampler;
using Indices = std::vector<int64_t>;
using RankIndices = std::vector<Indices>;  // [rank] -> that rank's indices

constexpr const char* kPython = GRADSYNC_PYTHON;
const std::string kSamplerReference = std::string(GRADSYNC_SOURCE_DIR) + "/tests/reference/sampler_reference.py";

struct Case {
  int64_t n;
  int64_t replicas;
  uint64_t seed;
  int64_t epoch;
  bool shuffle;
  bool drop_last;
  std::string str() const {
    return fmt::format("n={} replicas={} seed={} epoch={} shuffle={} drop_last={}", n, replicas, seed, epoch,
                       shuffle, drop_last);
  }
};

nlohmann::json to_json(const Case& c) {
  return {{"n", c.n},     {"replicas", c.replicas}, {"seed", c.seed},
          {"epoch", c.epoch}, {"shuffle", c.shuffle},   {"drop_last", c.drop_last}};
}

// Every rank's indices from gradsync for one case.
RankIndices gradsync_indices(const Case& c) {
  RankIndices out;
  for (int64_t r = 0; r < c.replicas; ++r) {
    DistributedSampler s(c.n, c.replicas, r, c.shuffle, c.seed, c.drop_last);
    s.set_epoch(c.epoch);
    out.push_back(s.indices());
  }
  return out;
}

// Python's indices for every case, starting GRADSYNC_PYTHON once per chunk of cases (a single argv string
// must stay below Linux's 128 KiB MAX_ARG_STRLEN). Fails the test (and returns fewer results) on error.
std::vector<RankIndices> python_indices(const std::vector<Case>& cases) {
  std::vector<RankIndices> out;
  size_t begin = 0;
  while (begin < cases.size()) {
    nlohmann::json chunk = nlohmann::json::array();
    size_t end = begin;
    while (end < cases.size() && chunk.dump().size() < 64 * 1024) chunk.push_back(to_json(cases[end++]));
    gradsync::test::CommandOptions opts;
    opts.timeout = std::chrono::seconds(180);
    opts.env = {{"OMP_NUM_THREADS", "1"}};
    const auto r = gradsync::test::run({kPython, kSamplerReference, "--cases", chunk.dump()}, opts);
    if (!r.ok()) {
      ADD_FAILURE() << "sampler_reference.py failed (needs " << kPython << " with torch):\n" << r.describe();
      return out;
    }
    nlohmann::json parsed;
    try {
      parsed = nlohmann::json::parse(r.out);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "sampler_reference.py printed invalid JSON: " << e.what() << "\n" << r.describe();
      return out;
    }
    const auto& results = parsed.at("cases");
    if (results.size() != end - begin) {
      ADD_FAILURE() << "sampler_reference.py returned " << results.size() << " results for " << end - begin
                    << " cases";
      return out;
    }
    for (const auto& c : results) out.push_back(c.at("rank_indices").get<RankIndices>());
    begin = end;
  }
  return out;
}

// Compares gradsync against Python for every case; reports at most a few mismatches in detail.
void expect_equal_to_python(const std::vector<Case>& cases) {
  const auto python = python_indices(cases);
  ASSERT_EQ(python.size(), cases.size());
  int reported = 0;
  int64_t compared_indices = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto ours = gradsync_indices(cases[i]);
    ASSERT_EQ(python[i].size(), static_cast<size_t>(cases[i].replicas)) << cases[i].str();
    for (int64_t r = 0; r < cases[i].replicas; ++r) {
      DistributedSampler s(cases[i].n, cases[i].replicas, r, cases[i].shuffle, cases[i].seed, cases[i].drop_last);
      EXPECT_EQ(s.num_samples(), static_cast<int64_t>(python[i][r].size())) << cases[i].str() << " rank " << r;
      EXPECT_EQ(s.total_size(), static_cast<int64_t>(python[i][r].size()) * cases[i].replicas) << cases[i].str();
      compared_indices += static_cast<int64_t>(python[i][r].size());
    }
    if (ours != python[i]) {
      if (++reported <= 5) {
        ADD_FAILURE() << "differs from Python for " << cases[i].str() << ":\n  gradsync "
                      << nlohmann::json(ours).dump() << "\n  python   " << nlohmann::json(python[i]).dump();
      } else {
        ADD_FAILURE() << "differs from Python for " << cases[i].str();
      }
    }
  }
  // Guard against a vacuous comparison (e.g. everything empty).
  EXPECT_GT(compared_indices, static_cast<int64_t>(cases.size()));
}

// The list gradsync's ranks were drawn from: element i of the padded/truncated list is on rank i % R.
Indices interleave(const RankIndices& ranks) {
  Indices all;
  if (ranks.empty()) return all;
  for (size_t k = 0; k < ranks[0].size(); ++k) {
    for (const auto& r : ranks) all.push_back(r.at(k));
  }
  return all;
}

bool is_permutation_of_range(Indices v, int64_t n) {
  if (static_cast<int64_t>(v.size()) != n) return false;
  std::sort(v.begin(), v.end());
  for (int64_t i = 0; i < n; ++i) {
    if (v[static_cast<size_t>(i)] != i) return false;
  }
  return true;
}

using gradsync::test::error_of;

}  // namespace

// ---- equality with Python ------------------------------------------------------------------------------

TEST(Sampler, OrderEqualsPythonForManySizesReplicasAndFlags) {
  // n < replicas, n == replicas, n divisible by replicas and not, padding longer than the data set (cycling),
  // drop_last both ways, with and without shuffle, a few seeds and epochs.
  std::vector<Case> cases;
  const std::vector<int64_t> sizes = {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 31, 64, 100, 101, 1000, 1003};
  const std::vector<int64_t> replicas = {1, 2, 3, 4, 7, 8, 16};
  const std::vector<std::pair<uint64_t, int64_t>> seed_epochs = {{0, 0}, {0, 3}, {42, 1}, {12345, 7}};
  for (int64_t n : sizes) {
    for (int64_t r : replicas) {
      for (const auto& [seed, epoch] : seed_epochs) {
        for (bool shuffle : {true, false}) {
          // Without shuffle the seed and epoch are ignored: one of them is enough.
          if (!shuffle && !(seed == 42 && epoch == 1)) continue;
          for (bool drop_last : {false, true}) cases.push_back({n, r, seed, epoch, shuffle, drop_last});
        }
      }
    }
  }
  // The tricky shapes named explicitly, so that editing the lists above cannot lose them.
  const std::set<std::tuple<int64_t, int64_t>> must_have = {{3, 8}, {1, 16}, {8, 4}, {17, 4}, {7, 16}, {16, 16}};
  for (const auto& [n, r] : must_have) {
    EXPECT_TRUE(std::any_of(cases.begin(), cases.end(), [&](const Case& c) {
      return c.n == n && c.replicas == r && c.drop_last && c.shuffle;
    })) << n << " " << r;
  }
  ASSERT_GT(cases.size(), 1000u);
  expect_equal_to_python(cases);
}

TEST(Sampler, OrderEqualsPythonForLargeSeedsAndManyEpochs) {
  std::vector<Case> cases;
  const std::vector<uint64_t> seeds = {1,
                                       2147483647ULL,          // 2^31 - 1
                                       2147483648ULL,          // 2^31
                                       4294967296ULL + 17,     // above 32 bits
                                       9223372036854775807ULL, // 2^63 - 1
                                       9223372036854775815ULL, // 2^63 + 7
                                       18446744073709551600ULL};  // 2^64 - 16: seed + epoch still fits
  for (uint64_t seed : seeds) {
    for (int64_t epoch = 0; epoch < 6; ++epoch) {
      cases.push_back({50, 3, seed, epoch, true, false});
      cases.push_back({50, 3, seed, epoch, true, true});
    }
  }
  for (int64_t epoch : {10, 100, 1000, 123456}) cases.push_back({33, 4, 7, epoch, true, false});
  expect_equal_to_python(cases);
}

TEST(Sampler, OrderEqualsPythonForLargeDataSets) {
  // Large enough to exercise randperm on long inputs; few cases so the reference stays quick.
  expect_equal_to_python({{100000, 3, 5, 2, true, false},
                          {100003, 8, 0, 0, true, true},
                          {65537, 7, 99, 4, true, false},
                          {20001, 64, 3, 1, false, false}});
}

// ---- properties ----------------------------------------------------------------------------------------

TEST(Sampler, EverySampleExactlyOnceWhenNoPaddingIsNeeded) {
  for (int64_t n : {1, 6, 12, 60, 1024}) {
    for (int64_t r : {1, 2, 3, 6}) {
      if (n % r != 0) continue;
      for (bool drop_last : {false, true}) {
        for (int64_t epoch : {0, 1, 2}) {
          const Case c{n, r, 11, epoch, true, drop_last};
          const auto ranks = gradsync_indices(c);
          for (const auto& rank : ranks) EXPECT_EQ(static_cast<int64_t>(rank.size()), n / r) << c.str();
          EXPECT_TRUE(is_permutation_of_range(interleave(ranks), n)) << c.str();
        }
      }
    }
  }
  // Without shuffle: rank r gets r, r+R, r+2R, ...
  DistributedSampler s(12, 3, 1, /*shuffle=*/false);
  EXPECT_EQ(s.indices(), (Indices{1, 4, 7, 10}));
}

TEST(Sampler, PaddingRepeatsTheListFromItsStart) {
  // No shuffle: n=10, R=4 -> 12 slots: 0..9, then 0, 1.
  EXPECT_EQ(interleave(gradsync_indices({10, 4, 0, 0, false, false})),
            (Indices{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1}));
  EXPECT_EQ(DistributedSampler(10, 4, 2, false).indices(), (Indices{2, 6, 0}));
  EXPECT_EQ(DistributedSampler(10, 4, 3, false).indices(), (Indices{3, 7, 1}));
  // Padding longer than the list cycles it: n=3, R=8 -> 0 1 2 0 1 2 0 1.
  EXPECT_EQ(interleave(gradsync_indices({3, 8, 0, 0, false, false})), (Indices{0, 1, 2, 0, 1, 2, 0, 1}));

  // With shuffle: the first n slots are a permutation, slot i >= n repeats slot i - n.
  for (const auto& [n, r] : std::vector<std::pair<int64_t, int64_t>>{{10, 4}, {17, 4}, {3, 8}, {5, 16}, {101, 7}}) {
    for (int64_t epoch : {0, 1, 5}) {
      const Case c{n, r, 3, epoch, true, false};
      const auto all = interleave(gradsync_indices(c));
      const int64_t total = (n + r - 1) / r * r;
      ASSERT_EQ(static_cast<int64_t>(all.size()), total) << c.str();
      EXPECT_TRUE(is_permutation_of_range(Indices(all.begin(), all.begin() + n), n)) << c.str();
      for (int64_t i = n; i < total; ++i) {
        EXPECT_EQ(all[static_cast<size_t>(i)], all[static_cast<size_t>(i - n)]) << c.str() << " slot " << i;
      }
    }
  }
}

TEST(Sampler, DropLastTruncatesToAMultipleOfReplicas) {
  // n=10, R=4, drop_last: Python's ceil((10 - 4) / 4) = 2 per rank, 8 distinct samples in all.
  for (bool shuffle : {false, true}) {
    const Case c{10, 4, 0, 0, shuffle, true};
    const auto ranks = gradsync_indices(c);
    for (const auto& rank : ranks) EXPECT_EQ(rank.size(), 2u) << c.str();
    const auto all = interleave(ranks);
    EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), 8u) << c.str();
  }
  EXPECT_EQ(DistributedSampler(10, 4, 1, false, 0, true).indices(), (Indices{1, 5}));
  // Fewer samples than replicas with drop_last: nothing at all (Python's ceil(-0.x) == 0).
  DistributedSampler tiny(3, 8, 5, true, 0, /*drop_last=*/true);
  EXPECT_EQ(tiny.num_samples(), 0);
  EXPECT_EQ(tiny.total_size(), 0);
  EXPECT_TRUE(tiny.indices().empty());
  // Divisible: drop_last changes nothing.
  EXPECT_EQ(gradsync_indices({12, 4, 9, 2, true, true}), gradsync_indices({12, 4, 9, 2, true, false}));
}

TEST(Sampler, SetEpochChangesTheOrder) {
  DistributedSampler s(100, 2, 0, true, 7);
  EXPECT_EQ(s.epoch(), 0);
  const auto e0 = s.indices();
  EXPECT_EQ(s.indices(), e0) << "indices() must be deterministic for one epoch";
  s.set_epoch(1);
  EXPECT_EQ(s.epoch(), 1);
  const auto e1 = s.indices();
  EXPECT_NE(e1, e0);
  s.set_epoch(2);
  EXPECT_NE(s.indices(), e0);
  EXPECT_NE(s.indices(), e1);
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), e0) << "going back to an epoch gives its order again";
  // Same sets per epoch (only the order changes when no padding is needed): rank 0 + rank 1 cover 0..99.
  DistributedSampler other(100, 2, 1, true, 7);
  other.set_epoch(1);
  Indices both = e1;
  const auto e1_rank1 = other.indices();
  both.insert(both.end(), e1_rank1.begin(), e1_rank1.end());
  EXPECT_TRUE(is_permutation_of_range(both, 100));
  // Epoch e uses seed + e, as Python.
  DistributedSampler shifted(100, 2, 0, true, 8);
  EXPECT_EQ(shifted.indices(), e1);
  // A different seed gives a different order.
  DistributedSampler seeded(100, 2, 0, true, 1000);
  EXPECT_NE(seeded.indices(), e0);
  // Without shuffle the epoch does not matter.
  DistributedSampler plain(100, 2, 0, false, 7);
  const auto p0 = plain.indices();
  plain.set_epoch(5);
  EXPECT_EQ(plain.indices(), p0);
}

TEST(Sampler, InvalidArgumentsThrowConfigErrorNamingTheValue) {
  std::string msg = error_of<ConfigError>([] { DistributedSampler(0, 2, 0); });
  EXPECT_NE(msg.find("dataset size 0"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { DistributedSampler(-5, 2, 0); });
  EXPECT_NE(msg.find("-5"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { DistributedSampler(10, 0, 0); });
  EXPECT_NE(msg.find("num_replicas=0"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { DistributedSampler(10, -3, 0); });
  EXPECT_NE(msg.find("num_replicas=-3"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { DistributedSampler(10, 4, 4); });
  EXPECT_NE(msg.find("rank=4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_replicas=4"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { DistributedSampler(10, 4, -1); });
  EXPECT_NE(msg.find("rank=-1"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { DistributedSampler(10, 4, 17); });
  EXPECT_NE(msg.find("rank=17"), std::string::npos) << msg;
  // The boundary values are accepted.
  EXPECT_NO_THROW(DistributedSampler(1, 1, 0));
  EXPECT_NO_THROW(DistributedSampler(10, 4, 3));
}

// ---- torch::data: the sampler in libtorch's DataLoader -----------------------------------------------------

namespace {

// Sample i is the tensor {i}: a batch of the loader shows which indices the sampler gave.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  int64_t n;
  explicit IndexDataset(int64_t size) : n(size) {}
  torch::data::Example<> get(size_t i) override {
    auto t = torch::tensor({static_cast<int64_t>(i)});
    return {t, t};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n); }
};

using Batches = std::vector<Indices>;  // one epoch's batches

// Every batch a loader yields for `sampler`, epochs first..last-1 (set_epoch(e) on the caller's sampler: the loader
// owns a copy).
template <typename Loader>
std::vector<Batches> epochs_of(Loader& loader, DistributedSampler& sampler, int64_t first, int64_t last) {
  std::vector<Batches> out;
  for (int64_t e = first; e < last; ++e) {
    sampler.set_epoch(e);
    Batches epoch;
    for (auto& b : loader) {
      const torch::Tensor flat = b.data.flatten().contiguous();
      epoch.emplace_back(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel());
    }
    out.push_back(epoch);
  }
  return out;
}

// The loader's batches over `epochs` epochs, set_epoch(e) called on the caller's sampler (the loader owns a copy).
std::vector<Batches> loader_epochs(int64_t n, int64_t replicas, int64_t rank, uint64_t seed, bool shuffle,
                                   bool drop_last, int64_t batch, int64_t epochs, size_t workers) {
  DistributedSampler sampler(n, replicas, rank, shuffle, seed, drop_last);
  auto loader = torch::data::make_data_loader(IndexDataset(n).map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions(static_cast<size_t>(batch))
                                                  .workers(workers));
  return epochs_of(*loader, sampler, 0, epochs);
}

}  // namespace

TEST(Sampler, DataLoaderYieldsPythonsBatchesOverThreeEpochs) {
  struct LoaderCase {
    int64_t n, replicas, batch;
    uint64_t seed;
    bool shuffle, drop_last;
  };
  const std::vector<LoaderCase> cases{{100, 2, 8, 0, true, false}, {37, 3, 5, 11, true, false},
                                      {37, 3, 4, 5, true, true},   {10, 4, 3, 2, false, false},
                                      {1000, 4, 64, 123, true, false}};
  nlohmann::json request = nlohmann::json::array();
  for (const auto& c : cases) {
    request.push_back({{"n", c.n}, {"replicas", c.replicas}, {"seed", c.seed}, {"shuffle", c.shuffle},
                       {"drop_last", c.drop_last}, {"batch_size", c.batch}, {"epochs", 3}});
  }
  gradsync::test::CommandOptions opts;
  opts.timeout = std::chrono::seconds(180);
  opts.env = {{"OMP_NUM_THREADS", "1"}};
  const auto r = gradsync::test::run({kPython, kSamplerReference, "--cases", request.dump()}, opts);
  ASSERT_TRUE(r.ok()) << r.describe();
  const auto results = nlohmann::json::parse(r.out).at("cases");
  ASSERT_EQ(results.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const auto python = results[i].at("rank_epochs").get<std::vector<std::vector<Batches>>>();
    for (int64_t rank = 0; rank < c.replicas; ++rank) {
      for (size_t workers : {size_t{0}, size_t{2}}) {  // with workers the loader copies the sampler again
        EXPECT_EQ(loader_epochs(c.n, c.replicas, rank, c.seed, c.shuffle, c.drop_last, c.batch, 3, workers),
                  python[static_cast<size_t>(rank)])
            << "n=" << c.n << " replicas=" << c.replicas << " rank=" << rank << " batch=" << c.batch
            << " workers=" << workers;
      }
    }
  }
}

TEST(Sampler, SavedPositionResumesMidEpochInANewLoader) {
  // 3 batches of epoch 1, saved; a new sampler and loader resume with the 4th; set_epoch of the saved epoch
  // keeps the position, the next epoch starts at its beginning.
  const auto full = loader_epochs(50, 2, 1, 9, true, false, 4, 3, 0);
  std::stringstream saved;
  {
    DistributedSampler sampler(50, 2, 1, true, 9);
    auto loader = torch::data::make_data_loader(IndexDataset(50).map(torch::data::transforms::Stack<>()), sampler,
                                                torch::data::DataLoaderOptions(4));
    sampler.set_epoch(1);
    int taken = 0;
    for (auto& batch : *loader) {
      (void)batch;
      if (++taken == 3) break;
    }
    EXPECT_EQ(sampler.position(), 12) << "the loader's copy and this sampler share their position";
    torch::serialize::OutputArchive archive;
    sampler.save(archive);
    archive.save_to(saved);
  }
  DistributedSampler resumed(50, 2, 1, true, 9);
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  resumed.load(archive);
  auto loader = torch::data::make_data_loader(IndexDataset(50).map(torch::data::transforms::Stack<>()), resumed,
                                              torch::data::DataLoaderOptions(4));
  const auto got = epochs_of(*loader, resumed, 1, 3);
  EXPECT_EQ(got[0], Batches(full[1].begin() + 3, full[1].end()));
  EXPECT_EQ(got[1], full[2]);
  // A position saved for another configuration is refused, naming the field.
  DistributedSampler other(50, 3, 1, true, 9);
  torch::serialize::InputArchive again;
  std::stringstream copy(saved.str());
  again.load_from(copy);
  const std::string msg = gradsync::test::error_of<ConfigError>([&] { other.load(again); });
  EXPECT_NE(msg.find("num_replicas=2"), std::string::npos) << msg;
}
