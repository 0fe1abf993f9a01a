// The engine interface: one training loop, written once as a template over the engine type, is run with every
// engine (DistributedDataParallel, FullyShardedDataParallel in each strategy, Zero1DataParallel, LocalEngine) and
// must end where one process trained on the global batch ends. The loop uses every operation of the interface:
// parameters(), track_optimizer(), zero_grad(), forward(), accumulate() (with no_sync inside), clip_grad_norm(),
// state_dict(), memory() and traffic(); load_state_dict() is checked after it. Ranks start from different initial
// parameters (rank 0's must win), steps accumulate K = 2 micro-batches, and in the last step the last rank has no
// data and joins with zeros (DDP and ZeRO-1 also in the very first step, by rank 0); in the "uneven" pattern every
// rank holds its own count.
#include <gtest/gtest.h>

#include <functional>

#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/engine.h"
#include "gradsync/fsdp.h"
#include "gradsync/local.h"
#include "gradsync/zero.h"
#include "support/subprocess.h"
#include "support/test_models.h"
#include "support/worker.h"

namespace t = gradsync::test;
namespace sh = gradsync::test::sharding;
namespace F = torch::nn::functional;

namespace {

constexpr const char* kWidths = "6-13-7-3";
constexpr int64_t kMicroBatch = 4;
constexpr double kMaxNorm = 0.5;  // small enough that every step clips: the norm of the whole gradient matters

struct Micro {
  torch::Tensor x, y;
};
using Step = std::vector<Micro>;  // one rank's micro-batches in one optimizer step (possibly none)

// Which rank has no data in step s (-1: none). "late": the last rank, in the last step (FSDP can join only after a
// synchronised step of its own). "early": rank 0 in the very first step (before DDP's bucket rebuild, whose order
// rank 0 then cannot give), the last rank in the second.
int joiner(const std::string& pattern, int64_t s, int n) {
  if (n == 1) return -1;
  if (pattern == "early") return s == 0 ? 0 : s == 1 ? n - 1 : -1;
  return s == 2 ? n - 1 : -1;
}

// Rank r's micro-batch count in step s: K = 2 in steps without a joining rank, else one for every rank with data.
// "uneven": every rank its own count, 0 to 2, from the second step on (FSDP replays a micro-step of the rank's own
// for the ones it lacks, so each rank runs one in the first step).
int64_t micro_count(const std::string& pattern, int64_t s, int n, int r) {
  if (pattern == "uneven") return n == 1 ? 2 : s == 0 ? 1 + r % 2 : (r + s) % 3;
  const int j = joiner(pattern, s, n);
  return j == r ? 0 : j < 0 ? 2 : 1;
}

// Rank r's micro-batches in step s of a world of n, consecutive slices of a global batch that is the same on every
// rank and differs every step.
std::vector<Step> rank_steps(int n, int r, const std::string& pattern = "late") {
  std::vector<Step> steps;
  for (int64_t s = 0; s < 3; ++s) {
    int64_t total = 0, before = 0;
    for (int q = 0; q < n; ++q) {
      if (q == r) before = total;
      total += micro_count(pattern, s, n, q);
    }
    auto [x, y] = sh::global_batch(s, total * kMicroBatch, sh::input_width(kWidths), sh::output_width(kWidths));
    Step step;
    for (int64_t m = 0; m < micro_count(pattern, s, n, r); ++m) {
      const int64_t at = (before + m) * kMicroBatch;
      step.push_back({x.narrow(0, at, kMicroBatch), y.narrow(0, at, kMicroBatch)});
    }
    steps.push_back(step);
  }
  return steps;
}

// THE training loop: the same code for every engine type.
template <typename EngineType>
gradsync::StateDict train(EngineType& engine, const std::vector<Step>& steps) {
  torch::optim::SGD optimizer(engine.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  engine.track_optimizer(&optimizer);
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto& step = steps[s];
    engine.zero_grad();
    gradsync::accumulate(engine, static_cast<int64_t>(step.size()), [&](int64_t m) {
      const auto& micro = step[static_cast<size_t>(m)];
      return F::cross_entropy(engine.forward(micro.x), micro.y);
    });
    engine.clip_grad_norm(kMaxNorm);
    // A checkpoint between backward and the step: it must not make the next forward miss the step's update.
    if (s == 1) engine.state_dict(/*rank0_only=*/true);
    optimizer.step();
  }
  auto state = engine.state_dict();
  WORKER_CHECK(engine.memory().peak_total() > 0, "{}: memory() counted nothing", engine.name());
  engine.track_optimizer(nullptr);
  return state;
}

// load_state_dict() loads rank 0's state everywhere: ranks other than 0 pass an empty one (a rank of its own,
// the local engine, passes the whole state), and afterwards every rank's state_dict() is exactly that state.
template <typename EngineType>
void check_load(EngineType& engine, int rank, bool own_rank) {
  const auto fresh = gradsync::state_dict(*sh::make_mlp(kWidths, false, 77));
  engine.load_state_dict(rank == 0 || own_rank ? fresh : gradsync::StateDict{});
  const double d = sh::max_relative_difference(engine.state_dict(), fresh);
  WORKER_CHECK(d == 0, "{} on rank {}: load_state_dict then state_dict differs by {}", engine.name(), rank, d);
}

// One process on the global batch, no gradsync: the gradient of step s is sum over ranks r with data and their
// K_r micro-batches of grad(loss_rk) / (N * K_r) (Reduction::Mean; a rank without data adds zeros, counted in N).
gradsync::StateDict reference(int n, const std::vector<std::vector<Step>>& by_rank) {
  auto model = sh::make_mlp(kWidths, false, 0);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (size_t s = 0; s < by_rank.front().size(); ++s) {
    optimizer.zero_grad();
    for (const auto& steps : by_rank) {
      const auto& step = steps[s];
      for (const auto& micro : step) {
        (F::cross_entropy(model->forward(micro.x), micro.y) / static_cast<double>(n * step.size())).backward();
      }
    }
    torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm);
    optimizer.step();
  }
  return gradsync::state_dict(*model);
}

