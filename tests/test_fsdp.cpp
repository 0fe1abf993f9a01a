// FullyShardedDataParallel tests. The main check is equivalence (PyTorch's _test_DDP_niter style): on every rank,
// an FSDP model trained on the rank's share of each global batch must equal, after every step, both a local
// replica trained on the whole global batch and a gradsync DDP model, for every strategy, optimizer (SGD with
// momentum and weight decay, Adam), accumulation (K micro-batches, both accumulation modes), wrap policy and
// N = 1..4, with layer sizes that do not divide by N (padding). Then: sum vs mean told apart, state dicts (full,
// re-shard, sharded with optimizer state), clip_grad_norm, memory at N = 4, traffic per step against Psi,
// mixed precision, and ranks running units in different orders.
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gradsync/engine.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "shard/wrap_policy.h"
#include "shard/sharded_checkpoint.h"
#include "support/test_models.h"
#include "support/subprocess.h"
#include "support/worker.h"

using gradsync::FsdpOptions;
using gradsync::FullyShardedDataParallel;
using gradsync::ShardedAccumulation;
using gradsync::ShardingStrategy;
using gradsync::StateDict;
namespace t = gradsync::test;
namespace sh = gradsync::test::sharding;
namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace {

// A unit per layer: these models hold a few hundred parameters, which the default (kDefaultUnitParams) would make
// one unit, leaving the multi-unit paths (prefetch, the kept last unit, per-unit reductions) untested.
FsdpOptions per_layer() { return FsdpOptions().wrap(gradsync::WrapPolicy::children()); }

ShardingStrategy strategy_of(const std::string& name) {
  if (name == "full") return ShardingStrategy::FullShard;
  if (name == "grad_op") return ShardingStrategy::ShardGradOp;
  if (name == "no_shard") return ShardingStrategy::NoShard;
  if (name == "hybrid") return ShardingStrategy::HybridShard;
  throw std::invalid_argument("strategy " + name);
}

// "strategy/optimizer/K/accumulation/wrap/widths/batchnorm", e.g. "full/adam/2/sharded/params:100/6-13-7-3/0"
struct Config {
  std::string text, strategy, optimizer, accumulation, wrap, widths;
  int64_t k = 1;
  bool batch_norm = false;
};

Config parse_config(const std::string& text) {
  std::vector<std::string> f;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, '/');) f.push_back(part);
  if (f.size() != 7) throw std::invalid_argument("config " + text);
  return {text, f[0], f[1], f[3], f[4], f[5], std::stoll(f[2]), f[6] == "1"};
}

StateDict select(const StateDict& state, const nn::Module& module, bool parameters) {
  const auto params = module.named_parameters();
  StateDict out;
  for (const auto& [k, v] : state) {
    if ((params.find(k) != nullptr) == parameters) out.emplace_back(k, v);
  }
  return out;
}
StateDict parameters_only(const StateDict& state, const nn::Module& module) { return select(state, module, true); }
// This rank's own buffers (BatchNorm statistics): a parameter of an FSDP module may be freed, a buffer never is.
StateDict buffers_only(const StateDict& state, const nn::Module& module) { return select(state, module, false); }

t::CommandOptions options(int seconds = 90) {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(seconds);
  return o;
}

void expect_all_ok(const std::vector<t::ProcessResult>& results, bool print_rank0 = false) {
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
  if (print_rank0 && !results.empty()) std::cout << results[0].out;
}

}  // namespace

