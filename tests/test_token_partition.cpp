// Token semantics in float64 on the gpt model, every engine, N = 1..4 ranks, K = 1..3 micro-batches: sequences of
// ragged valid-token counts (micro-batches with 0 and 1 valid tokens, a rank without data in a step) assigned at random
// to (rank, micro-batch).
//  - Reduction::GlobalMean's gradient equals one process's gradient of sum(l)/T on the step's sequences (1e-12);
//  - the control, Mean over per-micro-batch token means, equals what its weights predict (each micro-batch's own
//    token-mean gradient times 1/(N*K_r), computed in one process) to 1e-9, and that prediction is off the global
//    mean: a test that fails by a predicted amount;
//  - five Adam steps with gradient clipping: loss, gradient norm and parameters as one process's.
#include <gtest/gtest.h>

#include "data/gpt_model.h"
#include "gradsync/ddp.h"
#include "gradsync/fsdp.h"
#include "gradsync/zero.h"
#include "support/subprocess.h"
#include "support/test_models.h"
#include "support/worker.h"

namespace t = gradsync::test;
namespace sh = gradsync::test::sharding;
namespace gpt = gradsync::cli::gpt;
namespace F = torch::nn::functional;
using gradsync::Reduction;

namespace {

const gpt::GptSizes kSizes{13, 6, 8, 2, 2};  // vocabulary, context, width, blocks, heads
constexpr int64_t kSequences = 64;
constexpr double kMaxNorm = 0.05;  // every step clips

struct TokenData {
  torch::Tensor inputs, targets;  // int64 [S, T]; targets -100 past each sequence's valid count
};

// Sequence 0 has no valid token, sequence 1 one; the others 0..T at random.
TokenData make_data() {
  auto g = at::detail::createCPUGenerator(7);
  auto inputs = torch::randint(kSizes.vocab, {kSequences, kSizes.context}, g);
  auto targets = torch::randint(kSizes.vocab, {kSequences, kSizes.context}, g);
  auto valid = torch::randint(kSizes.context + 1, {kSequences}, g);
  valid[0] = 0;
  valid[1] = 1;
  auto positions = torch::arange(kSizes.context).unsqueeze(0);
  return {inputs, targets.masked_fill(positions.ge(valid.unsqueeze(1)), -100)};
}

int64_t valid_tokens(const TokenData& d, const torch::Tensor& idx) {
  return d.targets.index_select(0, idx).ne(-100).sum().item<int64_t>();
}

using Plan = std::vector<std::vector<torch::Tensor>>;  // [rank][micro-batch] -> sequence indices

torch::Tensor all_sequences(const Plan& plan) {
  std::vector<torch::Tensor> all;
  for (const auto& rank : plan) all.insert(all.end(), rank.begin(), rank.end());
  return torch::cat(all);
}

// Step `step` of a world of n with K micro-batches per rank: each micro-batch 1-4 random sequences. With `ragged`,
// the first micro-batch is sequence 0 alone (no valid token), the second sequence 1 alone (one), and in step 1 the last
// rank has no data; without it, only sequences with valid tokens (a per-micro-batch token mean needs one).
Plan make_plan(const TokenData& d, int n, int64_t k, int64_t step, bool ragged) {
  auto g = at::detail::createCPUGenerator(1000 * n + 100 * k + 10 * step + (ragged ? 1 : 0));
  auto order = torch::randperm(kSequences, g);
  std::vector<int64_t> pool;
  for (int64_t i = 0; i < kSequences; ++i) {
    const int64_t s = order[i].item<int64_t>();
    if (s > 1 && (ragged || valid_tokens(d, torch::tensor({s})) > 0)) pool.push_back(s);
  }
  Plan plan(static_cast<size_t>(n));
  size_t next = 0;
  for (int r = 0; r < n; ++r) {
    if (ragged && step == 1 && n > 1 && r == n - 1) continue;
    for (int64_t m = 0; m < k; ++m) {
      const int64_t size = torch::randint(1, 5, {1}, g).item<int64_t>();
      std::vector<int64_t> idx;
      for (int64_t i = 0; i < size; ++i) idx.push_back(pool[next++ % pool.size()]);
      plan[static_cast<size_t>(r)].push_back(torch::tensor(idx));
    }
  }
  const bool room = n * k >= 3;  // keep valid tokens in the step besides the forced micro-batches
  if (ragged && room) plan[0][0] = torch::tensor({int64_t{0}});
  if (ragged && room) (k > 1 ? plan[0][1] : plan[1][0]) = torch::tensor({int64_t{1}});
  if (valid_tokens(d, all_sequences(plan)) == 0) {  // T = 0 has no mean: give the last micro-batch a valid token
    plan[0].back() = torch::cat({plan[0].back(), torch::tensor({int64_t{1}})});
  }
  return plan;
}


torch::Tensor token_ce(const torch::Tensor& logits, const torch::Tensor& targets, bool mean) {
  auto options = F::CrossEntropyFuncOptions().ignore_index(-100);
  if (mean) {
    options.reduction(torch::kMean);
  } else {
    options.reduction(torch::kSum);
  }
  return F::cross_entropy(logits.reshape({-1, kSizes.vocab}), targets.reshape({-1}), options);
}

gpt::Gpt make_model() {
  torch::manual_seed(11);
  gpt::Gpt model(kSizes);
  model->to(torch::kDouble);
  return model;
}

// One process: the gradient of sum(l)/T over the step's sequences (global), or of sum over micro-batches of
// token-mean/(N*K_r) (the mean of means the control predicts), flattened in parameter order.
torch::Tensor reference_gradient(const TokenData& d, const Plan& plan, bool global) {
  auto model = make_model();
  if (global) {
    const auto idx = all_sequences(plan);
    token_ce(model->forward(d.inputs.index_select(0, idx)), d.targets.index_select(0, idx), true).backward();
  } else {
    for (const auto& rank : plan) {
      for (const auto& idx : rank) {
        const double w = 1.0 / static_cast<double>(plan.size() * rank.size());
        (token_ce(model->forward(d.inputs.index_select(0, idx)), d.targets.index_select(0, idx), true) * w).backward();
      }
    }
  }
  std::vector<torch::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.grad().reshape({-1}));
  return torch::cat(flat);
}

