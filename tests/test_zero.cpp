// ZeRO stage 1 tests: on every rank, a Zero1DataParallel model must equal a local replica on the whole global batch
// and a gradsync DDP model after every step (SGD with momentum and weight decay, Adam; K micro-batches; N = 1..4,
// flat sizes that do not divide by N), hold 1/N of DDP's optimizer state, resume bit-identically from a sharded
// checkpoint, and clip like clip_grad_norm_ on unsharded gradients.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "gradsync/engine.h"
#include "gradsync/ddp.h"
#include "gradsync/zero.h"
#include "support/test_models.h"
#include "support/subprocess.h"
#include "support/worker.h"

using gradsync::Zero1DataParallel;
namespace t = gradsync::test;
namespace sh = gradsync::test::sharding;
namespace F = torch::nn::functional;

namespace {

t::CommandOptions options() {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(90);
  return o;
}

}  // namespace

// args: configs "optimizer/K/widths/batchnorm"
GRADSYNC_WORKER(zero1_equivalence) {
  auto world = sh::join();
  const int n = world->size();
  const int r = world->rank();
  for (const auto& text : args) {
    std::vector<std::string> f;
    std::stringstream in(text);
    for (std::string part; std::getline(in, part, '/');) f.push_back(part);
    const std::string optimizer = f.at(0), widths = f.at(2);
    const int64_t k = std::stoll(f.at(1));
    const bool bn = f.at(3) == "1";
    auto local = sh::make_mlp(widths, bn, 0);
    auto ddp_model = sh::make_mlp(widths, bn, r == 0 ? 0 : 100 + r);
    auto zero_model = sh::make_mlp(widths, bn, r == 0 ? 0 : 300 + r);
    gradsync::DistributedDataParallel ddp(ddp_model, world);
    Zero1DataParallel zero(zero_model, world);
    auto local_opt = sh::make_optimizer(optimizer, local->parameters());
    auto ddp_opt = sh::make_optimizer(optimizer, ddp_model->parameters());
    auto zero_opt = sh::make_optimizer(optimizer, zero.parameters());
    zero.track_optimizer(zero_opt.get());
    const int64_t b = 4;
    double worst = 0;
    for (int64_t step = 0; step < 4; ++step) {
      auto [x, y] = sh::global_batch(step, b * k * n, sh::input_width(widths), sh::output_width(widths));
      auto rx = x.narrow(0, r * b * k, b * k);
      auto ry = y.narrow(0, r * b * k, b * k);
      if (!bn) {
        local_opt->zero_grad();
        F::cross_entropy(local->forward(x), y).backward();
        local_opt->step();
      }
      ddp.zero_grad();
      gradsync::accumulate(ddp, k, [&](int64_t m) {
        return F::cross_entropy(ddp.forward(rx.narrow(0, m * b, b)), ry.narrow(0, m * b, b));
      });
      ddp_opt->step();
      zero.zero_grad();
      gradsync::accumulate(zero, k, [&](int64_t m) {
        return F::cross_entropy(zero.forward(rx.narrow(0, m * b, b)), ry.narrow(0, m * b, b));
      });
      zero_opt->step();
      zero.sync_parameters();  // the all-gather otherwise waits for the next forward
      // Parameters are whole on every rank: compare them directly (buffers are per rank, as in DDP).
      auto mine = gradsync::state_dict(*zero_model);
      auto theirs = gradsync::state_dict(*ddp_model);
      const double d_ddp = sh::max_relative_difference(mine, theirs);
      WORKER_CHECK(d_ddp <= 1e-5, "{} on {} ranks, step {}: ZeRO-1 differs from DDP by {}", text, n, step, d_ddp);
      worst = std::max(worst, d_ddp);
      if (!bn) {
        const double d_local = sh::max_relative_difference(mine, gradsync::state_dict(*local));
        WORKER_CHECK(d_local <= 1e-5, "{} on {} ranks, step {}: ZeRO-1 differs from one process by {}", text, n, step,
                     d_local);
        worst = std::max(worst, d_local);
      }
    }
    // Optimizer state: 1/N of DDP's (up to the padding of the flat parameter).
    const int64_t ddp_state = gradsync::optimizer_state_bytes(*ddp_opt);
    const int64_t zero_state = zero.memory().current.optimizer;
    if (optimizer != "plain") {
      WORKER_CHECK(zero_state * n <= ddp_state + 4 * 2 * n * n && zero_state * n >= ddp_state,
                   "optimizer state {} bytes on rank {}, DDP's {} / {}", zero_state, r, ddp_state, n);
    }
    if (r == 0) {
      fmt::print("N={} zero1 {:<22} max rel diff {:.2e}; optimizer state {} per rank vs DDP {}; {}\n", n, text, worst,
                 gradsync::format_bytes(zero_state), gradsync::format_bytes(ddp_state), zero.memory().to_string());
    }
  }
  return 0;
}

struct ZeroCase {
  int world;
  std::vector<std::string> configs;
};

// ctest lists the parameter next to the test name: the world size and the configurations, not the struct's bytes.
void PrintTo(const ZeroCase& c, std::ostream* os) { *os << fmt::format("N={} {}", c.world, fmt::join(c.configs, " ")); }