GRADSYNC_WORKER(fsdp_equivalence) {
  auto world = sh::join();
  const int n = world->size();
  const int r = world->rank();
  for (const auto& text : args) {
    const auto c = parse_config(text);
    auto local = sh::make_mlp(c.widths, c.batch_norm, 0);
    auto ddp_model = sh::make_mlp(c.widths, c.batch_norm, r == 0 ? 0 : 100 + r);  // rank 0's must win
    auto fsdp_model = sh::make_mlp(c.widths, c.batch_norm, r == 0 ? 0 : 200 + r);
    gradsync::DistributedDataParallel ddp(ddp_model, world);
    FsdpOptions o = per_layer();
    o.strategy(strategy_of(c.strategy));
    o.wrap(gradsync::parse_wrap_policy(c.wrap));
    o.accumulation(c.accumulation == "sharded" ? ShardedAccumulation::ReduceEveryMicroStep
                                                 : ShardedAccumulation::UnshardedGradients);
    FullyShardedDataParallel fsdp(fsdp_model, world, o);
    WORKER_CHECK(sh::max_relative_difference(fsdp.state_dict(), gradsync::state_dict(*local)) == 0,
                 "{}: initial parameters are not rank 0's", text);
    auto local_opt = sh::make_optimizer(c.optimizer, local->parameters());
    auto ddp_opt = sh::make_optimizer(c.optimizer, ddp_model->parameters());
    auto fsdp_opt = sh::make_optimizer(c.optimizer, fsdp.parameters());
    const int64_t b = 4;  // per-rank micro-batch
    double worst_local = 0, worst_ddp = 0;
    for (int64_t step = 0; step < 4; ++step) {
      auto [x, y] = sh::global_batch(step, b * c.k * n, sh::input_width(c.widths), sh::output_width(c.widths));
      auto rank_x = x.narrow(0, r * b * c.k, b * c.k);
      auto rank_y = y.narrow(0, r * b * c.k, b * c.k);
      if (!c.batch_norm) {  // BatchNorm over the global batch is not BatchNorm per rank: no local replica then
        local_opt->zero_grad();
        F::cross_entropy(local->forward(x), y).backward();
        local_opt->step();
      }
      ddp.zero_grad();
      gradsync::accumulate(ddp, c.k, [&](int64_t m) {
        return F::cross_entropy(ddp.forward(rank_x.narrow(0, m * b, b)), rank_y.narrow(0, m * b, b));
      });
      ddp_opt->step();
      fsdp.zero_grad();
      gradsync::accumulate(fsdp, c.k, [&](int64_t m) {
        return F::cross_entropy(fsdp.forward(rank_x.narrow(0, m * b, b)), rank_y.narrow(0, m * b, b));
      });
      fsdp_opt->step();

      auto mine = parameters_only(fsdp.state_dict(), *ddp_model);
      std::string key;
      const double d_ddp = sh::max_relative_difference(mine, parameters_only(gradsync::state_dict(*ddp_model),
                                                                               *ddp_model), &key);
      WORKER_CHECK(d_ddp <= 1e-5, "{} on {} ranks, step {}: FSDP differs from DDP by {} (relative) in {}", text, n,
                   step, d_ddp, key);
      worst_ddp = std::max(worst_ddp, d_ddp);
      // Every rank's buffers follow DDP's broadcast rule (rank 0's before the first forward of each step).
      const double d_buffers = sh::max_relative_difference(buffers_only(gradsync::state_dict(*fsdp_model), *fsdp_model),
                                                           buffers_only(gradsync::state_dict(*ddp_model), *ddp_model),
                                                           &key);
      WORKER_CHECK(d_buffers <= 1e-5, "{} on {} ranks, step {}: rank {}'s buffer {} differs from DDP's by {}", text, n,
                   step, r, key, d_buffers);
      if (!c.batch_norm) {
        const double d_local = sh::max_relative_difference(mine, gradsync::state_dict(*local), &key);
        WORKER_CHECK(d_local <= 1e-5, "{} on {} ranks, step {}: FSDP differs from one process on the global batch "
                     "by {} (relative) in {}", text, n, step, d_local, key);
        worst_local = std::max(worst_local, d_local);
      }
    }
    // A negative control: the parameters moved, so equality above is not "nothing happened".
    WORKER_CHECK(sh::max_relative_difference(fsdp.state_dict(),
                                             gradsync::state_dict(*sh::make_mlp(c.widths, c.batch_norm, 0))) > 1e-3,
                 "{}: training did not change the parameters", text);
    if (r == 0) {
      fmt::print("N={} {:<48} units {:>2}  max rel diff vs local {:.2e}, vs ddp {:.2e}\n", n, text,
                 fsdp.units().size(), worst_local, worst_ddp);
    }
  }
  return 0;
}

struct EquivalenceCase {
  int world;
  std::vector<std::string> configs;
};

// ctest lists the parameter next to the test name: the world size and the configurations, not the struct's bytes.
void PrintTo(const EquivalenceCase& c, std::ostream* os) {
  *os << fmt::format("N={} {}", c.world, fmt::join(c.configs, " "));
}

class FsdpEquivalence : public testing::TestWithParam<EquivalenceCase> {};

TEST_P(FsdpEquivalence, MatchesLocalAndDdpAfterEveryStep) {
  const auto& c = GetParam();
  expect_all_ok(t::run_ranks(c.world, t::worker_argv("fsdp_equivalence", c.configs), options(120)), true);
}

// Layer sizes 6-13-7-3: 91, 98 and 24 parameters per Linear, so most flat parameters need padding at N = 2, 3, 4.
// BatchNorm cases (last field 1) use SGD: the bias of a Linear feeding BatchNorm has a gradient that is zero up to
// rounding, and Adam normalises that noise into a full-size step whose sign depends on the summation order.
INSTANTIATE_TEST_SUITE_P(
    Cases, FsdpEquivalence,
    testing::Values(
        EquivalenceCase{1, {"full/sgd/2/unsharded/children/6-13-7-3/0", "grad_op/adam/1/unsharded/children/6-13-7-3/0"}},
        EquivalenceCase{2,
                        {"full/sgd/1/unsharded/children/6-13-7-3/0", "full/adam/2/unsharded/children/6-13-7-3/0",
                         "full/sgd/3/sharded/children/6-13-7-3/0", "grad_op/adam/2/unsharded/children/6-13-7-3/0",
                         "no_shard/sgd/2/unsharded/children/6-13-7-3/0", "full/sgd/1/unsharded/list:0,4/6-13-7-3/0",
                         "full/adam/1/unsharded/params:100/6-13-7-3/0", "full/sgd/2/unsharded/children/6-13-7-3/1"}},
        EquivalenceCase{3,
                        {"full/adam/1/unsharded/children/6-13-7-3/0", "full/sgd/2/sharded/params:150/6-13-7-3/0",
                         "grad_op/sgd/2/unsharded/children/6-13-7-3/0", "no_shard/adam/1/unsharded/children/6-13-7-3/0",
                         "grad_op/sgd/1/unsharded/list:1,3/5-9-11-4/1", "full/sgd/3/sharded/children/5-9-11-4/1"}},
        EquivalenceCase{4,
                        {"full/sgd/2/unsharded/children/6-13-7-3/0", "full/adam/1/sharded/params:1/6-13-7-3/0",
                         "grad_op/adam/2/sharded/children/6-13-7-3/0", "no_shard/sgd/1/unsharded/children/6-13-7-3/0",
                         "full/sgd/1/unsharded/children/5-9-11-4/1"}}),
    [](const testing::TestParamInfo<EquivalenceCase>& info) { return fmt::format("N{}", info.param.world); });

