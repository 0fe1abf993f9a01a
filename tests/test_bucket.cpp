// Tests for the bucket layouts of include/gradsync/bucket.h (assign_buckets, rebuilt_bucket_layout,
// initial_bucket_layout): gradient-ready order (reverse registration), the first and the later byte cap (a
// bucket closes as soon as it reaches its cap; each dtype has its own limit sequence), one dtype per bucket,
// contiguous offsets covering every parameter exactly once; and the same buckets as real PyTorch's
// torch.distributed._compute_bucket_assignment_by_size (the reference Python, GRADSYNC_PYTHON, under a timeout) called as DDP does:
// at construction (registration order, sorted, reversed) and when the reducer rebuilds (ready order).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "ddp/bucket.h"
#include "support/subprocess.h"

namespace {

using gradsync::BucketPlan;
using Groups = std::vector<std::vector<size_t>>;  // [bucket] -> parameter indices in buffer order
using Order = std::vector<size_t>;

constexpr const char* kPython = GRADSYNC_PYTHON;

std::vector<torch::Tensor> params_of(const std::vector<int64_t>& numels, c10::ScalarType dtype = torch::kFloat) {
  std::vector<torch::Tensor> out;
  for (int64_t n : numels) out.push_back(torch::zeros({n}, dtype));
  return out;
}

Order reverse_registration(size_t n) {
  Order o(n);
  std::iota(o.rbegin(), o.rend(), size_t{0});
  return o;
}

// The layout DDP uses once gradients were seen arriving from the last parameter to the first.
std::vector<BucketPlan> plan(const std::vector<torch::Tensor>& params, size_t first_cap, size_t cap) {
  return gradsync::rebuilt_bucket_layout(params, reverse_registration(params.size()), first_cap, cap);
}

Groups groups_of(const std::vector<BucketPlan>& plan) {
  Groups out;
  for (const auto& b : plan) {
    std::vector<size_t> g;
    for (const auto& e : b.entries) g.push_back(e.param);
    out.push_back(g);
  }
  return out;
}

std::string describe(const std::vector<BucketPlan>& plan) {
  std::string s;
  for (const auto& b : plan) {
    s += fmt::format("[{} numel={}:", c10::toString(b.dtype), b.numel);
    for (const auto& e : b.entries) s += fmt::format(" p{}@{}+{}", e.param, e.offset, e.numel);
    s += "] ";
  }
  return s;
}

// Layout invariants of every plan: each bucket's entries are back to back from offset 0 with their
// parameter's numel, the bucket's numel is their sum, its dtype is every entry's dtype, entries follow
// `order`, and every parameter is in exactly one bucket.
void expect_valid_layout(const std::vector<torch::Tensor>& params, const Order& order,
                         const std::vector<BucketPlan>& plan) {
  std::vector<size_t> position(params.size());
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  std::vector<int> seen(params.size(), 0);
  for (size_t b = 0; b < plan.size(); ++b) {
    const auto& bucket = plan[b];
    EXPECT_FALSE(bucket.entries.empty()) << "bucket " << b << " is empty: " << describe(plan);
    int64_t offset = 0;
    for (size_t k = 0; k < bucket.entries.size(); ++k) {
      const auto& e = bucket.entries[k];
      ASSERT_LT(e.param, params.size()) << describe(plan);
      ++seen[e.param];
      EXPECT_EQ(e.offset, offset) << "bucket " << b << " entry " << k << ": " << describe(plan);
      EXPECT_EQ(e.numel, params[e.param].numel()) << "bucket " << b << " entry " << k << ": " << describe(plan);
      EXPECT_EQ(params[e.param].scalar_type(), bucket.dtype) << "bucket " << b << " mixes dtypes: " << describe(plan);
      if (k > 0) {
        EXPECT_GT(position[e.param], position[bucket.entries[k - 1].param])
            << "bucket " << b << " does not follow the order: " << describe(plan);
      }
      offset += e.numel;
    }
    EXPECT_EQ(bucket.numel, offset) << "bucket " << b << ": " << describe(plan);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(seen[i], 1) << "parameter " << i << " is in " << seen[i] << " buckets: " << describe(plan);
  }
}

// The size rule, per dtype: that dtype's j-th bucket has limit limits[min(j, last)]; every bucket but the
// dtype's last reached its limit, and none would have reached it without its last entry (it closes at once).
void expect_limits_respected(const std::vector<torch::Tensor>& params, const std::vector<size_t>& limits,
                             const std::vector<BucketPlan>& plan) {
  std::map<c10::ScalarType, std::vector<const BucketPlan*>> by_dtype;
  for (const auto& b : plan) by_dtype[b.dtype].push_back(&b);
  for (const auto& [dtype, buckets] : by_dtype) {
    const size_t elem = c10::elementSize(dtype);
    for (size_t j = 0; j < buckets.size(); ++j) {
      const auto& b = *buckets[j];
      const size_t limit = limits[std::min(j, limits.size() - 1)];
      const size_t bytes = static_cast<size_t>(b.numel) * elem;
      const size_t before_last = static_cast<size_t>(b.numel - b.entries.back().numel) * elem;
      if (j + 1 < buckets.size()) {
        EXPECT_GE(bytes, limit) << c10::toString(dtype) << " bucket " << j << " closed early: " << describe(plan);
      }
      if (b.entries.size() > 1) {
        EXPECT_LT(before_last, limit) << c10::toString(dtype) << " bucket " << j << " closed late: " << describe(plan);
      }
    }
  }
}

// Runs `script` (reads the JSON file argv[1], prints one JSON line) with the reference Python (GRADSYNC_PYTHON) under a timeout.
nlohmann::json python_json(const std::string& script, const nlohmann::json& input) {
  const std::string dir = gradsync::test::make_temp_dir("gradsync-bucket-");
  const std::string input_path = dir + "/input.json";
  std::ofstream(input_path) << input.dump();
  gradsync::test::CommandOptions opts;
  opts.timeout = std::chrono::seconds(120);
  opts.env = {{"OMP_NUM_THREADS", "1"}};
  const auto r = gradsync::test::run({kPython, "-c", script, input_path}, opts);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (!r.ok()) {
    ADD_FAILURE() << "python reference failed (needs " << kPython << " with torch):\n" << r.describe();
    return nullptr;
  }
  try {
    return nlohmann::json::parse(r.out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "python printed invalid JSON: " << e.what() << "\n" << r.describe();
    return nullptr;
  }
}

struct RandomCase {
  std::vector<int64_t> numels;
  std::vector<c10::ScalarType> dtypes;
  size_t first, cap;
  std::vector<torch::Tensor> params() const {
    std::vector<torch::Tensor> out;
    for (size_t i = 0; i < numels.size(); ++i) out.push_back(torch::zeros({numels[i]}, dtypes[i]));
    return out;
  }
  nlohmann::json json() const {
    std::vector<std::string> names;
    for (auto d : dtypes) names.push_back(d == torch::kDouble ? "float64" : d == torch::kHalf ? "float16" : "float32");
    return {{"numels", numels}, {"dtypes", names}, {"first", first}, {"cap", cap}};
  }
  std::string str() const { return json().dump(); }
};

std::vector<RandomCase> random_cases(unsigned seed, int count, bool mixed_dtypes) {
  std::mt19937 rng(seed);
  const std::vector<c10::ScalarType> all = {torch::kFloat, torch::kDouble, torch::kHalf};
  std::vector<RandomCase> cases;
  for (int i = 0; i < count; ++i) {
    RandomCase c;
    c.first = rng() % 300;
    c.cap = rng() % 1000;
    const auto single = all[rng() % all.size()];
    const int n = 1 + static_cast<int>(rng() % 15);
    for (int k = 0; k < n; ++k) {
      c.numels.push_back(1 + static_cast<int64_t>(rng() % 64));
      c.dtypes.push_back(mixed_dtypes ? all[rng() % all.size()] : single);
    }
    cases.push_back(c);
  }
  return cases;
}

// Buckets still open at the end come last in both implementations, in an unspecified order in PyTorch (an
// unordered_map): put the last `tail` groups in a canonical order before comparing.
Groups canonical_tail(Groups g, size_t tail) {
  const size_t from = g.size() > tail ? g.size() - tail : 0;
  std::sort(g.begin() + static_cast<std::ptrdiff_t>(from), g.end());
  return g;
}

}  // namespace

// ---- the rules, on hand-computed examples ------------------------------------------------------------------

TEST(Bucket, ParametersInReverseRegistrationOrder) {
  const auto params = params_of({10, 20, 5, 7, 3});
  const auto buckets = plan(params, 1 << 20, 1 << 20);  // caps never reached: one bucket
  expect_valid_layout(params, reverse_registration(5), buckets);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(groups_of(buckets), (Groups{{4, 3, 2, 1, 0}}));
  EXPECT_EQ(buckets[0].dtype, torch::kFloat);
  EXPECT_EQ(buckets[0].numel, 45);
  std::vector<int64_t> offsets;
  for (const auto& e : buckets[0].entries) offsets.push_back(e.offset);
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 3, 10, 15, 35}));  // p4 first in the flat buffer
  // assign_buckets follows whatever order it is given.
  const Order custom = {2, 0, 4, 1, 3};
  const auto follows = gradsync::assign_buckets(params, custom, {1 << 20});
  expect_valid_layout(params, custom, follows);
  EXPECT_EQ(groups_of(follows), (Groups{{2, 0, 4, 1, 3}}));
}

