// The tokens experiment in the lab's outputs (see lab_tokens.cpp): JSON rows, table rows, tokens.csv and the
// tokens.png plot, the report section and the answer paragraph in English and Korean.
#include <algorithm>

#include <fmt/format.h>

#include "lab/lab.h"

namespace gradsync::cli {

nlohmann::ordered_json tokens_json(const TokensResult& t) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const auto& r : t.rows) {
    rows.push_back({{"world_size", r.world_size}, {"accumulate", r.accumulate},
                    {"global_mean_rel_diff", r.global_mean_rel_diff},
                    {"mean_of_means_rel_diff", r.mean_of_means_rel_diff},
                    {"mean_of_means_predicted_rel_diff", r.mean_of_means_predicted_rel_diff},
                    {"mean_of_means_to_prediction", r.mean_of_means_to_prediction},
                    {"global_mean_to_prediction", r.global_mean_to_prediction}});
  }
  const auto& c = t.curves;
  return {{"model", t.model}, {"data", "fortunes"}, {"global_batch", t.global_batch}, {"rows", rows},
          {"curves", {{"world_size", c.world_size}, {"accumulate", c.accumulate}, {"steps", c.steps},
                      {"reference", c.reference}, {"mean_of_means", c.mean_of_means}, {"global_mean", c.global_mean},
                      {"mean_of_means_final_rel_diff", c.mean_of_means_final_rel_diff},
                      {"global_mean_final_rel_diff", c.global_mean_final_rel_diff}}},
          {"seconds", t.seconds}};
}

std::vector<ResultRow> token_rows(const LabResults& r) {
  std::vector<ResultRow> rows;
  const double tol = r.config.tolerance;
  for (const auto& t : r.tokens.rows) {
    rows.push_back({fmt::format("tokens, N={} K={}, token mean / K, DDP mean", t.world_size, t.accumulate),
                    fmt::format("||g - g_ref|| / ||g_ref|| = {}, predicted {} (off the prediction by {})",
                                sci(t.mean_of_means_rel_diff), sci(t.mean_of_means_predicted_rel_diff),
                                sci(t.mean_of_means_to_prediction)),
                    t.mean_of_means_to_prediction <= tol && t.mean_of_means_rel_diff > tol ? "mean of token means"
                                                                                            : "neither"});
    rows.push_back({fmt::format("tokens, N={} K={}, GlobalMean", t.world_size, t.accumulate),
                    fmt::format("||g - g_ref|| / ||g_ref|| = {}", sci(t.global_mean_rel_diff)),
                    t.global_mean_rel_diff <= tol ? "token mean" : "neither"});
  }
  return rows;
}

std::pair<std::string, std::string> tokens_data(const LabResults& r) {
  std::string csv = "world_size,accumulate,global_mean_rel_diff,mean_of_means_rel_diff,"
                    "mean_of_means_predicted_rel_diff,mean_of_means_to_prediction,global_mean_to_prediction\n";
  for (const auto& t : r.tokens.rows) {
    csv += fmt::format("{},{},{},{},{},{},{}\n", t.world_size, t.accumulate, t.global_mean_rel_diff,
                       t.mean_of_means_rel_diff, t.mean_of_means_predicted_rel_diff, t.mean_of_means_to_prediction,
                       t.global_mean_to_prediction);
  }
  const auto& c = r.tokens.curves;
  std::string dat = "step reference mean_of_means global_mean\n";
  const size_t n = std::min({c.reference.size(), c.mean_of_means.size(), c.global_mean.size()});
  for (size_t s = 0; s < n; ++s) dat += fmt::format("{} {} {} {}\n", s, c.reference[s], c.mean_of_means[s], c.global_mean[s]);
  return {csv, dat};
}