// Rank r's loss is 2^r * sum(w) through a 5-element flat parameter (padded to 6 at N = 3): every gradient element
// is 2^r on rank r, so the mean is (2^N - 1)/N and the sum 2^N - 1, in every strategy, and padding stays zero.
GRADSYNC_WORKER(fsdp_sum_vs_mean) {
  auto world = sh::join();
  const int n = world->size();
  for (const char* strategy : {"full", "grad_op", "no_shard"}) {
    for (auto reduction : {gradsync::Reduction::Mean, gradsync::Reduction::Sum}) {
      auto model = nn::Linear(nn::LinearOptions(5, 1).bias(false));
      FsdpOptions o = per_layer();
      o.strategy(strategy_of(strategy));
      o.reduction(reduction);
      FullyShardedDataParallel fsdp(model, world, o);  // no children: everything is the root unit
      WORKER_CHECK(fsdp.units().size() == 1 && fsdp.units()[0].name == "(root)", "expected one root unit");
      auto x = torch::full({1, 5}, std::ldexp(1.0, world->rank()));
      fsdp.forward_with([&] { return model->forward(x); }).sum().backward();
      const double sum = std::ldexp(1.0, n) - 1;
      const double expected = reduction == gradsync::Reduction::Sum ? sum : sum / n;
      const auto& unit = fsdp.units()[0];
      const auto grad = fsdp.parameters()[0].grad();
      WORKER_CHECK(grad.defined() && grad.numel() == unit.shard_numel, "{}: shard gradient has {} elements", strategy,
                   grad.defined() ? grad.numel() : -1);
      const int64_t offset = o.strategy() == ShardingStrategy::NoShard ? 0 : world->rank() * unit.shard_numel;
      for (int64_t i = 0; i < grad.numel(); ++i) {
        const double want = offset + i < unit.numel ? expected : 0.0;  // padding
        WORKER_CHECK(std::abs(grad[i].item<double>() - want) < 1e-6, "{} {}: element {} is {}, expected {}",
                     strategy, gradsync::to_string(reduction), offset + i, grad[i].item<double>(), want);
      }
    }
  }
  fmt::print("sum and mean told apart on rank {}\n", world->rank());
  return 0;
}

TEST(Fsdp, MeanAndSumAreToldApartAndPaddingStaysZero) {
  expect_all_ok(t::run_ranks(3, t::worker_argv("fsdp_sum_vs_mean"), options()));
}