// A unit per layer: the default would make this small model one unit (kDefaultUnitParams).
gradsync::FsdpOptions fsdp(gradsync::ShardingStrategy strategy) {
  return gradsync::FsdpOptions().strategy(strategy).wrap(gradsync::WrapPolicy::children());
}

// "fsdp-full", "fsdp-grad-op" or "fsdp-no-shard": a unit per layer; with "+root", unit "2" and the root unit
// holding the other layers.
gradsync::FsdpOptions fsdp_options(const std::string& kind) {
  const auto strategy = kind.rfind("fsdp-full", 0) == 0      ? gradsync::ShardingStrategy::FullShard
                        : kind.rfind("fsdp-grad-op", 0) == 0 ? gradsync::ShardingStrategy::ShardGradOp
                                                             : gradsync::ShardingStrategy::NoShard;
  if (kind.find("+root") == std::string::npos) return fsdp(strategy);
  return gradsync::FsdpOptions().strategy(strategy).wrap(gradsync::WrapPolicy::list({"2"}));
}

// Builds the engine `kind` names ("ddp", "zero1" or fsdp_options()'s) over `model` and hands it to `fn`.
template <typename Fn>
void with_engine(const std::string& kind, torch::nn::Sequential model, std::shared_ptr<gradsync::World> world,
                 Fn&& fn) {
  if (kind == "ddp") {
    gradsync::DistributedDataParallel engine(model, world);
    fn(engine);
  } else if (kind == "zero1") {
    gradsync::Zero1DataParallel engine(model, world);
    fn(engine);
  } else {
    gradsync::FullyShardedDataParallel engine(model, world, fsdp_options(kind));
    fn(engine);
  }
}

}  // namespace

