// sum_vs_mean: does data parallelism sum or average gradients over ranks? (`make demo` runs it on 4 ranks.)
// Rank r contributes 2^r, so that the sum (2^N - 1), the mean ((2^N - 1) / N) and "nothing was reduced" (2^r)
// are different numbers at every N >= 2. The program shows
//   - the collectives, where the semantics are declared: allreduce(Reduction::Sum) and allreduce(Reduction::Mean);
//   - DistributedDataParallel: a bias-free Linear whose loss on rank r is 2^r * sum(w), so the local gradient of
//     every weight is 2^r; after backward() it holds the mean over ranks with the default Reduction::Mean (as
//     PyTorch DDP), and the sum only when Reduction::Sum is asked for.
// Rank 0 prints a table and a verdict; every rank checks the numbers and exits 1 if one is wrong.
//
//   build/gradsync launch -n 4 -- build/examples/sum_vs_mean
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/gradsync.h"

namespace {

constexpr int kMaxRanks = 24;       // 2^r and their sum stay exact in float32 up to 24 ranks
constexpr int kShownRanks = 8;      // columns of the per-rank row
constexpr int64_t kWeights = 4;

// Relative closeness for results that went through float32 and a 1/N scaling (1/3 is not exact in binary).
bool close(double value, double expected) { return std::abs(value - expected) <= 1e-6 * std::abs(expected); }

// The gradient DDP leaves in .grad when every rank's local gradient of every weight is 2^rank.
double ddp_gradient(const std::shared_ptr<gradsync::World>& world, gradsync::Reduction reduction) {
  torch::nn::Linear model(torch::nn::LinearOptions(kWeights, 1).bias(false));
  gradsync::DdpOptions options;
  options.reduction(reduction);
  gradsync::DistributedDataParallel ddp(model, world, options);
  auto out = ddp.forward(torch::ones({1, kWeights}));       // = sum(w)
  auto loss = std::ldexp(1.0, world->rank()) * out.sum();   // d loss / d w_i = 2^rank
  loss.backward();
  auto grad = model->weight.grad();
  const double first = grad.flatten()[0].item<double>();
  if (!torch::allclose(grad, torch::full_like(grad, first))) {
    throw gradsync::Error(fmt::format("rank {}: DDP gradient is not uniform: min {} max {}", world->rank(),
                                      grad.min().item<double>(), grad.max().item<double>()));
  }
  return first;
}

int run() {
  auto world = gradsync::init();
  const int n = world->size();
  const int rank = world->rank();
  if (n > kMaxRanks) {
    throw gradsync::ConfigError(fmt::format("sum_vs_mean: {} ranks; at most {} (2^r must stay exact in float32)",
                                            n, kMaxRanks));
  }
  auto& comm = world->comm();
  const double mine = std::ldexp(1.0, rank);

  auto local = torch::full({1}, mine, torch::kDouble);
  auto everyone = torch::zeros({n}, torch::kDouble);
  comm.allgather_flat(local, everyone);  // only for the table: what each rank holds
  auto sum = local.clone();
  comm.allreduce(sum, gradsync::Reduction::Sum);
  auto mean = local.clone();
  comm.allreduce(mean, gradsync::Reduction::Mean);
  const double ddp_mean = ddp_gradient(world, gradsync::Reduction::Mean);
  const double ddp_sum = ddp_gradient(world, gradsync::Reduction::Sum);

  const double want_sum = std::ldexp(1.0, n) - 1;
  const double want_mean = want_sum / n;
  const bool ok = sum.item<double>() == want_sum && close(mean.item<double>(), want_mean) &&
                  close(ddp_mean, want_mean) && close(ddp_sum, want_sum);

  if (world->is_main()) {
    std::string values;
    for (int r = 0; r < std::min(n, kShownRanks); ++r) values += fmt::format(" {:g}", everyone[r].item<double>());
    if (n > kShownRanks) values += " ...";
    fmt::print("{} rank{}; rank r holds 2^r (DDP: local gradient 2^r):{}\n", n, n == 1 ? "" : "s", values);
    fmt::print("  {:<38} {:>10}   {}\n", "", "result", "expected");
    auto row = [](const char* what, double value, const char* formula, double expected) {
      fmt::print("  {:<38} {:>10.6g}   {:<9} = {:.6g}\n", what, value, formula, expected);
    };
    row("allreduce, Reduction::Sum", sum.item<double>(), "2^N-1", want_sum);
    row("allreduce, Reduction::Mean", mean.item<double>(), "(2^N-1)/N", want_mean);
    row("DDP gradient, default Reduction::Mean", ddp_mean, "(2^N-1)/N", want_mean);
    row("DDP gradient, Reduction::Sum", ddp_sum, "2^N-1", want_sum);
    if (!ok) {
      fmt::print("verdict: WRONG - a result differs from its expected value\n");
    } else if (n == 1) {
      fmt::print("verdict: mean (equal to the sum with one rank; run with 2 or more ranks to tell them apart)\n");
    } else {
      fmt::print("verdict: mean - DDP's gradient is the average over ranks, {:.6g}, not the sum {:g}\n", ddp_mean,
                 want_sum);
    }
    std::fflush(stdout);
  }
  if (!ok) {
    fmt::print(stderr, "sum_vs_mean: rank {}: sum {} mean {} ddp {} ddp(sum) {}; expected sum {} mean {}\n", rank,
               sum.item<double>(), mean.item<double>(), ddp_mean, ddp_sum, want_sum, want_mean);
    return 1;
  }
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "sum_vs_mean: error: {}\n", e.what());
    return 1;
  }
}