// Full state dict: gathered on rank 0 with the unwrapped keys, re-sharded on load into a model of another strategy
// and world position; a bad state dict fails on every rank.
GRADSYNC_WORKER(fsdp_full_state_dict) {
  auto world = sh::join();
  const int r = world->rank();
  const std::string widths = "6-13-7-3";
  auto model = sh::make_mlp(widths, true, 0);
  FsdpOptions o = per_layer();
  FullyShardedDataParallel fsdp(model, world, o);
  auto opt = sh::make_optimizer("sgd", fsdp.parameters());
  for (int64_t step = 0; step < 2; ++step) {
    auto [x, y] = sh::global_batch(step, 8, 6, 3);
    fsdp.zero_grad();
    F::cross_entropy(fsdp.forward(x), y).backward();
    opt->step();
  }
  auto saved = fsdp.state_dict(/*rank0_only=*/true);
  if (r == 0) {
    auto reference = gradsync::state_dict(*sh::make_mlp(widths, true, 0));
    WORKER_CHECK(saved.size() == reference.size(), "{} entries, expected {}", saved.size(), reference.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      WORKER_CHECK(saved[i].first == reference[i].first && saved[i].second.sizes().equals(reference[i].second.sizes()),
                   "entry {}: {} vs {}", i, saved[i].first, reference[i].first);
    }
    gradsync::save_state_dict(saved, args.at(0) + "/full.pt");
  } else {
    WORKER_CHECK(saved.empty(), "rank {} got a state dict", r);
  }
  // Re-shard into NO_SHARD / SHARD_GRAD_OP models with other initial values.
  for (auto strategy : {ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    auto other = sh::make_mlp(widths, true, 77);
    FsdpOptions o2 = per_layer();
    o2.strategy(strategy);
    o2.wrap(gradsync::WrapPolicy::at_least(100));
    FullyShardedDataParallel loaded(other, world, o2);
    loaded.load_state_dict(saved);
    auto back = loaded.state_dict();
    if (r == 0) {
      WORKER_CHECK(sh::max_relative_difference(back, saved) == 0, "{}: reloaded state differs",
                   gradsync::to_string(strategy));
    }
    // And both continue identically on the same data (fresh plain SGD on each).
    auto opt_a = sh::make_optimizer("plain", fsdp.parameters());
    auto opt_b = sh::make_optimizer("plain", loaded.parameters());
    auto [x, y] = sh::global_batch(5, 8, 6, 3);
    for (auto* pair : {&fsdp, &loaded}) {
      pair->zero_grad();
      F::cross_entropy(pair->forward(x), y).backward();
    }
    opt_a->step();
    opt_b->step();
    const double d = sh::max_relative_difference(fsdp.state_dict(), loaded.state_dict());
    WORKER_CHECK(d <= 1e-6, "{}: after one more step the re-sharded model differs by {}",
                 gradsync::to_string(strategy), d);
    // Put fsdp back for the next round: undo by reloading the saved state.
    fsdp.load_state_dict(saved);
  }
  // A state dict with a missing and an unexpected key fails on every rank (not only rank 0), naming them.
  StateDict bad;
  for (const auto& [k, v] : saved) {
    if (k != "0.bias") bad.emplace_back(k, v);
  }
  if (r == 0) bad.emplace_back("9.weight", torch::zeros({1}));
  try {
    fsdp.load_state_dict(bad);
    WORKER_CHECK(false, "a bad state dict was accepted");
  } catch (const gradsync::ConfigError& e) {
    const std::string what = e.what();
    WORKER_CHECK(what.find("missing keys: 0.bias") != std::string::npos, "message: {}", what);
    WORKER_CHECK(what.find("unexpected keys: 9.weight") != std::string::npos, "message: {}", what);
  }
  fmt::print("full state dict ok on rank {}\n", r);
  return 0;
}

TEST(Fsdp, FullStateDictRoundTripReshardsAndPythonReadsIt) {
  const auto dir = t::make_temp_dir("gradsync-fsdp");
  expect_all_ok(t::run_ranks(3, t::worker_argv("fsdp_full_state_dict", {dir}), options()));
  auto check = t::run({GRADSYNC_PYTHON, "-c",
                       "import torch, torch.nn as nn\n"
                       "m = nn.Sequential(nn.Linear(6,13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13,7), "
                       "nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7,3))\n"
                       "m.load_state_dict(torch.load('" + dir + "/full.pt'))\n"
                       "print('loaded', sum(p.numel() for p in m.parameters()))\n"},
                      options());
  ASSERT_TRUE(check.ok()) << check.describe();
  EXPECT_NE(check.out.find("loaded 253"), std::string::npos) << check.out;
}

// Sharded checkpoint: parameters and Adam state of every shard; training resumed from it is bit-identical to
// training that never stopped.
GRADSYNC_WORKER(fsdp_sharded_checkpoint) {
  auto world = sh::join();
  const std::string dir = args.at(0);
  const std::string widths = "6-13-7-3";
  auto train = [&](FullyShardedDataParallel& fsdp, torch::optim::Optimizer& opt, int64_t from, int64_t to) {
    for (int64_t step = from; step < to; ++step) {
      auto [x, y] = sh::global_batch(step, 6, 6, 3);
      auto mine = x.narrow(0, world->rank() * 2, 2);
      fsdp.zero_grad();
      F::cross_entropy(fsdp.forward(mine), y.narrow(0, world->rank() * 2, 2)).backward();
      opt.step();
    }
  };
  auto model = sh::make_mlp(widths, false, 0);
  FullyShardedDataParallel fsdp(model, world, per_layer());
  auto opt = sh::make_optimizer("adam", fsdp.parameters());
  train(fsdp, *opt, 0, 2);
  fsdp.save_sharded(dir, opt.get());
  train(fsdp, *opt, 2, 4);
  auto uninterrupted = fsdp.state_dict();

  auto model2 = sh::make_mlp(widths, false, 5);
  FullyShardedDataParallel resumed(model2, world, per_layer());
  auto opt2 = sh::make_optimizer("adam", resumed.parameters());
  resumed.load_sharded(dir, opt2.get());
  train(resumed, *opt2, 2, 4);
  const double d = sh::max_relative_difference(resumed.state_dict(), uninterrupted);
  WORKER_CHECK(d == 0, "resumed training differs by {}", d);
  // Without the optimizer state the resumed run must differ (Adam's moments matter): the test can fail.
  auto model3 = sh::make_mlp(widths, false, 5);
  FullyShardedDataParallel no_state(model3, world, per_layer());
  auto opt3 = sh::make_optimizer("adam", no_state.parameters());
  no_state.load_sharded(dir, nullptr);
  train(no_state, *opt3, 2, 4);
  WORKER_CHECK(sh::max_relative_difference(no_state.state_dict(), uninterrupted) > 1e-4,
               "optimizer state made no difference");
  // A checkpoint loads only with the world size it was written with: a clear error on every rank.
  FsdpOptions no_shard = per_layer();
  no_shard.strategy(ShardingStrategy::NoShard);
  auto model4 = sh::make_mlp(widths, false, 5);
  FullyShardedDataParallel other_layout(model4, world, no_shard);
  try {
    other_layout.load_sharded(dir, nullptr);
    WORKER_CHECK(false, "a checkpoint of another layout was accepted");
  } catch (const gradsync::ConfigError& e) {
    WORKER_CHECK(std::string(e.what()).find("was saved with") != std::string::npos, "message: {}", e.what());
  }
  fmt::print("sharded checkpoint ok on rank {}\n", world->rank());
  return 0;
}

TEST(Fsdp, ShardedCheckpointResumesBitIdenticallyAndPythonReadsIt) {
  const auto dir = t::make_temp_dir("gradsync-fsdp") + "/ckpt";
  expect_all_ok(t::run_ranks(3, t::worker_argv("fsdp_sharded_checkpoint", {dir}), options()));
  auto check = t::run({GRADSYNC_PYTHON, "-c",
                       "import torch\n"
                       "s = torch.load('" + gradsync::shard_file(dir, 1, 3) + "')\n"
                       "u = s['units']['0']\n"
                       "print(s['format'], s['world_size'], u['padded_numel'], tuple(u['shard'].shape), "
                       "sorted(u['optimizer']))\n"},
                      options());
  ASSERT_TRUE(check.ok()) << check.describe();
  EXPECT_NE(check.out.find("gradsync-sharded/1 3 93 (31,) ['exp_avg', 'exp_avg_sq', 'step']"), std::string::npos)
      << check.out;
}

// clip_grad_norm from the shards equals torch::nn::utils::clip_grad_norm_ on the unsharded gradient (one process on
// the global batch), for the 2-norm and the infinity norm, and the clipped step lands on the same parameters.
GRADSYNC_WORKER(fsdp_clip) {
  auto world = sh::join();
  const int n = world->size();
  const int r = world->rank();
  for (const char* strategy : {"full", "no_shard", "hybrid"}) {
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      auto local = sh::make_mlp("6-13-7-3", false, 0);
      auto model = sh::make_mlp("6-13-7-3", false, 0);
      FsdpOptions o = per_layer();
      o.strategy(strategy_of(strategy));
      // Hybrid: 2 replicas of 2 ranks; a norm summed over the world would count each shard twice.
      if (std::string(strategy) == "hybrid") o.replicas(2);
      FullyShardedDataParallel fsdp(model, world, o);
      auto local_opt = sh::make_optimizer("plain", local->parameters());
      auto opt = sh::make_optimizer("plain", fsdp.parameters());
      for (int64_t step = 0; step < 3; ++step) {
        auto [x, y] = sh::global_batch(step, 4 * n, 6, 3);
        local_opt->zero_grad();
        F::cross_entropy(local->forward(x), y).backward();
        const double expected = torch::nn::utils::clip_grad_norm_(local->parameters(), 0.02, norm_type);
        local_opt->step();
        fsdp.zero_grad();
        F::cross_entropy(fsdp.forward(x.narrow(0, 4 * r, 4)), y.narrow(0, 4 * r, 4)).backward();
        const double total = fsdp.clip_grad_norm(0.02, norm_type);
        opt->step();
        WORKER_CHECK(std::abs(total - expected) <= 1e-5 * expected, "{} norm {}: step {}: {} vs unsharded {}",
                     strategy, norm_type, step, total, expected);
        WORKER_CHECK(expected > 0.02, "the norm {} must exceed max_norm for the test to clip", expected);
        const double d = sh::max_relative_difference(fsdp.state_dict(), gradsync::state_dict(*local));
        WORKER_CHECK(d <= 1e-5, "{}: clipped step differs by {}", strategy, d);
      }
    }
  }
  fmt::print("clip ok on rank {}\n", r);
  return 0;
}

TEST(Fsdp, ClipGradNormEqualsTheUnshardedOne) {
  expect_all_ok(t::run_ranks(4, t::worker_argv("fsdp_clip"), options()));
}

// Memory at N = 4 with Adam on a model of several equal layers: FULL_SHARD's measured peak of parameter, gradient
// and optimizer bytes per rank is at most DDP's / N plus two of the largest unit (gathered parameters and unsharded
// gradient; one unit computing, one prefetched or reducing). args: layers.
GRADSYNC_WORKER(fsdp_memory) {
  auto world = sh::join();
  const int n = world->size();
  const int layers = std::stoi(args.at(0));
  std::string widths = "64";
  for (int i = 0; i < layers; ++i) widths += "-64";
  auto run_steps = [&](auto&& forward_backward, auto&& step) {
    for (int64_t s = 0; s < 3; ++s) {
      auto [x, y] = sh::global_batch(s, 8, 64, 64);
      forward_backward(x, y);
      step();
    }
  };
  // DDP: parameters, .grad and Adam state, measured the same way after every step (their peak).
  auto ddp_model = sh::make_mlp(widths, false, 0);
  gradsync::DistributedDataParallel ddp(ddp_model, world);
  auto ddp_opt = sh::make_optimizer("adam", ddp_model->parameters());
  gradsync::MemoryMeter ddp_meter;
  run_steps([&](auto& x, auto& y) { ddp.zero_grad(); F::cross_entropy(ddp.forward(x), y).backward(); },
            [&] {
              ddp_opt->step();
              ddp_meter.sample(gradsync::module_memory(*ddp_model, ddp_opt.get()));
            });
  const int64_t ddp_peak = ddp_meter.stats().peak_total();
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    auto model = sh::make_mlp(widths, false, 0);
    FsdpOptions o = per_layer();
    o.strategy(strategy);
    FullyShardedDataParallel fsdp(model, world, o);
    auto opt = sh::make_optimizer("adam", fsdp.parameters());
    fsdp.track_optimizer(opt.get());
    run_steps([&](auto& x, auto& y) { fsdp.zero_grad(); F::cross_entropy(fsdp.forward(x), y).backward(); },
              [&] { opt->step(); });
    const auto stats = fsdp.memory();
    const double ratio = static_cast<double>(stats.peak_total()) / static_cast<double>(ddp_peak);
    if (world->rank() == 0) {
      fmt::print("N={} {} layers {:<14} {}  ddp peak {}  ratio {:.3f}  (1/N + two largest units {:.3f})\n", n, layers,
                 gradsync::to_string(strategy), stats.to_string(), gradsync::format_bytes(ddp_peak), ratio,
                 1.0 / n + 2.0 * static_cast<double>(fsdp.largest_unit_bytes()) / static_cast<double>(ddp_peak));
    }
    if (strategy == ShardingStrategy::FullShard) {
      // Two units besides the shards: the one computing and the one whose all-gather is prefetched (or whose
      // reduce-scatter is still in flight), as PyTorch's limit_all_gathers allows.
      const int64_t bound = ddp_peak / n + 2 * fsdp.largest_unit_bytes();
      WORKER_CHECK(stats.peak_total() <= bound,
                   "FULL_SHARD peak {} bytes exceeds DDP's {} / {} + two largest units 2 x {} = {}",
                   stats.peak_total(), ddp_peak, n, fsdp.largest_unit_bytes(), bound);
      WORKER_CHECK(stats.at_peak.optimizer * n <= ddp_meter.stats().at_peak.optimizer + 64 * n,
                   "optimizer state {} is not 1/{} of DDP's {}", stats.at_peak.optimizer, n,
                   ddp_meter.stats().at_peak.optimizer);
    }
    if (strategy == ShardingStrategy::NoShard) {
      // Nothing sharded: the same parameters + gradients + state as DDP (whose .grad are separate tensors too).
      WORKER_CHECK(std::abs(ratio - 1.0) < 0.05, "NO_SHARD should hold what DDP holds; ratio {}", ratio);
    }
  }
  return 0;
}

TEST(Fsdp, FullShardPeakMemoryIsAQuarterOfDdpPlusTwoUnitsAtFourRanks) {
  auto results = t::run_ranks(4, t::worker_argv("fsdp_memory", {"8"}), options());
  expect_all_ok(results, true);
}

// The unit a forward ran last stays gathered for the backward that starts with it, and the root unit is gathered for
// the whole step. A forward whose backward never comes must leave neither stale: parameters changed before the next
// forward (here halved in place) are the ones used. Units: one (the default here: kept and then run first), a unit
// and the root, a unit per layer.
GRADSYNC_WORKER(fsdp_forward_without_backward) {
  auto world = sh::join();
  for (const auto& wrap : {FsdpOptions().wrap(), gradsync::WrapPolicy::list({"2"}), gradsync::WrapPolicy::children()}) {
    auto model = sh::make_mlp("6-13-7-3", false, 0);
    auto local = sh::make_mlp("6-13-7-3", false, 0);
    FullyShardedDataParallel fsdp(model, world, FsdpOptions().wrap(wrap));
    auto [x, y] = sh::global_batch(0, 4, 6, 3);
    fsdp.forward(x);  // with grad, and no backward
    {
      torch::NoGradGuard no_grad;
      for (auto& p : fsdp.parameters()) p.mul_(0.5);  // this rank's shards
      for (auto& p : local->parameters()) p.mul_(0.5);
    }
    const auto got = fsdp.forward(x);
    F::cross_entropy(got, y).backward();
    const double d = (got - local->forward(x)).abs().max().item<double>();
    WORKER_CHECK(d < 1e-6, "wrap {}: the second forward differs from the halved model by {}", wrap.to_string(), d);
  }
  return 0;
}

TEST(Fsdp, AForwardWithoutBackwardLeavesNoStaleParametersGathered) {
  expect_all_ok(t::run_ranks(2, t::worker_argv("fsdp_forward_without_backward"), options()));
}

// Bytes each rank really sent in one step (the kernel's count of bytes written, Gloo's TCP included) against the
// ZeRO paper's volumes: 2 Psi for DDP, SHARD_GRAD_OP, NO_SHARD; 3 Psi for FULL_SHARD (times (N-1)/N for ring
// algorithms), less the last unit's parameters, which stay gathered from forward into backward (Note [The last
// unit stays gathered]). Psi = parameter bytes.
GRADSYNC_WORKER(fsdp_traffic) {
  auto world = sh::join();
  const int n = world->size();
  const std::string widths = "64-64-64-64-64-64-64-64-64";
  int64_t numel = 0, last_layer = 0;  // the last Linear (weight and bias) is the forward's last unit
  const auto params = sh::make_mlp(widths, false, 0)->parameters();
  for (const auto& p : params) numel += p.numel();
  for (size_t i = params.size() - 2; i < params.size(); ++i) last_layer += params[i].numel();
  const double model_bytes = static_cast<double>(numel * 4);
  const double kept = static_cast<double>(last_layer) / static_cast<double>(numel);
  const double unit = model_bytes * (n - 1) / n;  // what one ring all-gather of the model sends per rank
  auto measure = [&](auto&& step) {
    auto [x, y] = sh::global_batch(0, 8, 64, 64);
    step(x, y);  // warm-up: first-step order checks, DDP's bucket rebuild
    world->comm().barrier();
    const int64_t before = gradsync::process_bytes_written();
    step(x, y);
    const int64_t after = gradsync::process_bytes_written();
    world->comm().barrier();
    return static_cast<double>(after - before) / unit;
  };
  auto ddp_model = sh::make_mlp(widths, false, 0);
  gradsync::DistributedDataParallel ddp(ddp_model, world);
  const double ddp_psi = measure([&](auto& x, auto& y) {
    ddp.zero_grad();
    F::cross_entropy(ddp.forward(x), y).backward();
  });
  std::vector<std::pair<std::string, double>> rows{{"ddp", ddp_psi}};
  for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    auto model = sh::make_mlp(widths, false, 0);
    FsdpOptions o = per_layer();
    o.strategy(strategy);
    FullyShardedDataParallel fsdp(model, world, o);
    const double psi = measure([&](auto& x, auto& y) {
      fsdp.zero_grad();
      F::cross_entropy(fsdp.forward(x), y).backward();
    });
    rows.emplace_back(gradsync::to_string(strategy), psi);
  }
  {  // Hybrid, R = 2 replicas of S = 2: full_shard's collectives over S (each (S-1)/S of what it gathers or
     // scatters), then every shard all-reduced with its replica: 2 (Psi/S)(R-1)/R, as CommStats counts exactly.
    auto model = sh::make_mlp(widths, false, 0);
    FsdpOptions o = per_layer();
    o.strategy(ShardingStrategy::HybridShard).replicas(2);
    FullyShardedDataParallel fsdp(model, world, o);
    const double psi = measure([&](auto& x, auto& y) {
      fsdp.zero_grad();
      F::cross_entropy(fsdp.forward(x), y).backward();
    });
    rows.emplace_back("hybrid_shard", psi);
    int64_t shard_bytes = 0;
    for (const auto& u : fsdp.units()) shard_bytes += u.shard_numel * 4;
    const int64_t across = fsdp.traffic().across_replicas / 2;  // the warm-up step and the measured one
    WORKER_CHECK(across == shard_bytes, "across replicas {} bytes per step, expected 2 (Psi/S)(R-1)/R = {}", across,
                 shard_bytes);
  }
  const double s = 2, r = static_cast<double>(n) / s;  // the hybrid row's mesh
  const std::map<std::string, double> expected{
      {"ddp", 2}, {"full_shard", 3 - kept}, {"shard_grad_op", 2}, {"no_shard", 2},
      {"hybrid_shard", ((3 - kept) * (s - 1) / s + 2 / s * (r - 1) / r) * n / (n - 1)}};
  std::map<std::string, double> sent;
  for (const auto& [name, psi] : rows) {
    if (world->rank() == 0) fmt::print("N={} {:<14} sent {:.3f} x (N-1)/N Psi per step (paper: {})\n", n, name, psi,
                                       expected.at(name));
    WORKER_CHECK(std::abs(psi - expected.at(name)) < 0.1 * expected.at(name), "{}: {} x Psi(N-1)/N, expected {}",
                 name, psi, expected.at(name));
    sent[name] = psi;
  }
  // Messages of the same sizes carry the same headers: against SHARD_GRAD_OP, FULL_SHARD's extra gathers show
  // within 1 %, so the unit kept gathered into backward (kept = 1/8 of Psi here) is seen to save its gather.
  const double full_over_grad_op = sent.at("full_shard") / sent.at("shard_grad_op");
  WORKER_CHECK(std::abs(full_over_grad_op / ((3 - kept) / 2) - 1) < 0.01,
               "full_shard / shard_grad_op sent {:.4f}, expected (3 - {:.4f}) / 2 = {:.4f}", full_over_grad_op, kept,
               (3 - kept) / 2);
  return 0;
}