// args: an engine name, optionally "+early" (see joiner())
GRADSYNC_WORKER(engine_loop) {
  auto world = sh::join();
  const int n = world->size(), r = world->rank();
  const std::string spec = args.at(0);
  const auto plus = spec.find('+');
  const std::string kind = spec.substr(0, plus);
  const std::string pattern = plus == std::string::npos ? "late" : spec.substr(plus + 1);
  auto model = sh::make_mlp(kWidths, false, r == 0 ? 0 : 40 + r);  // rank 0's initial parameters must win
  std::vector<std::vector<Step>> by_rank;
  for (int q = 0; q < n; ++q) by_rank.push_back(rank_steps(n, q, pattern));
  gradsync::StateDict got;
  gradsync::CommStats traffic;
  if (kind == "local") {
    // One process holding every rank's micro-batches of the steps without a joining rank (the first two).
    std::vector<Step> all(2);
    for (size_t s = 0; s < all.size(); ++s) {
      for (const auto& steps : by_rank) all[s].insert(all[s].end(), steps[s].begin(), steps[s].end());
    }
    auto local = sh::make_mlp(kWidths, false, 0);
    gradsync::LocalEngine engine(local);
    got = train(engine, all);
    check_load(engine, r, /*own_rank=*/true);
    const double d = sh::max_relative_difference(got, reference(1, {all}));
    WORKER_CHECK(d <= 1e-5, "local: differs from one process by {}", d);
    return 0;
  }
  with_engine(kind, model, world, [&](auto& engine) {
    got = train(engine, by_rank[static_cast<size_t>(r)]);
    traffic = engine.traffic();
    check_load(engine, r, false);
  });
  const double d = sh::max_relative_difference(got, reference(n, by_rank));
  WORKER_CHECK(d <= 1e-5, "{} on {} ranks (rank {}): differs from one process on the global batch by {}", kind, n, r,
               d);
  WORKER_CHECK(n == 1 || traffic.total() > 0, "{}: traffic() counted no bytes on {} ranks", kind, n);
  if (r == 0) fmt::print("{} N={}: max rel diff {:.2e} from one process, {} sent\n", spec, n, d, traffic.total());
  return 0;
}

// FSDP's collectives depend on each rank's micro-batch count: a rank with fewer replays a micro-step of its own, so
// one without data before any micro-step of its own fails on every rank, naming it, instead of pairing different
// collectives. args: "early-join" (rank 1 has no data in the first step).
GRADSYNC_WORKER(fsdp_counts_must_fit) {
  auto world = sh::join();
  const int r = world->rank();
  auto model = sh::make_mlp(kWidths, false, 0);
  gradsync::FullyShardedDataParallel engine(model, world);
  auto steps = rank_steps(world->size(), r);
  const int64_t k = r == 0 ? 1 : 0;
  try {
    gradsync::accumulate(engine, k, [&](int64_t m) {
      const auto& micro = steps[0][static_cast<size_t>(m)];
      return F::cross_entropy(engine.forward(micro.x), micro.y);
    });
  } catch (const gradsync::ConfigError& e) {
    const std::string what = e.what();
    WORKER_CHECK(what.find("micro-batch counts do not fit") != std::string::npos, "message: {}", what);
    WORKER_CHECK(what.find("rank 0: 1, rank 1: 0") != std::string::npos &&
                     what.find("rank(s) 1 cannot") != std::string::npos, "message: {}", what);
    return 0;
  }
  WORKER_CHECK(false, "rank {}: counts that do not fit were accepted", r);
  return 1;
}

TEST(EngineLoop, FsdpRankWithoutAMicroStepOfItsOwnFailsTogether) {
  t::CommandOptions options;
  options.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(2, t::worker_argv("fsdp_counts_must_fit", {"early-join"}), options);
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.describe();
}

class EngineLoop : public testing::TestWithParam<std::tuple<const char*, int>> {};

TEST_P(EngineLoop, EndsWhereOneProcessOnTheGlobalBatchEnds) {
  const auto [kind, n] = GetParam();
  t::CommandOptions options;
  options.timeout = std::chrono::seconds(90);
  auto results = t::run_ranks(n, t::worker_argv("engine_loop", {kind}), options);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
  std::cout << results[0].out;
}

