// The claims table of `gradsync lab` (see ClaimResult in lab.h): statements people make about whether
// data-parallel gradients sum or average, each graded by the experiment that decides it.
//
// Claims are data: kClaims below holds one entry per statement (who made it, its text in English and Korean, the
// experiment, and how to read that experiment's figures as cases). A case is one measurement with two deviations:
// from what the claim predicts and from the alternative. A claim is true when every case lies within the tolerance
// of its prediction and outside that of the alternative, false when every case says the reverse, "true only when
// ..." when the cases it names as its condition agree with it and the others do not, else inconclusive.
#include <algorithm>
#include <functional>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "lab/lab.h"

namespace gradsync::cli {
namespace {

struct Case {
  std::string label;  // "N=2"
  double to_claim = 0;
  double to_alternative = 0;
  bool in_condition = true;  // for conditional claims: a case where the claim is said to hold
};

struct ClaimSpec {
  const char* id;
  const char* source;
  const char* claim_en;
  const char* claim_ko;
  const char* experiment;
  const char* condition_en;  // nullptr unless the claim holds only in some cases
  const char* condition_ko;
  std::function<std::vector<Case>(const LabResults&)> cases;
};

// The measurements with more than one rank (at one rank the sum and the mean are the same gradient).
template <typename Fn>
std::vector<Case> per_world(const LabResults& r, Fn&& fn) {
  std::vector<Case> out;
  for (const auto& d : r.ddp) {
    if (d.world_size >= 2) out.push_back(fn(d));
  }
  return out;
}

std::vector<Case> ddp_mean_cases(const LabResults& r) {
  return per_world(r, [](const DdpResult& d) {
    return Case{fmt::format("N={}", d.world_size), d.to_mean, d.to_sum};
  });
}

std::vector<Case> ddp_fsdp_sum_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& d : r.ddp) {
    if (d.world_size < 2) continue;
    out.push_back({fmt::format("DDP N={}", d.world_size), d.to_sum, d.to_mean});
    out.push_back({fmt::format("FSDP N={}", d.world_size), d.fsdp_to_sum, d.fsdp_to_mean});
  }
  return out;
}

std::vector<Case> fsdp_mean_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& d : r.ddp) {
    if (d.world_size < 2) continue;
    const auto& a = d.fsdp_accumulation;
    out.push_back({fmt::format("N={}", d.world_size), d.fsdp_to_mean, d.fsdp_to_sum});
    out.push_back({fmt::format("N={} K={} no_sync", d.world_size, a.micro_batches), a.full_to_mean, a.full_to_sum});
    out.push_back({fmt::format("N={} K={} per micro-step", d.world_size, a.micro_batches), a.sharded_to_mean,
                   a.sharded_to_sum});
  }
  return out;
}

// The summed loss's gradient is B times a mean gradient: its deviations are relative to its scale.
std::vector<Case> summed_loss_cases(const LabResults& r) {
  return per_world(r, [](const DdpResult& d) {
    const auto& s = d.summed_loss;
    const double scale = std::max(s.max_abs, std::numeric_limits<double>::min());
    return Case{fmt::format("N={} (relative)", d.world_size), s.to_sum / scale, s.to_sum_over_n / scale};
  });
}

std::vector<Case> weighted_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& u : r.uneven) out.push_back({fmt::format("N={}", u.world_size), u.to_global_mean, u.to_mean_of_means});
  return out;
}

std::vector<Case> more_samples_cases(const LabResults& r) {
  std::vector<Case> out = weighted_cases(r);
  for (auto& c : out) c.in_condition = false;
  for (const auto& u : r.uneven) {
    out.push_back({fmt::format("N={} GlobalMean", u.world_size), u.global_to_sample_mean, u.global_to_mean_of_means});
  }
  return out;
}

std::vector<Case> loss_sum_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& run : r.loss.runs) {
    // Relative: the default loss against the summed loss, and against the summed loss / B (a per-sample mean).
    const double sum = run.step0_sum, per_sample = run.step0_sum / static_cast<double>(run.batch);
    out.push_back({fmt::format("B={} (relative)", run.batch), std::abs(run.step0_mean() - sum) / std::abs(sum),
                   std::abs(run.step0_mean() - per_sample) / std::abs(per_sample)});
  }
  return out;
}