TEST(Fsdp, BytesSentPerStepMatchTheZeroPaperVolumes) {
  expect_all_ok(t::run_ranks(4, t::worker_argv("fsdp_traffic"), options()), true);
}

// Mixed precision: bfloat16 compute (gathered parameters and unsharded gradients in bf16), float32 master shards;
// reduction in fp32, bf16 (via fp32 on Gloo) or fp16; the result stays within bf16 rounding of fp32 training.
GRADSYNC_WORKER(fsdp_mixed_precision) {
  auto world = sh::join();
  const int r = world->rank();
  const std::string widths = "6-16-16-3";
  auto train = [&](FsdpOptions o, bool check_dtypes) {
    auto model = sh::make_mlp(widths, false, 0);
    FullyShardedDataParallel fsdp(model, world, o);
    auto opt = sh::make_optimizer("plain", fsdp.parameters());
    for (int64_t step = 0; step < 5; ++step) {
      auto [x, y] = sh::global_batch(step, 16, 6, 3);
      fsdp.zero_grad();
      auto out = fsdp.forward(x.narrow(0, 8 * r, 8));
      if (check_dtypes) {
        WORKER_CHECK(out.scalar_type() == *o.mixed_precision().param_dtype, "output is {}",
                     c10::toString(out.scalar_type()));
        for (const auto& shard : fsdp.parameters()) {
          WORKER_CHECK(shard.scalar_type() == torch::kFloat, "master shard is {}", c10::toString(shard.scalar_type()));
        }
      }
      F::cross_entropy(out.to(torch::kFloat), y.narrow(0, 8 * r, 8)).backward();
      for (const auto& shard : fsdp.parameters()) {
        WORKER_CHECK(shard.grad().scalar_type() == torch::kFloat, "shard gradient is not fp32");
      }
      opt->step();
    }
    return fsdp.state_dict();
  };
  auto reference = train({}, false);
  for (const char* reduce : {"fp32", "bf16", "fp16"}) {
    for (auto strategy : {ShardingStrategy::FullShard, ShardingStrategy::NoShard, ShardingStrategy::HybridShard}) {
      FsdpOptions o = per_layer();
      o.strategy(strategy);
      if (strategy == ShardingStrategy::HybridShard) o.replicas(2);  // 2 ranks: each a replica, the shard all-reduced
      o.mixed_precision().param_dtype = torch::kBFloat16;
      o.mixed_precision().reduce_dtype = gradsync::parse_dtype(reduce);
      auto state = train(o, true);
      for (const auto& [k, v] : state) WORKER_CHECK(v.scalar_type() == torch::kFloat, "{} saved as non-fp32", k);
      const double d = sh::max_relative_difference(state, reference);
      if (r == 0) fmt::print("param bf16, reduce {} {}: max rel diff from fp32 {:.2e}\n", reduce,
                             gradsync::to_string(strategy), d);
      // 5 SGD steps in bf16 (8 significant bits, relative rounding 2^-8 = 3.9e-3): within a few roundings.
      WORKER_CHECK(d < 3e-2 && d > 0, "bf16 compute differs from fp32 by {}", d);
    }
  }
  return 0;
}

TEST(Fsdp, Bfloat16ComputeWithFloat32MasterAndAnyReduceDtype) {
  expect_all_ok(t::run_ranks(2, t::worker_argv("fsdp_mixed_precision"), options()), true);
}

// Units in different orders on different ranks: a clear error on every rank in the first step, not a hang.
struct TwoBlocksImpl : nn::Module {
  TwoBlocksImpl() {
    torch::manual_seed(1);
    a = register_module("a", nn::Linear(4, 4));
    b = register_module("b", nn::Linear(4, 4));
  }
  nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoBlocks);

GRADSYNC_WORKER(fsdp_order) {
  auto world = sh::join();
  TwoBlocks model;
  FullyShardedDataParallel fsdp(model, world, per_layer());
  const bool swapped = world->rank() == 1;
  auto x = torch::randn({2, 4});
  auto out = fsdp.forward_with([&] {
    auto h = x;
    for (const char* name : swapped ? std::vector<const char*>{"b", "a"} : std::vector<const char*>{"a", "b"}) {
      auto& layer = std::string(name) == "a" ? model->a : model->b;
      h = fsdp.unit(name, [&] { return layer->forward(h); });
    }
    return h;
  });
  out.sum().backward();
  return 0;
}