// A rank without data before DDP has rebuilt its buckets (rank 0, whose order every rank would take) and after;
// ranks holding 0, 1 or 2 micro-batches in the same step (FSDP: shadow micro-steps, Note [Shadow micro-steps]).
INSTANTIATE_TEST_SUITE_P(EarlyJoins, EngineLoop,
                         testing::Combine(testing::Values("ddp+early", "zero1+early", "ddp+uneven", "zero1+uneven",
                                                          "fsdp-full+uneven", "fsdp-grad-op+uneven",
                                                          "fsdp-no-shard+uneven"),
                                          testing::Values(3)),
                         [](const auto& info) {
                           std::string name = std::get<0>(info.param);
                           for (auto& ch : name) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return fmt::format("{}_N{}", name, std::get<1>(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(Engines, EngineLoop,
                         testing::Combine(testing::Values("local", "ddp", "fsdp-full", "fsdp-grad-op",
                                                          "fsdp-no-shard", "zero1"),
                                          testing::Values(1, 3)),
                         [](const auto& info) {
                           std::string name = std::get<0>(info.param);
                           for (auto& ch : name) ch = ch == '-' ? '_' : ch;
                           return fmt::format("{}_N{}", name, std::get<1>(info.param));
                         });

// An evaluation between a forward and its backward (a forward under NoGradGuard, on other inputs) builds no graph:
// the backward that follows is the first forward's, synchronised as that forward decided, as in PyTorch DDP. The
// step must end where one process on the global batch ends. FSDP: with a root unit (parameters outside any unit,
// which no hook of the backward gathers) and with a unit per layer, in each strategy. args: an engine name.
GRADSYNC_WORKER(evaluation_between) {
  auto world = sh::join();
  const int n = world->size(), r = world->rank();
  const std::string kind = args.at(0);
  auto [x, y] = sh::global_batch(0, n * kMicroBatch, sh::input_width(kWidths), sh::output_width(kWidths));
  std::vector<std::vector<Step>> by_rank;
  for (int q = 0; q < n; ++q) {
    by_rank.push_back({Step{{x.narrow(0, q * kMicroBatch, kMicroBatch), y.narrow(0, q * kMicroBatch, kMicroBatch)}}});
  }
  const auto& mine = by_rank[static_cast<size_t>(r)][0][0];
  auto step = [&](auto& engine) {
    torch::optim::SGD optimizer(engine.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto loss = F::cross_entropy(engine.forward(mine.x), mine.y);
    {
      torch::NoGradGuard no_grad;
      engine.forward(mine.x * 3 + r);  // a metric on other inputs, different on every rank
    }
    loss.backward();
    engine.clip_grad_norm(kMaxNorm);
    optimizer.step();
    return engine.state_dict();
  };
  gradsync::StateDict got;
  with_engine(kind, sh::make_mlp(kWidths, false, 0), world, [&](auto& engine) { got = step(engine); });
  const double d = sh::max_relative_difference(got, reference(n, by_rank));
  WORKER_CHECK(d <= 1e-5, "{} (rank {}): an evaluation between forward and backward, then differs from one process "
               "on the global batch by {}", kind, r, d);
  return 0;
}

class EvaluationBetween : public testing::TestWithParam<const char*> {};

TEST_P(EvaluationBetween, LeavesTheBackwardSynchronisedAsItsForwardDecided) {
  t::CommandOptions options;
  options.timeout = std::chrono::seconds(60);
  auto results = t::run_ranks(2, t::worker_argv("evaluation_between", {GetParam()}), options);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
}

INSTANTIATE_TEST_SUITE_P(Engines, EvaluationBetween,
                         testing::Values("ddp", "zero1", "fsdp-full", "fsdp-full+root", "fsdp-grad-op+root",
                                         "fsdp-no-shard"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (auto& ch : name) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });
