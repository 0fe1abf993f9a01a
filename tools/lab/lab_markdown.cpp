// report.md of `gradsync lab` (see lab.h): the results table, one section per experiment with its numbers and
// plot, the answer in English and in Korean (the language the question was asked in), and the definitions of
// every figure.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "lab/lab.h"

namespace gradsync::cli {
namespace {

// report.md gives its figures one digit more than the terminal table (sci2()).
std::string sci2(double v) { return fmt::format("{:.2e}", v); }

// A table cell: '|' would end the cell.

std::string plot(const LabResults& r, const std::string& file, const std::string& alt) {
  const bool have = std::find(r.plots.files.begin(), r.plots.files.end(), file) != r.plots.files.end();
  return have ? fmt::format("![{}]({})\n\n", alt, file)
              : fmt::format("*(plot {} not rendered: {})*\n\n", file, r.plots.message);
}

std::string loss_section(const LabResults& r) {
  const auto& l = r.loss;
  std::string s = fmt::format(
      "## 1. Loss vs batch size\n\n"
      "The same model from the same initial state, trained locally with `gradsync train`'s loop (SGD, lr {:g}, "
      "{} steps, shuffled Fashion-MNIST order) at each global batch size B. The step-0 loss is measured again on "
      "the same first batch with `--loss-reduction sum`.\n\n",
      l.lr, l.steps);
  s += plot(r, "loss_vs_batch.png", "training loss per step for each batch size");
  s += "| B | step-0 loss (mean) | step-0 loss (sum) | sum / mean | final loss | seconds |\n"
       "|---|---|---|---|---|---|\n";
  for (const auto& run : l.runs) {
    s += fmt::format("| {} | {:.5f} | {:.3f} | {:.3f} | {:.5f} | {:.1f} |\n", run.batch, run.step0_mean(),
                     run.step0_sum, run.sum_over_mean(), run.final_loss(), run.seconds);
  }
  s += fmt::format("\nAcross B the step-0 losses differ by {:.2f}% of their mean; sum / mean differs from B by at "
                   "most {:.1e} (relative). Verdict: **{}** when the first is below 5% and the second below 1%.\n\n",
                   l.step0_spread * 100, l.ratio_error, l.verdict);
  return s;
}

std::string accumulation_section(const LabResults& r) {
  const auto& a = r.accumulation;
  return fmt::format(
      "## 2. Gradient accumulation\n\n"
      "One batch of K·b = {k}·{b} = {kb} samples. g is the gradient of the mean loss over all of them. \"Raw\" is "
      ".grad after K backward passes of each micro-batch's mean loss with nothing divided; \"loss / K\" is "
      "`gradsync::accumulate()`, which divides each micro-batch loss by K.\n\n"
      "| measurement | value | verdict |\n|---|---|---|\n"
      "| \\|raw\\| / \\|g\\| | {ratio:.6f} (K = {k}) | **{rv}** |\n"
      "| max \\|raw − K·g\\| | {rs} | |\n"
      "| max \\|raw − g\\| | {rm} | |\n"
      "| max \\|loss/K − g\\| | {sm} | **{sv}** |\n\n"
      "`backward()` adds into `.grad`, so K passes leave the sum of K micro-batch gradients; only dividing the loss "
      "(or the gradient) by K gives the mean.\n\n",
      fmt::arg("k", a.micro_batches), fmt::arg("b", a.micro_batch), fmt::arg("kb", a.micro_batches * a.micro_batch),
      fmt::arg("ratio", a.raw_ratio), fmt::arg("rv", a.raw_verdict), fmt::arg("rs", sci2(a.raw_to_sum)),
      fmt::arg("rm", sci2(a.raw_to_mean)), fmt::arg("sm", sci2(a.scaled_to_mean)), fmt::arg("sv", a.scaled_verdict));
}

std::string ddp_section(const LabResults& r) {
  std::string s = fmt::format(
      "## 3. DDP against one process\n\n"
      "For each world size N, N ranks (separate processes started by `gradsync lab`, Gloo over loopback) each take "
      "an equal share of one global batch and run `gradsync::DistributedDataParallel` with its default "
      "`Reduction::Mean`, as PyTorch DDP. This process computes, on the same global batch and initial state, the "
      "single-process gradient of the mean loss (\"mean\") and the sum of the per-rank mean gradients (\"sum\", "
      "N times the mean). Verdict \"mean\": every rank's synchronised gradient is within {tol:g} of the mean and "
      "not within {tol:g} of the sum (at N = 1 they are the same gradient, so only the first part can be "
      "tested).\n\n",
      fmt::arg("tol", r.config.tolerance));
  s += plot(r, "ddp_deviation.png", "gradient deviation from the mean and from the sum per world size");
  s += "| N | global batch | max \\|Δ\\| to mean | max \\|Δ\\| to sum | between ranks | verdict | seconds |\n"
       "|---|---|---|---|---|---|---|\n";
  for (const auto& d : r.ddp) {
    s += fmt::format("| {} | {} | {} | {} | {} | **{}**{} | {:.1f} |\n", d.world_size, d.global_batch, sci2(d.to_mean),
                     sci2(d.to_sum), sci2(d.between_ranks), d.verdict, d.note.empty() ? "" : " (" + d.note + ")",
                     d.seconds);
  }
  s += "\n### Each rank's gradient before and after synchronisation\n\n";
  s += plot(r, "ddp_ranks.png", "per-rank gradient deviation from the mean before and after sync");
  const auto probe = r.ddp.empty() ? std::string("probe") : r.ddp.front().probe_name;
  s += fmt::format("| N | rank | samples | before: max \\|Δ\\| to mean | before: \\|g\\| | before: vs own shard | "
                   "after: max \\|Δ\\| to mean | after: max \\|Δ\\| to sum | {p} before | {p} after |\n"
                   "|---|---|---|---|---|---|---|---|---|---|\n",
                   fmt::arg("p", probe));
  for (const auto& d : r.ddp) {
    for (const auto& g : d.ranks) {
      s += fmt::format("| {} | {} | {} | {} | {:.4f} | {} | {} | {} | {:.6f} | {:.6f} |\n", d.world_size, g.rank,
                       g.samples, sci2(g.local_to_mean), g.local_norm, sci2(g.local_to_shard), sci2(g.synced_to_mean),
                       sci2(g.synced_to_sum), g.local_probe, g.synced_probe);
    }
  }
  s += "\nThe probe is one gradient element, for reading by eye: single-process mean / sum of the ranks' gradients";
  for (const auto& d : r.ddp) s += fmt::format("; N = {}: {:.6f} / {:.6f}", d.world_size, d.probe_mean, d.probe_sum);
  s += ".\n\n";
  return s;
}

std::string uneven_section(const LabResults& r) {
  std::string s =
      "## 4. Uneven per-rank batches\n\n"
      "The same global batch split unevenly (rank r gets a share proportional to r + 1). With `Reduction::Mean` "
      "(PyTorch's) each rank's loss is the mean over its share and DDP averages the ranks' gradients with equal "
      "weights, so the hypotheses are the mean of the per-rank mean gradients and the mean over all samples. A "
      "second copy of the model runs DDP with `Reduction::GlobalMean` on the same shares "
      "(`gradsync::accumulate_global_mean`: each rank backpropagates the sum of its samples' losses, one allreduce "
      "of [samples, loss sum] gives the step's T, the reducer divides by T), which should give the mean over all "
      "samples.\n\n";
  if (r.uneven.empty()) return s + "Not measured: it needs a world size of at least 2.\n\n";
  s += "| N | samples per rank | reduction | max \\|Δ\\| to mean of rank means | max \\|Δ\\| to sample mean | "
       "verdict |\n|---|---|---|---|---|---|\n";
  for (const auto& u : r.uneven) {
    s += fmt::format("| {} | {} | Mean | {} | {} | **{}** |\n", u.world_size, fmt::join(u.samples, " + "),
                     sci2(u.to_mean_of_means), sci2(u.to_global_mean), u.verdict);
    s += fmt::format("| {} | {} | GlobalMean (T = {}) | {} | {} | **{}** |\n", u.world_size,
                     fmt::join(u.samples, " + "), u.global_items, sci2(u.global_to_mean_of_means),
                     sci2(u.global_to_sample_mean), u.global_verdict);
  }
  return s + "\nFor GlobalMean, max |Δ| to the sample mean is the largest over ranks and to the mean of rank means "
             "the smallest; the verdict also requires every rank to hold the same gradient and to have counted T as "
             "the whole global batch.\n\n";
}

std::string sharded_section(const LabResults& r) {
  std::string s = fmt::format(
      "## 5. Sharded (FSDP/ZeRO)\n\n"
      "For each world size, the same ranks then build `gradsync::FullyShardedDataParallel` with "
      "`ShardingStrategy::FullShard` (ZeRO-3, `Reduction::Mean`) over a fresh copy of the model in the same initial "
      "state, run one forward and backward of the mean loss on the same equal shares, and take one "
      "`torch::optim::SGD` step with lr = 1 on their own parameter shards. `state_dict()` gathers the updated "
      "parameters on every rank; initial − updated is the gradient FSDP applied, compared with the same "
      "single-process mean and sum as in section 3. Verdict \"mean\": every rank's applied gradient is within "
      "{tol:g} of the mean and not within {tol:g} of the sum (at N = 1 they are the same gradient).\n\n"
      "| N | global batch | max \\|Δ\\| to mean | max \\|Δ\\| to sum | between ranks | verdict |\n"
      "|---|---|---|---|---|---|\n",
      fmt::arg("tol", r.config.tolerance));
  for (const auto& d : r.ddp) {
    s += fmt::format("| {} | {} | {} | {} | {} | **{}**{} |\n", d.world_size, d.global_batch, sci2(d.fsdp_to_mean),
                     sci2(d.fsdp_to_sum), sci2(d.fsdp_between_ranks), d.fsdp_verdict,
                     d.fsdp_note.empty() ? "" : " (" + d.fsdp_note + ")");
  }
  return s + "\nThe difference to the mean includes the float32 rounding of initial − (initial − g).\n\n";
}

// The claims graded, in both languages, with the plot of every claim's two deviations.
std::string claims_section(const LabResults& r) {
  return fmt::format(
      "## 8. Claims, graded\n\nStatements made about sum or mean (the three answers to the question, and beliefs "
      "users repeat), each decided by the experiment named in `results.json` (`claims[].experiment`): the "
      "measurement's distance from what the claim predicts and from the alternative, against the tolerance.\n\n{}\n"
      "{}\n### 주장 판정 (한국어)\n\n질문에 대한 세 답변과 자주 반복되는 믿음을, 각각을 결정하는 실험의 측정값이 "
      "주장의 예측과 대안에서 얼마나 떨어져 있는지로 판정했습니다.\n\n{}\n",
      claims_markdown(r, "en"), plot(r, "claims.png", "every claim: distance from its prediction and from the alternative"),
      claims_markdown(r, "ko"));
}

std::string definitions() {
  return "## Definitions\n\n"
         "- **max |Δ|**: the largest absolute difference between two gradients over every element of every "
         "parameter, computed in float64 from the float32 gradients.\n"
         "- **mean** (DDP): the gradient of the per-sample mean loss over the whole global batch, computed in one "
         "process. **sum**: the sum over ranks of each rank's mean gradient on its share (N × mean for equal "
         "shares).\n"
         "- **sample mean** (uneven batches): the gradient of the per-sample mean loss over the whole global batch. "
         "**mean of rank means**: (1/N) × the sum over ranks of each rank's mean gradient on its share. "
         "**GlobalMean**: `Reduction::GlobalMean`, each rank's summed loss with the 1/T of the step's T samples "
         "folded into the bucket copy.\n"
         "- **max |Δ| to mean / to sum** in the DDP rows: the largest over ranks / the smallest over ranks, so that "
         "the verdict holds on every rank. **between ranks**: the largest difference from rank 0's synchronised "
         "gradient.\n"
         "- **before sync**: the rank's gradient from a forward and backward pass under `no_sync()` on its own share; "
         "**vs own shard**: its difference from the same shard's gradient computed in this process.\n"
         "- **step-0 loss**: the loss of the first batch, before any update; **final loss**: the last step's.\n"
         "- **sum / mean**: step-0 loss with `--loss-reduction sum` divided by the one with `mean` (B if the loss "
         "is a per-sample mean).\n\n";
}

}  // namespace

std::string markdown_cell(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

std::string report_markdown(const LabResults& r) {
  const auto& c = r.config;
  std::string s = fmt::format(
      "# Sum or mean? — gradsync lab report\n\n"
      "`gradsync lab{}` — {} run, data `{}` ({} samples), model `{}`, seed {}, DDP world sizes {}; {:.0f} s.\n"
      "Two gradients count as equal when max |Δ| over every element is below {:g}.\n\n"
      "## Results\n\n| experiment | measured | verdict |\n|---|---|---|\n",
      c.quick ? " --quick" : "", c.quick ? "quick" : "full", c.data, r.dataset_size, c.model, c.seed,
      fmt::join(c.world_sizes, ", "), r.seconds, c.tolerance);
  for (const auto& row : result_rows(r)) {
    s += fmt::format("| {} | {} | {} |\n", markdown_cell(row[0]), markdown_cell(row[1]), markdown_cell(row[2]));
  }
  s += "\n";
  s += loss_section(r) + accumulation_section(r) + ddp_section(r) + uneven_section(r);
  s += sharded_section(r) + tokens_section(r) + batch_norm_section(r) + claims_section(r);
  s += fmt::format("## Answer\n\n{}\n\n", fmt::join(answer_paragraphs(r, "en"), "\n\n"));
  s += fmt::format("## 답변 (한국어)\n\n{}\n\n", fmt::join(answer_paragraphs(r, "ko"), "\n\n"));
  s += definitions();
  s += "## Files\n\n";
  for (const auto& f : r.files) s += fmt::format("- `{}`\n", f);
  return s;
}

}  // namespace gradsync::cli
