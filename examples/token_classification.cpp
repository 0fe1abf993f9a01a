// token_classification: variable-length sequences, where "the mean loss" has to mean the mean over tokens.
// Synthetic token classification: every micro-batch holds a few sequences of random lengths, padded to kMaxLen,
// with a padding mask; per-token features [B, T, F] go through a small per-token model to logits [B, T, C];
// the loss is the cross-entropy of the NON-padding tokens only. Every rank runs kMicroBatches micro-batches per
// step, and ranks and micro-batches hold different numbers of sequences and tokens.
//
// The program compares two DDP runs of the same step with the gradient of one process on the concatenated
// batch (every rank's and micro-batch's sequences, the loss the mean over all of their T tokens):
//   - Reduction::GlobalMean with gradsync::accumulate_global_mean(): each micro-batch returns
//     ItemLoss{sum of its token losses, its token count}; the reducer divides by T, the tokens of the whole step.
//     Expected: the same gradient up to float32 rounding (~1e-7).
//   - Reduction::Mean with gradsync::accumulate() and each micro-batch's token-mean loss (the usual recipe):
//     the mean over ranks of the mean over micro-batches of per-micro-batch token means. A token in a short
//     micro-batch weighs more than one in a long micro-batch, so this is NOT the per-token mean.
// Rank 0 prints a table and a verdict; every rank recomputes the reference itself (every process can rebuild
// every rank's data) and exits 1 if GlobalMean is off by more than kTolerance, or if the plain mean is not off.
//
//   build/gradsync launch -n 3 -- build/examples/token_classification
//   build/examples/token_classification      # a world of one: the micro-batches are still uneven
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/gradsync.h"

