// SyncBatchNorm against its definition: one torch::nn::BatchNorm over the union of the ranks' batches, in float64,
// on uneven ranks (a rank without data included). Every rank draws the whole union from the same seed, so it knows
// the reference exactly; a per-rank BatchNorm would be off by the spread of the ranks' means (checked too, so the
// comparison cannot pass for a BatchNorm that never communicates).
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gradsync/ddp.h"
#include "gradsync/engine.h"
#include "gradsync/error.h"
#include "gradsync/join.h"
#include "gradsync/runtime.h"
#include "gradsync/sync_batch_norm.h"
#include "support/subprocess.h"
#include "support/worker.h"

namespace t = gradsync::test;
namespace nn = torch::nn;

namespace {

std::vector<int64_t> parse_counts(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const auto comma = std::min(text.find(',', at), text.size());
    out.push_back(std::stoll(text.substr(at, comma - at)));
    at = comma + 1;
  }
  return out;
}

// The union's shape for `total` rows: [total, C] or [total, C, 3, 2].
std::vector<int64_t> shape_of(int64_t total, int64_t channels, int dims) {
  return dims == 1 ? std::vector<int64_t>{total, channels} : std::vector<int64_t>{total, channels, 3, 2};
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return a.numel() == 0 ? 0.0 : (a - b).abs().max().item<double>();
}

// One libtorch BatchNorm1d or BatchNorm2d (their forwards are not AnyModule's kind).
struct Reference {
  std::shared_ptr<nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

Reference reference_for(int dims, const nn::BatchNormOptions& options) {
  if (dims == 1) {
    nn::BatchNorm1d bn(options);
    return {bn.ptr(), [bn](const torch::Tensor& x) mutable { return bn->forward(x); }};
  }
  nn::BatchNorm2d bn(options);
  return {bn.ptr(), [bn](const torch::Tensor& x) mutable { return bn->forward(x); }};
}

struct Setup {
  int dims;
  std::vector<int64_t> counts;
  c10::optional<double> momentum;
  bool affine;
};

// One training step of the reference BatchNorm on the union and of this rank's SyncBatchNorm on its rows; the
// loss is sum(y * G), G fixed, so the input gradients of every rank are the union's.
void check_one_step(gradsync::Collectives& group, Reference& reference, gradsync::SyncBatchNorm& sync,
                    const Setup& s, int64_t channels, int step) {
  const int r = group.rank();
  const int64_t total = std::accumulate(s.counts.begin(), s.counts.end(), int64_t{0});
  const int64_t first = std::accumulate(s.counts.begin(), s.counts.begin() + r, int64_t{0});
  torch::manual_seed(100 + step);
  const auto x_all = (torch::randn(shape_of(total, channels, s.dims), torch::kDouble) * 3 + 2).requires_grad_();
  const auto g_all = torch::randn(shape_of(total, channels, s.dims), torch::kDouble);
  const auto y_all = reference.forward(x_all);
  (y_all * g_all).sum().backward();

  const auto x = x_all.detach().narrow(0, first, s.counts[static_cast<size_t>(r)]).clone().requires_grad_();
  auto y = sync->forward(x);
  (y * g_all.narrow(0, first, x.size(0))).sum().backward();
  const auto y_ref = y_all.detach().narrow(0, first, x.size(0));
  WORKER_CHECK(max_diff(y, y_ref) < 1e-12, "step {}: output off by {}", step, max_diff(y, y_ref));
  if (group.size() > 1 && x.size(0) > 1) {  // the control: this rank's own statistics give another output
    const auto own = torch::batch_norm(x.detach(), sync->weight, sync->bias, {}, {}, true, 0.0, 1e-5, false);
    WORKER_CHECK(max_diff(own, y_ref) > 1e-3, "step {}: a per-rank BatchNorm is as close ({})", step, max_diff(own, y_ref));
  }
  WORKER_CHECK(max_diff(x.grad(), x_all.grad().narrow(0, first, x.size(0))) < 1e-12, "step {}: input gradient off by {}",
               step, max_diff(x.grad(), x_all.grad().narrow(0, first, x.size(0))));
  if (s.affine) {  // local sums: their sum over ranks is the union's gradient
    auto grads = torch::cat({sync->weight.grad(), sync->bias.grad()});
    group.allreduce(grads, gradsync::Reduction::Sum);
    auto ref = reference.module->named_parameters();
    const auto expected = torch::cat({ref["weight"].grad(), ref["bias"].grad()});
    WORKER_CHECK(max_diff(grads, expected) < 1e-11, "step {}: weight/bias gradient off by {}", step,
                 max_diff(grads, expected));
    sync->zero_grad();
    reference.module->zero_grad();
  }
}

}  // namespace