TEST(Fsdp, UnitsInDifferentOrdersFailOnTheFirstStepNamingRanks) {
  auto results = t::run_ranks(2, t::worker_argv("fsdp_order"), options(60));
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.timed_out) << r.describe();
    EXPECT_LT(r.seconds, 30);
    EXPECT_NE(r.err.find("different orders"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("rank 0: forward all-gather of unit 0 ('a'"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("rank 1: forward all-gather of unit 1 ('b'"), std::string::npos) << r.describe();
  }
}

// ---- in-process: wrap policies and misuse --------------------------------------------------------------------

TEST(WrapPolicy, ParsesTheCliSpellingsAndRejectsOthers) {
  EXPECT_EQ(gradsync::parse_wrap_policy("children").kind, gradsync::WrapPolicy::Kind::Children);
  auto p = gradsync::parse_wrap_policy("params:1000");
  EXPECT_EQ(p.kind, gradsync::WrapPolicy::Kind::MinParams);
  EXPECT_EQ(p.min_params, 1000);
  auto l = gradsync::parse_wrap_policy("list:0,2");
  EXPECT_EQ(l.names, (std::vector<std::string>{"0", "2"}));
  EXPECT_EQ(l.to_string(), "list:0,2");
  for (const char* bad : {"params:0", "params:x", "list:", "list:0,,2", "layers"}) {
    EXPECT_THROW(gradsync::parse_wrap_policy(bad), gradsync::ConfigError) << bad;
  }
}

// The default units hold at least 25 MiB of float32 parameters (DDP's bucket size): eight 1024x1024 layers make
// one unit of seven (7.3 M parameters) and one of the last, a small model one unit.
TEST(WrapPolicy, TheDefaultGroupsLayersIntoUnitsOfDdpsBucketSize) {
  EXPECT_EQ(FsdpOptions().wrap().to_string(), "params:6553600");
  EXPECT_EQ(gradsync::kDefaultUnitParams * 4, 25 << 20);
  nn::Sequential layers;
  for (int i = 0; i < 8; ++i) layers->push_back(nn::Linear(1024, 1024));  // 1,049,600 parameters each
  std::vector<std::string> names;
  for (const auto& u : gradsync::plan_units(*layers, FsdpOptions().wrap())) {
    names.push_back(u.name + ":" + std::to_string(u.numel()));
  }
  EXPECT_EQ(names, (std::vector<std::string>{"0..6:7347200", "7:1049600"}));
  const auto small = gradsync::plan_units(*sh::make_mlp("6-13-7-3", true, 0), FsdpOptions().wrap());
  ASSERT_EQ(small.size(), 1u);
  EXPECT_EQ(small[0].name, "0..6");
  // Without a Sequential the direct children have no slot: forward_with() runs them by name, one unit each.
  TwoBlocks blocks;
  names.clear();
  for (const auto& u : gradsync::plan_units(*blocks, FsdpOptions().wrap())) names.push_back(u.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
}

TEST(WrapPolicy, PlansUnitsAsChildRangesWithTheRestInTheRoot) {
  auto model = sh::make_mlp("6-13-7-3", true, 0);  // 0 Linear 1 BN 2 ReLU 3 Linear 4 BN 5 ReLU 6 Linear
  auto children = gradsync::plan_units(*model, gradsync::WrapPolicy::children());
  std::vector<std::string> names;
  for (const auto& u : children) names.push_back(u.name);
  EXPECT_EQ(names, (std::vector<std::string>{"0", "1", "3", "4", "6"}));
  auto grouped = gradsync::plan_units(*model, gradsync::WrapPolicy::at_least(100));
  names.clear();
  for (const auto& u : grouped) names.push_back(u.name + ":" + std::to_string(u.numel()));
  // 91+26 = 117 >= 100 closes "0..1"; 98+14 = 112 closes "3..4"; the rest (24) is a unit too.
  EXPECT_EQ(names, (std::vector<std::string>{"0..1:117", "3..4:112", "6:24"}));
  auto listed = gradsync::plan_units(*model, gradsync::WrapPolicy::list({"3", "0"}));
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0].name, "0");
  EXPECT_EQ(listed[1].name, "3");
  EXPECT_TRUE(listed[2].is_root);
  EXPECT_EQ(listed[2].param_names, (std::vector<std::string>{"1.weight", "1.bias", "4.weight", "4.bias", "6.weight",
                                                             "6.bias"}));
  EXPECT_THROW(gradsync::plan_units(*model, gradsync::WrapPolicy::list({"2"})), gradsync::ConfigError);  // ReLU
  EXPECT_THROW(gradsync::plan_units(*model, gradsync::WrapPolicy::list({"9"})), gradsync::ConfigError);
}

TEST(FsdpLocal, WorldOfOneTrainsLikeLocalAndNonSequentialForwardIsRejected) {
  auto world = gradsync::init({std::chrono::seconds(10), gradsync::LaunchEnv{}, std::nullopt});
  TwoBlocks blocks;
  FullyShardedDataParallel fsdp(blocks, world, per_layer());
  EXPECT_THROW(fsdp.forward(torch::randn({2, 4})), gradsync::ConfigError);
  EXPECT_THROW(fsdp.unit("a", [] { return torch::Tensor(); }), gradsync::Error);  // outside forward_with
  EXPECT_THROW(fsdp.forward_with([&] { return fsdp.unit("c", [] { return torch::Tensor(); }); }),
               gradsync::ConfigError);
}