namespace {

constexpr int64_t kFeatures = 8;
constexpr int64_t kHidden = 16;
constexpr int64_t kClasses = 5;
constexpr int64_t kMaxLen = 12;        // sequences are padded to this length
constexpr int64_t kMicroBatches = 2;   // per rank and step
constexpr uint64_t kDataSeed = 2024;
constexpr double kTolerance = 1e-5;    // max |diff| below which two gradients count as equal
constexpr double kMustDiffer = 1e-3;   // the plain mean must be off by at least this much to count as "off"

namespace F = torch::nn::functional;

// One padded micro-batch: features [B, T, F] (padding positions hold random values too: only the mask keeps
// them out of the loss), targets [B, T] (0 at padding), mask [B, T] (1 for real tokens).
struct MicroBatch {
  torch::Tensor features, targets, mask;
  int64_t tokens() const { return mask.sum().item<int64_t>(); }
};

// Rank r's micro-batch k, the same in every process. The number of sequences depends on (r, k), the lengths
// are random in 1..kMaxLen, so the token counts differ between ranks and between micro-batches.
MicroBatch micro_batch(int rank, int64_t k) {
  auto gen = at::detail::createCPUGenerator(kDataSeed + 100 * static_cast<uint64_t>(rank) + static_cast<uint64_t>(k));
  const int64_t sequences = 1 + (2 * rank + 3 * k) % 5;  // 1..5
  auto lengths = torch::randint(1, kMaxLen + 1, {sequences, 1}, gen, torch::kLong);
  auto positions = torch::arange(kMaxLen, torch::kLong).unsqueeze(0);
  auto mask = (positions < lengths).to(torch::kFloat);
  auto features = torch::randn({sequences, kMaxLen, kFeatures}, gen, torch::kFloat);
  auto targets = torch::randint(0, kClasses, {sequences, kMaxLen}, gen, torch::kLong) * mask.to(torch::kLong);
  return {features, targets, mask};
}

torch::nn::Sequential make_model() {
  torch::manual_seed(7);  // every rank and the reference start from the same parameters
  return torch::nn::Sequential(torch::nn::Linear(kFeatures, kHidden), torch::nn::Tanh(),
                               torch::nn::Linear(kHidden, kClasses));
}

// Sum of the cross-entropy of the non-padding tokens. `logits` is [B, T, C].
torch::Tensor summed_token_loss(const torch::Tensor& logits, const MicroBatch& b) {
  auto per_token = F::cross_entropy(logits.reshape({-1, kClasses}), b.targets.reshape({-1}),
                                    F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (per_token * b.mask.reshape({-1})).sum();
}

std::vector<torch::Tensor> gradients(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.grad().detach().clone());
  return out;
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

// Every rank's micro-batches concatenated along the batch dimension; one forward, the mean over all T tokens.
struct Reference {
  std::vector<torch::Tensor> grads;
  double loss = 0;
  int64_t tokens = 0;
};

Reference reference(int world_size) {
  std::vector<torch::Tensor> features, targets, masks;
  for (int r = 0; r < world_size; ++r) {
    for (int64_t k = 0; k < kMicroBatches; ++k) {
      auto b = micro_batch(r, k);
      features.push_back(b.features);
      targets.push_back(b.targets);
      masks.push_back(b.mask);
    }
  }
  MicroBatch all{torch::cat(features), torch::cat(targets), torch::cat(masks)};
  auto model = make_model();
  Reference out;
  out.tokens = all.tokens();
  auto loss = summed_token_loss(model->forward(all.features), all) / static_cast<double>(out.tokens);
  loss.backward();
  out.loss = loss.item<double>();
  out.grads = gradients(*model);
  return out;
}

int run() {
  auto world = gradsync::init();
  const int n = world->size();
  const int rank = world->rank();

  // Reduction::GlobalMean: summed token losses, the reducer divides by the step's token count.
  auto global_model = make_model();
  gradsync::DdpOptions global_options;
  global_options.reduction(gradsync::Reduction::GlobalMean);
  gradsync::DistributedDataParallel global_ddp(global_model, world, global_options);
  const auto step = gradsync::accumulate_global_mean(global_ddp, kMicroBatches, [&](int64_t k) {
    auto b = micro_batch(rank, k);
    return gradsync::ItemLoss{summed_token_loss(global_ddp.forward(b.features), b), b.tokens()};
  });
  const auto global_grads = gradients(*global_model);

  // Reduction::Mean, the usual recipe: each micro-batch's loss is its own token mean, divided by K; DDP then
  // averages over ranks.
  auto mean_model = make_model();
  gradsync::DistributedDataParallel mean_ddp(mean_model, world);  // Reduction::Mean, as PyTorch DDP
  gradsync::accumulate(mean_ddp, kMicroBatches, [&](int64_t k) {
    auto b = micro_batch(rank, k);
    return summed_token_loss(mean_ddp.forward(b.features), b) / static_cast<double>(b.tokens());
  });
  const auto mean_grads = gradients(*mean_model);

  const auto ref = reference(n);
  const double global_diff = max_abs_diff(global_grads, ref.grads);
  const double mean_diff = max_abs_diff(mean_grads, ref.grads);
  double scale = 0;
  for (const auto& g : ref.grads) scale = std::max(scale, g.abs().max().item<double>());
  const bool global_ok = global_diff <= kTolerance && step.total_items == ref.tokens;
  const bool mean_off = mean_diff > kMustDiffer;

  // Token counts of every rank's micro-batches, for the table.
  std::vector<int64_t> mine;
  for (int64_t k = 0; k < kMicroBatches; ++k) mine.push_back(micro_batch(rank, k).tokens());
  auto everyone = torch::zeros({n * kMicroBatches}, torch::kLong);
  world->comm().allgather_flat(torch::tensor(mine, torch::kLong), everyone);

  if (world->is_main()) {
    fmt::print("{} rank{}, {} micro-batches each, sequences padded to {} tokens; non-padding tokens per micro-batch:\n",
               n, n == 1 ? "" : "s", kMicroBatches, kMaxLen);
    for (int r = 0; r < n; ++r) {
      std::string counts;
      int64_t total = 0;
      for (int64_t k = 0; k < kMicroBatches; ++k) {
        const auto c = everyone[r * kMicroBatches + k].item<int64_t>();
        counts += fmt::format("{}{}", k == 0 ? "" : " + ", c);
        total += c;
      }
      fmt::print("  rank {}: {} = {} tokens\n", r, counts, total);
    }
    fmt::print("reference: one process, every sequence concatenated, loss = mean over all T = {} tokens ({:.6f}); "
               "largest gradient entry {:.3g}\n", ref.tokens, ref.loss, scale);
    fmt::print("  {:<58} {:>10}\n", "", "max |diff|");
    fmt::print("  {:<58} {:>10.2e}   (T = {}, loss {:.6f})\n",
               "Reduction::GlobalMean, accumulate_global_mean (token sums)", global_diff, step.total_items,
               step.mean_loss);
    fmt::print("  {:<58} {:>10.2e}\n", "Reduction::Mean, accumulate (token mean per micro-batch)", mean_diff);
    if (global_ok && mean_off) {
      fmt::print("verdict: GlobalMean is the per-token mean over every rank and micro-batch (max |diff| {:.1e} <= "
                 "{:g}); the mean of per-micro-batch token means is not (off by {:.1e})\n", global_diff, kTolerance,
                 mean_diff);
    } else {
      fmt::print("verdict: WRONG - GlobalMean off by {:.2e} (allowed {:g}, T {} vs {}), plain mean off by {:.2e} "
                 "(must exceed {:g})\n", global_diff, kTolerance, step.total_items, ref.tokens, mean_diff,
                 kMustDiffer);
    }
    std::fflush(stdout);
  }
  if (!global_ok || !mean_off) {
    fmt::print(stderr, "token_classification: rank {}: GlobalMean max |diff| {:.3g} (T {} vs {}), Mean max |diff| "
               "{:.3g}\n", rank, global_diff, step.total_items, ref.tokens, mean_diff);
    return 1;
  }
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "token_classification: error: {}\n", e.what());
    return 1;
  }
}