std::vector<Case> no_division_cases(const LabResults& r) {
  const auto& a = r.accumulation;
  return {{fmt::format("K={}", a.micro_batches), a.raw_to_mean, a.raw_to_sum}};
}

std::vector<Case> divided_cases(const LabResults& r) {
  const auto& a = r.accumulation;
  return {{fmt::format("K={} equal", a.micro_batches), a.divided_to_mean, a.divided_to_raw},
          {fmt::format("K={} unequal", a.micro_batches), a.unequal_divided_to_mean, a.unequal_divided_to_micro_means,
           false}};
}

// Relative gradient distances of the tokens experiment: (a) against the token mean of the step (claim) and against
// the mean of token means its weights predict (the alternative), where (a) is a mean of more than one token mean.
std::vector<Case> token_mean_cases(const LabResults& r, bool over_micro_batches) {
  std::vector<Case> out;
  for (const auto& t : r.tokens.rows) {
    if ((over_micro_batches ? t.accumulate : t.world_size) < 2) continue;
    out.push_back({fmt::format("N={} K={} (relative)", t.world_size, t.accumulate), t.mean_of_means_rel_diff,
                   t.mean_of_means_to_prediction});
  }
  return out;
}

std::vector<Case> token_global_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& t : r.tokens.rows) {
    out.push_back({fmt::format("N={} K={} (relative)", t.world_size, t.accumulate), t.global_mean_rel_diff,
                   t.global_mean_to_prediction});
  }
  return out;
}

// The BatchNorm experiment: DDP's saved running statistics against the ranks' average (claim) and rank 0's own.
std::vector<Case> bn_averaged_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& b : r.batch_norm.rows) {
    out.push_back({fmt::format("N={} (relative)", b.world_size), b.ddp_to_averaged, b.ddp_to_rank0});
  }
  return out;
}

// SyncBatchNorm on uneven ranks: against the count-weighted statistics (claim) and the plain mean over ranks.
std::vector<Case> sync_bn_weighted_cases(const LabResults& r) {
  std::vector<Case> out;
  for (const auto& b : r.batch_norm.rows) {
    out.push_back({fmt::format("N={} {} (relative)", b.world_size, join_samples(b.uneven_samples)), b.sync_to_weighted,
                   b.sync_to_plain_mean});
  }
  return out;
}

// The claims about BatchNorm's statistics, decided by the BatchNorm experiment.
std::vector<ClaimSpec> batch_norm_claims() {
  return {
      {"ddp-bn-averaged", "common belief", "Under DDP, BatchNorm statistics are averaged over the processes.",
       "DDP에서 BatchNorm 통계는 프로세스들에 대해 평균된다.",
       "mlp-bn under DDP, equal ranks of 8, one step: the running statistics rank 0 saved, relative distance to the "
       "ranks' averaged statistics (claim) and to rank 0's own",
       nullptr, nullptr, bn_averaged_cases},
      {"sync-bn-weighted", "gradsync",
       "SyncBatchNorm weights each process by its batch size.",
       "SyncBatchNorm은 각 프로세스를 배치 크기로 가중한다.",
       "mlp-bn with --sync-bn on uneven ranks, one step: the running statistics, relative distance to the "
       "count-weighted statistics of the union (claim) and to the plain mean of the ranks' statistics",
       nullptr, nullptr, sync_bn_weighted_cases},
  };
}