torch::Tensor flat_gradient(gradsync::Engine& engine) {
  std::vector<torch::Tensor> flat;
  for (const auto& [name, g] : engine.full_gradients()) flat.push_back(g.reshape({-1}).to(torch::kDouble));
  return torch::cat(flat);
}

double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

// This rank's step: GlobalMean through accumulate_global_mean(), Mean through accumulate() of token means.
gradsync::GlobalStepLoss run_step(gradsync::Engine& engine, const TokenData& d, const std::vector<torch::Tensor>& mine) {
  auto forward = [&](int64_t m) { return engine.forward(d.inputs.index_select(0, mine[static_cast<size_t>(m)])); };
  auto targets = [&](int64_t m) { return d.targets.index_select(0, mine[static_cast<size_t>(m)]); };
  const auto count = static_cast<int64_t>(mine.size());
  if (engine.reduction() == Reduction::GlobalMean) {
    return gradsync::accumulate_global_mean(engine, count, [&](int64_t m) {
      return gradsync::ItemLoss{token_ce(forward(m), targets(m), false), targets(m).ne(-100).sum().item<int64_t>()};
    });
  }
  gradsync::accumulate(engine, count, [&](int64_t m) { return token_ce(forward(m), targets(m), true); });
  return {};
}

template <typename Fn>
void with_engine(const std::string& kind, Reduction reduction, const std::shared_ptr<gradsync::World>& world, Fn&& fn) {
  auto model = make_model();
  if (kind == "ddp") {
    gradsync::DistributedDataParallel engine(model, world, gradsync::DdpOptions().reduction(reduction));
    return fn(engine);
  }
  if (kind == "zero1") {
    gradsync::Zero1DataParallel engine(model, world, gradsync::ZeroOptions().reduction(reduction));
    return fn(engine);
  }
  const auto strategy = kind == "fsdp-full"      ? gradsync::ShardingStrategy::FullShard
                        : kind == "fsdp-grad-op" ? gradsync::ShardingStrategy::ShardGradOp
                                                 : gradsync::ShardingStrategy::NoShard;
  gradsync::FullyShardedDataParallel engine(
      model, world,
      gradsync::FsdpOptions().strategy(strategy).wrap(gradsync::WrapPolicy::types({"Block"})).reduction(reduction));
  fn(engine);
}