TEST(Bucket, FirstCapThenLaterCap) {
  // float32, walked backwards: p4 (12 B), p3 (28 B), p2 (20 B), p1 (80 B), p0 (40 B).
  const auto params = params_of({10, 20, 5, 7, 3});
  // First cap 40 B: p4 + p3 = 40 B reaches it. Later cap 100 B: p2 + p1 = 100 B. p0 is left over.
  auto buckets = plan(params, 40, 100);
  expect_valid_layout(params, reverse_registration(5), buckets);
  EXPECT_EQ(groups_of(buckets), (Groups{{4, 3}, {2, 1}, {0}})) << describe(buckets);
  // First cap 44 B: p4 + p3 = 40 B stays open, + p2 = 60 B closes it. Later cap 100 B: p1 + p0 = 120 B.
  buckets = plan(params, 44, 100);
  expect_valid_layout(params, reverse_registration(5), buckets);
  EXPECT_EQ(groups_of(buckets), (Groups{{4, 3, 2}, {1, 0}})) << describe(buckets);
  // The first cap applies to the first bucket only.
  EXPECT_EQ(groups_of(plan(params, 1000, 1)), (Groups{{4, 3, 2, 1, 0}}));
  EXPECT_EQ(groups_of(plan(params, 1, 1000)), (Groups{{4}, {3, 2, 1, 0}}));
  // The caps are not interchangeable.
  EXPECT_EQ(groups_of(plan(params, 100, 40)), (Groups{{4, 3, 2, 1}, {0}}));
  // More than two limits: each applies to one bucket, the last one repeats.
  const auto four = params_of({4, 4, 4, 4, 4, 4, 4, 4});  // 16 B each
  EXPECT_EQ(groups_of(gradsync::assign_buckets(four, reverse_registration(8), {16, 48, 32})),
            (Groups{{7}, {6, 5, 4}, {3, 2}, {1, 0}}));
}