// The claims about images and per-sample means, decided by the other experiments.
std::vector<ClaimSpec> sum_or_mean_claims() {
  return {
      {"ddp-averages", "answer 1", "DDP averages the per-process gradients internally; no user code is needed.",
       "DDP는 프로세스별 gradient를 내부에서 평균 낸다; 사용자 코드는 필요 없다.",
       "DDP on equal shares vs one process on the global batch: distance to the mean (claim) and to the sum",
       nullptr, nullptr, ddp_mean_cases},
      {"ddp-sums", "answer 2", "DDP and FSDP sum the per-process gradients.",
       "DDP와 FSDP는 프로세스별 gradient를 합한다.",
       "DDP and FSDP (full shard) on equal shares: distance to the sum of the ranks' gradients (claim) and to the mean",
       nullptr, nullptr, ddp_fsdp_sum_cases},
      {"loss-sums", "answer 2", "Mini-batch gradient descent sums the losses of the samples.",
       "미니배치 경사하강법은 샘플들의 loss를 합한다.",
       "step-0 loss of the default loss at B = 256..4096: relative distance to the summed loss (claim) and to it / B",
       nullptr, nullptr, loss_sum_cases},
      {"weighted-by-batch", "answer 3",
       "In practice processes are weighted by their batch size, like a weighted mean.",
       "실제로는 프로세스가 배치 크기에 따라 가중된다(가중 평균처럼).",
       "DDP (Reduction::Mean) on uneven shares: distance to the sample-weighted mean (claim) and to the mean of the "
       "ranks' means",
       nullptr, nullptr, weighted_cases},
      {"no-division", "common belief", "Gradient accumulation needs no division.",
       "gradient accumulation에는 나눗셈이 필요 없다.",
       "K backward passes without scaling: distance to the full-batch mean gradient (claim) and to K times it",
       nullptr, nullptr, no_division_cases},
      {"deepspeed-divides", "common belief",
       "DeepSpeed divides by the accumulation steps, which gives the mean gradient of the accumulated samples.",
       "DeepSpeed는 accumulation step 수로 나누며, 그러면 누적된 샘플의 평균 gradient가 된다.",
       "accumulated .grad divided by K (DeepSpeed's division by gradient_accumulation_steps, done here in one "
       "process): distance to the mean over all samples (claim) and to the undivided sum (equal micro-batches) or to "
       "the mean of the micro-batch means (unequal)",
       "every micro-batch holds the same number of samples", "모든 micro-batch의 샘플 수가 같을 때",
       divided_cases},
      {"fsdp-averages", "common belief", "FSDP averages like DDP.", "FSDP도 DDP처럼 평균을 낸다.",
       "FSDP (full shard) on equal shares, also accumulating K micro-batches in both modes: distance to the "
       "single-process mean (claim) and to the sum",
       nullptr, nullptr, fsdp_mean_cases},
      {"more-samples-count-more", "common belief", "Ranks with more samples count more.",
       "샘플이 많은 rank가 더 큰 비중을 갖는다.",
       "uneven shares, Reduction::Mean and Reduction::GlobalMean: distance to the sample-weighted mean (claim) and to "
       "the mean of the ranks' means",
       "the reduction is Reduction::GlobalMean (DDP's default Mean weighs every rank equally)",
       "reduction이 Reduction::GlobalMean일 때 (DDP 기본값 Mean은 모든 rank를 같은 비중으로 다룸)", more_samples_cases},
      {"summed-loss-sums", "common belief",
       "With losses summed over samples, DDP's gradient is the sum over all samples.",
       "샘플에 대해 합한 loss를 쓰면 DDP의 gradient는 전체 샘플에 대한 합이다.",
       "DDP with each rank's loss summed over its share: relative distance to the gradient of the summed loss of "
       "the global batch (claim) and to it / N",
       nullptr, nullptr, summed_loss_cases},
  };
}

// The claims about language models, decided by the tokens experiment.
std::vector<ClaimSpec> token_claims() {
  return {
      {"token-mean-over-k", "common belief",
       "Dividing each micro-batch's token-mean loss by K gives the full-batch gradient of a language model.",
       "각 micro-batch의 token 평균 loss를 K로 나누면 언어 모델의 전체 배치 gradient가 된다.",
       "gpt on fortunes, K micro-batches of ragged token counts: relative distance to one process's token mean over "
       "the step (claim) and to the mean of token means its weights predict",
       nullptr, nullptr, [](const LabResults& r) { return token_mean_cases(r, true); }},
      {"ddp-token-mean", "common belief",
       "Under DDP, averaging the ranks' token-mean losses gives the token mean over all ranks.",
       "DDP에서 rank별 token 평균 loss를 평균 내면 모든 rank에 대한 token 평균이 된다.",
       "gpt on fortunes, N ranks of ragged token counts: relative distance to one process's token mean over the "
       "step (claim) and to the mean of token means its weights predict",
       nullptr, nullptr, [](const LabResults& r) { return token_mean_cases(r, false); }},
      {"global-mean-tokens", "gradsync",
       "Summing token losses and dividing by the step's valid tokens over all ranks and micro-batches "
       "(Reduction::GlobalMean) gives the full-batch token-mean gradient.",
       "token loss를 합하고 모든 rank와 micro-batch의 유효 token 수로 나누면(Reduction::GlobalMean) 전체 배치의 "
       "token 평균 gradient가 된다.",
       "gpt on fortunes at (N, K) = (1, 4), (2, 2), (4, 1): relative distance to one process's token mean (claim) "
       "and to the mean of token means",
       nullptr, nullptr, token_global_cases},
  };
}