std::string tokens_gnuplot(const LabResults& r) {
  if (r.tokens.rows.empty()) return "";
  const auto& c = r.tokens.curves;
  return fmt::format(R"gp(
unset logscale y
set format y "%g"
set autoscale y
unset label 1
set key top right
set output "tokens.png"
set title "{model} on fortunes, N = {n}, K = {k}, Adam: the loss each run logs"
set xlabel "optimizer step"
set ylabel "loss (nats per token)"
plot "tokens_curves.dat" using 1:2 with lines lw 3 lc rgb "#2f855a" title "reference: one process, token mean of the step", \
     "" using 1:4 with lines lw 1 dt 2 lc rgb "#2b6cb0" title "(b) GlobalMean (on the reference)", \
     "" using 1:3 with lines lw 1 lc rgb "#c53030" title "(a) token mean per micro-batch / K, DDP mean"
)gp", fmt::arg("model", r.tokens.model), fmt::arg("n", c.world_size), fmt::arg("k", c.accumulate));
}

std::string tokens_section(const LabResults& r) {
  if (r.tokens.rows.empty()) return "";
  const auto& t = r.tokens;
  std::string s = fmt::format(
      "## 6. Language model: token means\n\n"
      "A `{}` on Debian's fortunes (bytes as tokens, one fortune per sequence, so sequences hold different numbers "
      "of valid tokens), {} sequences per step. Each run is `gradsync train`; the gradient is what one SGD step with "
      "lr 1 applied, in float64. g_ref: one process, the mean over every valid token of the step. (a) each "
      "micro-batch's token mean / K and DDP's mean over ranks; predicted: each micro-batch's own token-mean gradient "
      "weighted 1/(N·K), computed in one process; (b) Reduction::GlobalMean. Figures are ||g − g_ref||₂ / "
      "||g_ref||₂.\n\n| N | K | (a) | (a) predicted | (a) vs prediction | (b) GlobalMean |\n|---|---|---|---|---|---|\n",
      t.model, t.global_batch);
  for (const auto& row : t.rows) {
    s += fmt::format("| {} | {} | {} | {} | {} | {} |\n", row.world_size, row.accumulate,
                     sci(row.mean_of_means_rel_diff), sci(row.mean_of_means_predicted_rel_diff),
                     sci(row.mean_of_means_to_prediction), sci(row.global_mean_rel_diff));
  }
  s += fmt::format("\nThen {} Adam steps (lr 2e-3, float64) at N = {}, K = {}: after them the parameters' update of (a) is {} "
                   "away from the reference's (relative), (b)'s {}.\n\n", t.curves.steps, t.curves.world_size,
                   t.curves.accumulate, sci(t.curves.mean_of_means_final_rel_diff),
                   sci(t.curves.global_mean_final_rel_diff));
  const bool have = std::find(r.plots.files.begin(), r.plots.files.end(), "tokens.png") != r.plots.files.end();
  s += have ? "![loss curves of the reference, (a) and (b)](tokens.png)\n\n" : "";
  return s;
}

std::string tokens_answer(const LabResults& r, bool ko) {
  if (r.tokens.rows.empty()) return "";
  double worst_a = 1e300, worst_b = 0;
  for (const auto& t : r.tokens.rows) {
    if (t.world_size * t.accumulate > 1) worst_a = std::min(worst_a, t.mean_of_means_rel_diff);
    worst_b = std::max(worst_b, t.global_mean_rel_diff);
  }
  return ko ? fmt::format("언어 모델에서는 loss가 token에 대한 평균이고 micro-batch마다 유효 token 수가 다릅니다. "
                          "micro-batch별 token 평균을 K로 나누고 DDP로 평균 내면 전체 step의 token 평균 gradient와 "
                          "최소 {}(상대 오차)만큼 달랐고, 그 차이는 각 token의 가중치 1/(N·K·n)이 예측한 값과 "
                          "일치했습니다. Reduction::GlobalMean(token loss의 합을 step 전체의 유효 token 수로 나눔)은 "
                          "최대 {}로 한 프로세스의 결과와 같았습니다.", sci(worst_a), sci(worst_b))
            : fmt::format("For a language model the loss is a mean over tokens, and micro-batches hold different "
                          "numbers of valid tokens: dividing each micro-batch's token mean by K and averaging over DDP's "
                          "ranks was at least {} (relative) away from the gradient of the token mean over the step, by "
                          "exactly what its weights 1/(N·K·n) per token predict; Reduction::GlobalMean (summed token "
                          "losses over the step's valid tokens on all ranks) matched one process to {}.",
                          sci(worst_a), sci(worst_b));
}

}  // namespace gradsync::cli