TEST(Bucket, BucketClosesOnceItReachesItsCap) {
  const auto params = params_of({4, 4, 4, 4});  // 16 B each
  EXPECT_EQ(groups_of(plan(params, 32, 32)), (Groups{{3, 2}, {1, 0}}));    // exactly at the cap: closes
  EXPECT_EQ(groups_of(plan(params, 33, 33)), (Groups{{3, 2, 1}, {0}}));    // one byte short: stays open
  EXPECT_EQ(groups_of(plan(params, 31, 31)), (Groups{{3, 2}, {1, 0}}));    // passed: closes
  EXPECT_EQ(groups_of(plan(params, 0, 0)), (Groups{{3}, {2}, {1}, {0}}));  // cap 0: one parameter each
  EXPECT_EQ(groups_of(plan(params, 16, 48)), (Groups{{3}, {2, 1, 0}}));
  // A parameter larger than the cap closes the bucket it joins at once (a bucket exceeds its cap by at most
  // one parameter) and is alone when the bucket was empty.
  const auto big_alone = params_of({2, 100, 2, 2});
  auto buckets = plan(big_alone, 12, 12);
  expect_valid_layout(big_alone, reverse_registration(4), buckets);
  EXPECT_EQ(groups_of(buckets), (Groups{{3, 2}, {1}, {0}})) << describe(buckets);
  buckets = plan(params_of({2, 2, 100, 1}), 12, 12);
  EXPECT_EQ(groups_of(buckets), (Groups{{3, 2}, {1, 0}})) << describe(buckets);
  EXPECT_EQ(buckets[0].numel, 101);
  // The cap is in bytes: float64 elements count twice as much as float32 ones.
  EXPECT_EQ(groups_of(plan(params_of({4, 4, 4, 4}, torch::kDouble), 32, 32)), (Groups{{3}, {2}, {1}, {0}}));
  EXPECT_EQ(groups_of(plan(params_of({4, 4, 4, 4}, torch::kHalf), 32, 32)), (Groups{{3, 2, 1, 0}}));
}