const std::vector<ClaimSpec>& claims() {
  static const std::vector<ClaimSpec> table = [] {
    std::vector<ClaimSpec> all = sum_or_mean_claims();
    for (auto& c : token_claims()) all.push_back(std::move(c));
    for (auto& c : batch_norm_claims()) all.push_back(std::move(c));
    return all;
  }();
  return table;
}


bool supports(const Case& c, double tol) { return c.to_claim <= tol && c.to_alternative > tol; }
bool refutes(const Case& c, double tol) { return c.to_alternative <= tol && c.to_claim > tol; }

// Every case agrees with `agree` (and those outside the condition with `disagree`).
template <typename Agree, typename Disagree>
bool all_cases(const std::vector<Case>& cases, Agree&& agree, Disagree&& disagree) {
  return std::all_of(cases.begin(), cases.end(),
                     [&](const Case& c) { return c.in_condition ? agree(c) : disagree(c); });
}

void set_verdict(ClaimResult& out, const ClaimSpec& spec, const std::vector<Case>& cases, double tol) {
  auto yes = [tol](const Case& c) { return supports(c, tol); };
  auto no = [tol](const Case& c) { return refutes(c, tol); };
  const bool conditional = spec.condition_en != nullptr;
  if (cases.empty()) {
    out.verdict = "inconclusive (no measurement: the lab ran without the world sizes this needs)";
    out.verdict_ko = "판정 불가 (필요한 world size로 측정하지 않음)";
  } else if (conditional && all_cases(cases, yes, no)) {
    out.verdict = fmt::format("true only when {}", spec.condition_en);
    out.verdict_ko = fmt::format("조건부 참: {}", spec.condition_ko);
  } else if (!conditional && std::all_of(cases.begin(), cases.end(), yes)) {
    out.verdict = "true";
    out.verdict_ko = "참";
  } else if (std::all_of(cases.begin(), cases.end(), no)) {
    out.verdict = "false";
    out.verdict_ko = "거짓";
  } else {
    out.verdict = "inconclusive";
    out.verdict_ko = "판정 불가";
  }
}

// The deviations that back the verdict, conservatively: for "false" the claim's closest case and the
// alternative's farthest; otherwise (within the condition) the claim's farthest and the alternative's closest.
void set_deviations(ClaimResult& out, const std::vector<Case>& cases) {
  const bool refuted = out.verdict == "false";
  out.deviation_true = refuted ? std::numeric_limits<double>::infinity() : 0;
  out.deviation_false = refuted ? 0 : std::numeric_limits<double>::infinity();
  for (const auto& c : cases) {
    if (!refuted && !c.in_condition) continue;
    out.deviation_true = refuted ? std::min(out.deviation_true, c.to_claim) : std::max(out.deviation_true, c.to_claim);
    out.deviation_false =
        refuted ? std::max(out.deviation_false, c.to_alternative) : std::min(out.deviation_false, c.to_alternative);
  }
  if (cases.empty()) out.deviation_true = out.deviation_false = 0;
}

}  // namespace

std::vector<ClaimResult> grade_claims(const LabResults& r) {
  const double tol = r.config.tolerance;
  std::vector<ClaimResult> out;
  for (const auto& spec : claims()) {
    ClaimResult c{spec.id, spec.source, spec.claim_en, spec.claim_ko, spec.experiment, "", 0, 0, tol, "", ""};
    const auto cases = spec.cases(r);
    std::vector<std::string> parts;
    for (const auto& k : cases) parts.push_back(fmt::format("{}: {:.1e} vs {:.1e}", k.label, k.to_claim, k.to_alternative));
    c.measured = fmt::format("{}", fmt::join(parts, "; "));
    set_verdict(c, spec, cases, tol);
    set_deviations(c, cases);
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace gradsync::cli