// args: dims (1 or 2), per-rank counts ("5,0,3"), momentum ("none" or a number), affine (0/1)
GRADSYNC_WORKER(sync_batch_norm) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  Setup s{std::stoi(args.at(0)), parse_counts(args.at(1)), c10::nullopt, args.at(3) == "1"};
  if (args.at(2) != "none") s.momentum = std::stod(args.at(2));
  WORKER_CHECK(static_cast<int>(s.counts.size()) == world->size(), "{} counts for {} ranks", s.counts.size(),
               world->size());
  const int64_t channels = 4;
  auto options = nn::BatchNormOptions(channels).momentum(s.momentum).affine(s.affine);
  auto reference = reference_for(s.dims, options);
  gradsync::SyncBatchNorm sync(options, world);
  reference.module->to(torch::kDouble);
  sync->to(torch::kDouble);
  if (s.affine) {  // weights other than 1 and 0, the same on every rank
    torch::NoGradGuard no_grad;
    torch::manual_seed(7);
    auto w = torch::rand({channels}, torch::kDouble) + 0.5, b = torch::randn({channels}, torch::kDouble);
    for (auto* m : {reference.module.get(), static_cast<nn::Module*>(sync.ptr().get())}) {
      m->named_parameters()["weight"].copy_(w);
      m->named_parameters()["bias"].copy_(b);
    }
  }
  for (int step = 0; step < 3; ++step) check_one_step(world->comm(), reference, sync, s, channels, step);
  auto ref_buffers = reference.module->named_buffers();
  for (const auto& b : sync->named_buffers()) {
    const auto diff = b.key() == "num_batches_tracked" ? (b.value() != ref_buffers[b.key()]).sum().item<double>()
                                                       : max_diff(b.value(), ref_buffers[b.key()]);
    WORKER_CHECK(diff < 1e-12, "buffer {} off by {}", b.key(), diff);
  }
  // Eval: the running statistics, no collective (a rank may forward alone).
  sync->eval();
  reference.module->eval();
  const auto probe = torch::randn(shape_of(3, channels, s.dims), torch::kDouble);
  WORKER_CHECK(max_diff(sync->forward(probe), reference.forward(probe)) < 1e-12, "eval output differs");
  fmt::print("sync_batch_norm ok on rank {}\n", world->rank());
  return 0;
}

// args: per-rank counts, channels of the last rank's module. Prints the error every rank gets.
GRADSYNC_WORKER(sync_batch_norm_error) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  const auto counts = parse_counts(args.at(0));
  const int64_t channels = world->rank() == world->size() - 1 ? std::stoll(args.at(1)) : 3;
  gradsync::SyncBatchNorm sync(nn::BatchNormOptions(channels), world);
  try {
    sync->forward(torch::randn({counts[static_cast<size_t>(world->rank())], channels}));
  } catch (const gradsync::Error& e) {
    fmt::print("rank {} failed: {}\n", world->rank(), e.what());
    return 3;
  }
  return 0;
}