TEST(Bucket, SeparatesDtypes) {
  // Registration order interleaves float32 (0, 3, 5), float64 (1, 4) and float16 (2, 6).
  const std::vector<torch::Tensor> params = {
      torch::zeros({3}), torch::zeros({5}, torch::kDouble), torch::zeros({2}, torch::kHalf), torch::zeros({4}),
      torch::zeros({6}, torch::kDouble), torch::zeros({7}), torch::zeros({1}, torch::kHalf)};
  const auto order = reverse_registration(params.size());
  // Caps never reached: exactly one bucket per dtype, each in reverse registration order.
  auto buckets = plan(params, 1 << 20, 1 << 20);
  expect_valid_layout(params, order, buckets);
  ASSERT_EQ(buckets.size(), 3u) << describe(buckets);
  std::map<c10::ScalarType, std::vector<size_t>> by_dtype;
  for (const auto& b : buckets) {
    EXPECT_EQ(by_dtype.count(b.dtype), 0u) << "two buckets of " << c10::toString(b.dtype) << ": " << describe(buckets);
    for (const auto& e : b.entries) by_dtype[b.dtype].push_back(e.param);
  }
  EXPECT_EQ(by_dtype[torch::kFloat], (std::vector<size_t>{5, 3, 0}));
  EXPECT_EQ(by_dtype[torch::kDouble], (std::vector<size_t>{4, 1}));
  EXPECT_EQ(by_dtype[torch::kHalf], (std::vector<size_t>{6, 2}));

  // Every dtype starts with the first cap (PyTorch keeps one limit sequence per dtype). First cap 8 B, later
  // 1000 B, walking back: p6 (f16, 2 B) open; p5 (f32, 28 B) closes; p4 (f64, 48 B) closes; p3 (f32, 16 B) now
  // under 1000 B; p2 (f16, 4 B) joins p6: 6 B, still under the f16 first cap; p1 (f64) and p0 (f32) stay open.
  buckets = plan(params, 8, 1000);
  expect_valid_layout(params, order, buckets);
  expect_limits_respected(params, {8, 1000}, buckets);
  const auto groups = groups_of(buckets);
  ASSERT_EQ(groups.size(), 5u) << describe(buckets);
  EXPECT_EQ(groups[0], (std::vector<size_t>{5})) << describe(buckets);
  EXPECT_EQ(groups[1], (std::vector<size_t>{4})) << describe(buckets);
  Groups rest(groups.begin() + 2, groups.end());  // still open at the end: any order
  std::sort(rest.begin(), rest.end());
  EXPECT_EQ(rest, (Groups{{1}, {3, 0}, {6, 2}})) << describe(buckets);

  // Small caps: still one dtype per bucket, a valid layout, the limits per dtype.
  for (size_t first : {size_t{0}, size_t{8}, size_t{20}}) {
    for (size_t cap : {size_t{0}, size_t{16}, size_t{40}}) {
      SCOPED_TRACE(fmt::format("first={} cap={}", first, cap));
      buckets = plan(params, first, cap);
      expect_valid_layout(params, order, buckets);
      expect_limits_respected(params, {first, cap}, buckets);
    }
  }
  // cap 0: every parameter alone, in reverse registration order whatever its dtype.
  EXPECT_EQ(groups_of(plan(params, 0, 0)), (Groups{{6}, {5}, {4}, {3}, {2}, {1}, {0}}));
}