class Zero1Equivalence : public testing::TestWithParam<ZeroCase> {};

TEST_P(Zero1Equivalence, MatchesLocalAndDdpAfterEveryStep) {
  auto results = t::run_ranks(GetParam().world, t::worker_argv("zero1_equivalence", GetParam().configs), options());
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
  std::cout << results[0].out;
}

// BatchNorm cases use SGD: the bias of a Linear feeding BatchNorm has a gradient that is zero up to rounding, and
// Adam normalises that rounding noise into a full-size step whose sign depends on the summation order.
INSTANTIATE_TEST_SUITE_P(
    Cases, Zero1Equivalence,
    testing::Values(ZeroCase{1, {"adam/2/6-13-7-3/0"}},
                    ZeroCase{2, {"sgd/1/6-13-7-3/0", "adam/3/6-13-7-3/0", "sgd/2/6-13-7-3/1"}},
                    ZeroCase{3, {"adam/1/6-13-7-3/0", "sgd/2/5-9-11-4/0", "sgd/2/6-13-7-3/1"}},
                    ZeroCase{4, {"adam/2/6-13-7-3/0", "sgd/1/5-9-11-4/1"}}),
    [](const testing::TestParamInfo<ZeroCase>& info) { return fmt::format("N{}", info.param.world); });

// Sharded checkpoint (the slice and its Adam state) resumes bit-identically; the full state dict re-loads; the
// clipped norm equals the unsharded one.
GRADSYNC_WORKER(zero1_state) {
  auto world = sh::join();
  const int r = world->rank();
  const int n = world->size();
  const std::string dir = args.at(0);
  const std::string widths = "6-13-7-3";
  auto train = [&](Zero1DataParallel& zero, torch::optim::Optimizer& opt, int64_t from,
                   int64_t to, double clip, torch::nn::Sequential* local, torch::optim::Optimizer* local_opt) {
    for (int64_t step = from; step < to; ++step) {
      auto [x, y] = sh::global_batch(step, 4 * n, 6, 3);
      zero.zero_grad();
      F::cross_entropy(zero.forward(x.narrow(0, 4 * r, 4)), y.narrow(0, 4 * r, 4)).backward();
      if (clip > 0) {
        const double total = zero.clip_grad_norm(clip);
        if (local) {
          local_opt->zero_grad();
          F::cross_entropy((*local)->forward(x), y).backward();
          const double expected = torch::nn::utils::clip_grad_norm_((*local)->parameters(), clip);
          local_opt->step();
          WORKER_CHECK(std::abs(total - expected) <= 1e-5 * expected && expected > clip,
                       "clip: total norm {} vs unsharded {}", total, expected);
        }
      }
      opt.step();
      zero.sync_parameters();  // the all-gather otherwise waits for the next forward
    }
  };
  auto model = sh::make_mlp(widths, false, 0);
  Zero1DataParallel zero(model, world);
  auto opt = sh::make_optimizer("adam", zero.parameters());
  train(zero, *opt, 0, 2, 0, nullptr, nullptr);
  zero.save_sharded(dir, opt.get());
  train(zero, *opt, 2, 4, 0, nullptr, nullptr);
  auto uninterrupted = gradsync::state_dict(*model);
  auto model2 = sh::make_mlp(widths, false, 9);
  Zero1DataParallel resumed(model2, world);
  auto opt2 = sh::make_optimizer("adam", resumed.parameters());
  resumed.load_sharded(dir, opt2.get());
  train(resumed, *opt2, 2, 4, 0, nullptr, nullptr);
  WORKER_CHECK(sh::max_relative_difference(gradsync::state_dict(*model2), uninterrupted) == 0,
               "resumed ZeRO-1 training differs");
  // Full state dict from rank 0 into a fresh model.
  auto full = resumed.state_dict(/*rank0_only=*/true);
  auto model3 = sh::make_mlp(widths, false, 11);
  Zero1DataParallel reloaded(model3, world);
  reloaded.load_state_dict(full);
  WORKER_CHECK(sh::max_relative_difference(gradsync::state_dict(*model3), uninterrupted) == 0,
               "full state dict did not round-trip");
  // clip_grad_norm against one process with plain SGD.
  auto local = sh::make_mlp(widths, false, 0);
  auto model4 = sh::make_mlp(widths, false, 0);
  Zero1DataParallel clipped(model4, world);
  auto opt4 = sh::make_optimizer("plain", clipped.parameters());
  auto local_opt = sh::make_optimizer("plain", local->parameters());
  train(clipped, *opt4, 0, 3, 0.05, &local, local_opt.get());
  WORKER_CHECK(sh::max_relative_difference(gradsync::state_dict(*model4), gradsync::state_dict(*local)) <= 1e-5,
               "clipped ZeRO-1 differs from clipped local training");
  fmt::print("zero1 state ok on rank {}\n", r);
  return 0;
}

TEST(Zero1, ShardedCheckpointFullStateDictAndClipping) {
  const auto dir = t::make_temp_dir("gradsync-zero") + "/ckpt";
  auto results = t::run_ranks(3, t::worker_argv("zero1_state", {dir}), options());
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.describe();
}