// A library user's step where the last rank brings one micro-batch fewer: accumulate() would give it a shadow
// micro-step, which runs no SyncBatchNorm; every rank must fail before any forward, naming the counts.
GRADSYNC_WORKER(sync_batch_norm_uneven_steps) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  nn::Sequential model(nn::Linear(3, 4), nn::BatchNorm1d(4), nn::Functional([](const torch::Tensor& x) { return x.sum(); }));
  gradsync::convert_sync_batchnorm(*model, world);
  gradsync::DistributedDataParallel engine(model, world);
  const int64_t k = world->rank() == world->size() - 1 ? 1 : 2;
  try {
    gradsync::accumulate(engine, k, [&](int64_t) { return engine.forward(torch::randn({4, 3})); });
  } catch (const gradsync::ConfigError& e) {
    fmt::print("rank {} failed: {}\n", world->rank(), e.what());
    return 3;
  }
  return 0;
}

// Join's joined ranks run no forward: refused for a model with a SyncBatchNorm, on every rank.
GRADSYNC_WORKER(sync_batch_norm_join) {
  auto world = gradsync::init({std::chrono::seconds(30), std::nullopt, std::nullopt});
  nn::Sequential model(nn::Linear(3, 4), nn::ReLU(), nn::BatchNorm1d(4));
  gradsync::convert_sync_batchnorm(*model, world);
  gradsync::DistributedDataParallel engine(model, world);
  try {
    gradsync::Join join(engine);
  } catch (const gradsync::ConfigError& e) {
    fmt::print("rank {} failed: {}\n", world->rank(), e.what());
    return 3;
  }
  return 0;
}

namespace {

void expect_all_ok(const std::vector<t::ProcessResult>& results) {
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("sync_batch_norm ok"), std::string::npos) << r.describe();
  }
}

std::vector<t::ProcessResult> run(int ranks, const std::vector<std::string>& args, const char* worker = "sync_batch_norm") {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(60);
  return t::run_ranks(ranks, t::worker_argv(worker, args), opts);
}

}  // namespace

TEST(SyncBatchNorm, IsOneBatchNormOverTheUnionOfUnevenRanks1d) { expect_all_ok(run(3, {"1", "5,0,9", "0.1", "1"})); }

TEST(SyncBatchNorm, IsOneBatchNormOverTheUnionOfUnevenRanks2dCumulativeAverageNoAffine) {
  expect_all_ok(run(2, {"2", "1,4", "none", "0"}));
}

TEST(SyncBatchNorm, IsOneBatchNormOnOneRank) { expect_all_ok(run(1, {"1", "6", "0.3", "1"})); }

TEST(SyncBatchNorm, IsOneBatchNormOverTheUnionOnMpi) {
  t::CommandOptions opts;
  opts.timeout = std::chrono::seconds(90);
  auto r = t::run_mpi_ranks(3, t::worker_argv("sync_batch_norm", {"2", "2,3,0", "0.1", "1"}), opts);
  ASSERT_TRUE(r.ok()) << r.describe();
  size_t ok = 0;
  for (size_t at = r.out.find("sync_batch_norm ok"); at != std::string::npos; at = r.out.find("sync_batch_norm ok", at + 1)) ++ok;
  EXPECT_EQ(ok, 3u) << r.describe();
}

TEST(SyncBatchNorm, AGlobalCountOfOneFailsEveryRankNamingTheCounts) {
  for (const auto& r : run(2, {"1,0", "3"}, "sync_batch_norm_error")) {
    EXPECT_EQ(r.exit_code, 3) << r.describe();
    EXPECT_NE(r.out.find("more than 1 value per channel over the group's 2 ranks, got 1 (per rank: 1, 0)"),
              std::string::npos) << r.describe();
  }
}

TEST(SyncBatchNorm, AnEngineStepWithUnequalMicroBatchCountsFailsEveryRank) {
  for (const auto& r : run(3, {}, "sync_batch_norm_uneven_steps")) {
    EXPECT_EQ(r.exit_code, 3) << r.describe();
    EXPECT_NE(r.out.find("SyncBatchNorm '1' communicates in every forward and backward"), std::string::npos)
        << r.describe();
    EXPECT_NE(r.out.find("(rank 0..2: 2, 2, 1)"), std::string::npos) << r.describe();
  }
}

TEST(SyncBatchNorm, JoinIsRefused) {
  for (const auto& r : run(2, {}, "sync_batch_norm_join")) {
    EXPECT_EQ(r.exit_code, 3) << r.describe();
    EXPECT_NE(r.out.find("Join: the model's SyncBatchNorm '2' communicates"), std::string::npos) << r.describe();
  }
}