TEST(Bucket, InitialLayout) {
  const std::vector<torch::Tensor> params = {torch::zeros({3}), torch::zeros({5}, torch::kDouble),
                                             torch::zeros({20}), torch::zeros({4}), torch::zeros({6}, torch::kDouble)};
  const Order registration = {0, 1, 2, 3, 4};
  // Without find_unused_parameters: one bucket per dtype (no limit), the one with the smallest index last.
  auto buckets = gradsync::initial_bucket_layout(params, false, 8, 16);
  expect_valid_layout(params, registration, buckets);
  EXPECT_EQ(groups_of(buckets), (Groups{{1, 4}, {0, 2, 3}})) << describe(buckets);
  // With it: registration order, caps per dtype, buckets sorted by smallest index and reversed. Caps 8 / 16 B:
  // every parameter reaches its dtype's cap alone.
  buckets = gradsync::initial_bucket_layout(params, true, 8, 16);
  expect_valid_layout(params, registration, buckets);
  EXPECT_EQ(groups_of(buckets), (Groups{{4}, {3}, {2}, {1}, {0}})) << describe(buckets);
  // Caps 50 / 50 B: float32 p0 + p2 = 92 B closes, p3 left open; float64 p1 + p4 = 88 B closes.
  buckets = gradsync::initial_bucket_layout(params, true, 50, 50);
  expect_valid_layout(params, registration, buckets);
  EXPECT_EQ(groups_of(buckets), (Groups{{3}, {1, 4}, {0, 2}})) << describe(buckets);
}

