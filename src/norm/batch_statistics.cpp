// The global batch statistics of a SyncBatchNorm (see batch_statistics.h).
#include "norm/batch_statistics.h"

namespace gradsync::norm {
namespace {

// Every dimension but the channels'.
std::vector<int64_t> reduced_dims(const torch::Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return dims;
}

}  // namespace

int64_t values_per_channel(const torch::Tensor& input) { return input.size(1) == 0 ? 0 : input.numel() / input.size(1); }

BatchStatistics gather_statistics(Collectives& group, const torch::Tensor& input) {
  const int64_t channels = input.size(1);
  const int64_t n = values_per_channel(input);
  // This rank's [n_r, mean_r (C), var_r (C)]. Two passes over the data (var_mean), in float64 from here on: the
  // combination below is where one process's single pass over the union would differ most.
  auto mine = torch::zeros({2 * channels + 1}, torch::kDouble);
  mine[0] = static_cast<double>(n);
  if (n > 0) {
    const auto x = input.detach().is_floating_point() && input.element_size() < 4 ? input.detach().to(torch::kFloat)
                                                                                   : input.detach();
    auto [var, mean] = torch::var_mean(x, reduced_dims(x), /*unbiased=*/false);
    mine.narrow(0, 1, channels).copy_(mean);
    mine.narrow(0, 1 + channels, channels).copy_(var);
  }
  auto all = torch::empty({group.size() * (2 * channels + 1)}, torch::kDouble);
  group.allgather_flat(mine, all);
  all = all.view({group.size(), 2 * channels + 1});

  BatchStatistics out;
  const auto counts = all.select(1, 0);                  // [R]
  const auto means = all.narrow(1, 1, channels);         // [R, C]
  const auto vars = all.narrow(1, 1 + channels, channels);
  for (int64_t r = 0; r < group.size(); ++r) out.per_rank.push_back(std::llround(counts[r].item<double>()));
  for (const auto c : out.per_rank) out.count += c;
  const auto weights = counts.unsqueeze(1);              // n_r, broadcast over the channels
  const double total = static_cast<double>(std::max<int64_t>(out.count, 1));
  out.mean = (weights * means).sum(0) / total;
  out.var = (weights * (vars + (means - out.mean).pow(2))).sum(0) / total;
  return out;
}

}  // namespace gradsync::norm