TEST(SyncBatchNorm, RanksWithDifferentChannelsFailNamingThem) {
  for (const auto& r : run(2, {"4,4", "5"}, "sync_batch_norm_error")) {
    EXPECT_EQ(r.exit_code, 3) << r.describe();
    EXPECT_NE(r.out.find("channel counts differ (rank 0..1: 3, 5)"), std::string::npos) << r.describe();
  }
}

namespace {

struct MemberNormImpl : nn::Module {  // a BatchNorm its forward calls directly: convert cannot reach it
  MemberNormImpl() { register_module("norm", norm); }
  torch::Tensor forward(const torch::Tensor& x) { return norm(x); }
  nn::BatchNorm1d norm{3};
};
TORCH_MODULE(MemberNorm);

struct TwoStagesImpl : nn::Module {  // Sequentials inside a module: a 1-d and a 2-d BatchNorm
  TwoStagesImpl() {
    register_module("first", first);
    register_module("second", second);
  }
  torch::Tensor forward(const torch::Tensor& x) { return second->forward(first->forward(x).view({-1, 2, 1, 1})); }
  nn::Sequential first{nn::Linear(4, 2), nn::BatchNorm1d(nn::BatchNormOptions(2).affine(false)), nn::ReLU()};
  nn::Sequential second{nn::BatchNorm2d(nn::BatchNormOptions(2).momentum(0.3)), nn::Flatten()};
};

std::shared_ptr<gradsync::World> one_process() {
  return gradsync::init({std::chrono::seconds(10), gradsync::LaunchEnv{}, gradsync::Backend::Gloo});
}

}  // namespace

TEST(ConvertSyncBatchnorm, SwapsEveryBatchNormOfEverySequentialKeepingTensorsKeysAndMode) {
  auto model = std::make_shared<TwoStagesImpl>();
  model->second->eval();
  const auto before = model->named_parameters();
  const auto buffers = model->named_buffers();
  EXPECT_EQ(gradsync::convert_sync_batchnorm(*model, one_process()), 2);
  const auto after = model->named_parameters();
  ASSERT_EQ(after.keys(), before.keys());
  for (const auto& p : before) EXPECT_TRUE(after[p.key()].is_same(p.value())) << p.key();
  ASSERT_EQ(model->named_buffers().keys(), buffers.keys());
  for (const auto& b : buffers) EXPECT_TRUE(model->named_buffers()[b.key()].is_same(b.value())) << b.key();
  auto first = model->first->ptr<gradsync::SyncBatchNormImpl>(1);
  ASSERT_TRUE(first);
  EXPECT_FALSE(first->options.affine());
  auto second = model->second->ptr<gradsync::SyncBatchNormImpl>(0);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->options.momentum(), 0.3);
  EXPECT_FALSE(second->is_training());
  EXPECT_TRUE(model->first->named_children()["1"].get() == first.get());  // registered = what forward runs
  auto y = model->forward(torch::randn({5, 4}));  // through both (one rank: plain BatchNorm)
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{5, 2}));
  EXPECT_EQ(first->num_batches_tracked.item<int64_t>(), 1);
  EXPECT_EQ(second->num_batches_tracked.item<int64_t>(), 0);  // eval mode came along
}

TEST(ConvertSyncBatchnorm, ABatchNormItCannotReachIsAnErrorAndChangesNothing) {
  nn::Sequential model(nn::BatchNorm1d(3), MemberNorm());
  try {
    gradsync::convert_sync_batchnorm(*model, one_process());
    FAIL() << "no error";
  } catch (const gradsync::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'1.norm' is a BatchNorm held by"), std::string::npos) << what;
    EXPECT_NE(what.find("MemberNormImpl"), std::string::npos) << what;
  }
  EXPECT_TRUE(std::dynamic_pointer_cast<nn::BatchNorm1dImpl>(model->ptr(0))) << "the first BatchNorm was swapped";
}