// Two steps of gradients (the second with a rank without data), GlobalMean and the control.
void check_gradients(const std::string& kind, const std::shared_ptr<gradsync::World>& world, const TokenData& d,
                     int64_t k) {
  const int n = world->size(), r = world->rank();
  with_engine(kind, Reduction::GlobalMean, world, [&](gradsync::Engine& engine) {
    for (int64_t step = 0; step < 2; ++step) {
      const auto plan = make_plan(d, n, k, step, /*ragged=*/true);
      run_step(engine, d, plan[static_cast<size_t>(r)]);
      const double diff = relative(flat_gradient(engine), reference_gradient(d, plan, true));
      WORKER_CHECK(diff <= 1e-12, "{} N={} K={} step {}: GlobalMean is {:.3g} off one process", kind, n, k, step, diff);
      engine.zero_grad();
    }
  });
  with_engine(kind, Reduction::Mean, world, [&](gradsync::Engine& engine) {
    const auto plan = make_plan(d, n, k, 0, /*ragged=*/false);
    run_step(engine, d, plan[static_cast<size_t>(r)]);
    const auto predicted = reference_gradient(d, plan, false), global = reference_gradient(d, plan, true);
    const double diff = relative(flat_gradient(engine), predicted), off = relative(predicted, global);
    WORKER_CHECK(diff <= 1e-9, "{} N={} K={}: the mean of token means is {:.3g} off its prediction", kind, n, k, diff);
    WORKER_CHECK(n * k == 1 || off > 1e-3, "{} N={} K={}: the control is only {:.3g} off the global mean", kind, n, k,
                 off);
    if (r == 0) fmt::print("{} N={} K={}: mean of means {:.3g} off the global mean as predicted\n", kind, n, k, off);
  });
}

struct Trace {
  std::vector<double> losses, norms;
  gradsync::StateDict state;
};

// Five Adam steps with clipping under GlobalMean, K = 2: one process on every step's sequences.
Trace reference_training(const TokenData& d, int n) {
  auto model = make_model();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  Trace trace;
  for (int64_t step = 0; step < 5; ++step) {
    const auto idx = all_sequences(make_plan(d, n, 2, step, true));
    adam.zero_grad();
    auto loss = token_ce(model->forward(d.inputs.index_select(0, idx)), d.targets.index_select(0, idx), true);
    loss.backward();
    trace.losses.push_back(loss.item<double>());
    trace.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    adam.step();
  }
  trace.state = gradsync::state_dict(*model);
  return trace;
}

void check_training(const std::string& kind, const std::shared_ptr<gradsync::World>& world, const TokenData& d,
                    const Trace& expected) {
  const int n = world->size(), r = world->rank();
  with_engine(kind, Reduction::GlobalMean, world, [&](gradsync::Engine& engine) {
    torch::optim::Adam adam(engine.parameters(), torch::optim::AdamOptions(1e-2));
    for (int64_t step = 0; step < 5; ++step) {
      engine.zero_grad();
      const auto plan = make_plan(d, n, 2, step, true);
      const double loss = run_step(engine, d, plan[static_cast<size_t>(r)]).mean_loss;
      const double norm = engine.clip_grad_norm(kMaxNorm);
      adam.step();
      const auto i = static_cast<size_t>(step);
      WORKER_CHECK(std::abs(loss - expected.losses[i]) <= 1e-12 * expected.losses[i], "{} N={} step {}: loss {} vs {}",
                   kind, n, step, loss, expected.losses[i]);
      WORKER_CHECK(std::abs(norm - expected.norms[i]) <= 1e-12 * expected.norms[i], "{} N={} step {}: norm {} vs {}",
                   kind, n, step, norm, expected.norms[i]);
    }
    const double diff = sh::max_relative_difference(engine.state_dict(), expected.state);
    WORKER_CHECK(diff <= 1e-10, "{} N={}: parameters after 5 Adam steps {:.3g} off one process", kind, n, diff);
  });
}

}  // namespace

// args: none. Every engine, K = 1..3, on this world.
GRADSYNC_WORKER(token_partition) {
  auto world = sh::join();
  torch::set_num_threads(1);
  const auto data = make_data();
  for (const std::string kind : {"ddp", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "zero1"}) {
    for (int64_t k = 1; k <= 3; ++k) check_gradients(kind, world, data, k);
  }
  const auto expected = reference_training(data, world->size());
  for (const std::string kind : {"ddp", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "zero1"}) {
    check_training(kind, world, data, expected);
  }
  return 0;
}

class TokenPartition : public ::testing::TestWithParam<int> {};

TEST_P(TokenPartition, GlobalMeanIsOneProcessOnTheStepAndTheMeanOfMeansIsOffAsPredicted) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(240);
  for (const auto& r : t::run_ranks(GetParam(), t::worker_argv("token_partition"), opts)) {
    EXPECT_TRUE(r.ok()) << r.describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TokenPartition, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "N" + std::to_string(info.param); });