TEST(Bucket, LayoutInvariantsOnRandomParameterLists) {
  std::mt19937 rng(1234);
  const std::vector<c10::ScalarType> dtypes = {torch::kFloat, torch::kDouble, torch::kHalf};
  for (int trial = 0; trial < 300; ++trial) {
    const int count = static_cast<int>(rng() % 12);  // includes the empty list
    std::vector<torch::Tensor> params;
    for (int i = 0; i < count; ++i) {
      const int64_t numel = static_cast<int64_t>(rng() % 50);  // includes empty parameters
      params.push_back(torch::zeros({numel}, dtypes[trial % 2 == 0 ? 0 : rng() % dtypes.size()]));
    }
    Order order(params.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<size_t> limits;
    for (size_t k = 0, n = 1 + rng() % 3; k < n; ++k) limits.push_back(rng() % 300);
    SCOPED_TRACE(fmt::format("trial {} limits {}", trial, nlohmann::json(limits).dump()));
    const auto buckets = gradsync::assign_buckets(params, order, limits);
    expect_valid_layout(params, order, buckets);
    expect_limits_respected(params, limits, buckets);
    if (params.empty()) {
      EXPECT_TRUE(buckets.empty());
    }
    const auto initial = gradsync::initial_bucket_layout(params, trial % 3 == 0, limits.front(), limits.back());
    Order registration(params.size());
    std::iota(registration.begin(), registration.end(), size_t{0});
    expect_valid_layout(params, registration, initial);
  }
}

// ---- equal to real PyTorch -----------------------------------------------------------------------------

TEST(Bucket, RebuiltLayoutEqualsPyTorch) {
  // The reducer's rebuild: compute_bucket_assignment_by_size(params in ready order, [first_bucket_bytes,
  // bucket_bytes_cap], ..., their indices). Ready order here: reverse registration.
  std::vector<RandomCase> cases = {
      {{10, 20, 5, 7, 3}, std::vector<c10::ScalarType>(5, torch::kFloat), 40, 100},
      {{10, 20, 5, 7, 3}, std::vector<c10::ScalarType>(5, torch::kFloat), 44, 100},
      {{4, 4, 4, 4}, std::vector<c10::ScalarType>(4, torch::kDouble), 32, 32},
      {{2, 100, 2, 2}, std::vector<c10::ScalarType>(4, torch::kFloat), 12, 12},
      {{1, 1, 1}, std::vector<c10::ScalarType>(3, torch::kFloat), 0, 0},
      {{3, 5, 2, 4, 6, 7, 1},
       {torch::kFloat, torch::kDouble, torch::kHalf, torch::kFloat, torch::kDouble, torch::kFloat, torch::kHalf},
       8, 1000}};
  for (const auto& c : random_cases(99, 80, /*mixed_dtypes=*/false)) cases.push_back(c);
  for (const auto& c : random_cases(7, 80, /*mixed_dtypes=*/true)) cases.push_back(c);
  nlohmann::json input = nlohmann::json::array();
  for (const auto& c : cases) input.push_back(c.json());
  const auto python = python_json(R"PY(
import json, sys, torch, torch.distributed as dist
out = []
for c in json.load(open(sys.argv[1])):
    params = [torch.zeros(n, dtype=getattr(torch, d)) for n, d in zip(c["numels"], c["dtypes"])]
    order = list(reversed(range(len(params))))
    buckets, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [c["first"], c["cap"]],
                                                         [False] * len(params), order)
    out.append([list(b) for b in buckets])
print(json.dumps(out))
)PY", input);
  ASSERT_TRUE(python.is_array()) << python.dump();
  ASSERT_EQ(python.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto params = cases[i].params();
    const auto buckets = plan(params, cases[i].first, cases[i].cap);
    const size_t ndtypes = std::set<c10::ScalarType>(cases[i].dtypes.begin(), cases[i].dtypes.end()).size();
    EXPECT_EQ(canonical_tail(groups_of(buckets), ndtypes), canonical_tail(python[i].get<Groups>(), ndtypes))
        << "case " << i << " " << cases[i].str() << "\n  gradsync " << describe(buckets) << "\n  pytorch  "
        << python[i].dump();
  }
}

TEST(Bucket, InitialLayoutEqualsPyTorch) {
  // DistributedDataParallel.__init__: compute_bucket_assignment_by_size(params in registration order, limits,
  // ...) (sorted by smallest index), limits [sys.maxsize] unless find_unused_parameters, then reversed.
  auto cases = random_cases(5, 60, /*mixed_dtypes=*/true);
  for (const auto& c : random_cases(6, 30, /*mixed_dtypes=*/false)) cases.push_back(c);
  nlohmann::json input = nlohmann::json::array();
  for (const auto& c : cases) input.push_back(c.json());
  const auto python = python_json(R"PY(
import json, sys, torch, torch.distributed as dist
out = []
for c in json.load(open(sys.argv[1])):
    params = [torch.zeros(n, dtype=getattr(torch, d)) for n, d in zip(c["numels"], c["dtypes"])]
    per_mode = []
    for limits in ([sys.maxsize], [c["first"], c["cap"]]):
        buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
        per_mode.append([list(b) for b in reversed(buckets)])
    out.append(per_mode)
print(json.dumps(out))
)PY", input);
  ASSERT_TRUE(python.is_array()) << python.dump();
  ASSERT_EQ(python.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto params = cases[i].params();
    for (bool find_unused : {false, true}) {
      const auto buckets = gradsync::initial_bucket_layout(params, find_unused, cases[i].first, cases[i].cap);
      EXPECT_EQ(groups_of(buckets), python[i][find_unused ? 1 : 0].get<Groups>())
          << "case " << i << " find_unused_parameters=" << find_unused << " " << cases[i].str()
          << "\n  gradsync " << describe(buckets) << "\n  pytorch  " << python[i][find_unused ? 1 : 0].dump();
    }
  }
}
