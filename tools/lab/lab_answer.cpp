// The answer to the learner's question (see lab.h), written from the lab's verdicts and numbers, in English and in
// Korean (the language the question was asked in). A paragraph never claims more than its verdict: when a
// measurement matched neither hypothesis, the paragraph says that instead.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "lab/lab.h"

namespace gradsync::cli {
namespace {

std::vector<int> multi_rank_sizes(const LabResults& r) {
  std::vector<int> sizes;
  for (const auto& d : r.ddp) {
    if (d.world_size >= 2) sizes.push_back(d.world_size);
  }
  return sizes;
}

std::string loss_answer(const LabResults& r, bool ko) {
  const auto& l = r.loss;
  std::vector<std::string> batches, losses;
  for (const auto& run : l.runs) {
    batches.push_back(std::to_string(run.batch));
    losses.push_back(fmt::format("{:.3f}", run.step0_mean()));
  }
  const auto b = fmt::format("{}", fmt::join(batches, ", "));
  const auto v = fmt::format("{}", fmt::join(losses, ", "));
  const auto err = fmt::format("{:.1e}", l.ratio_error);
  if (l.verdict != "per-sample mean") {
    return ko ? fmt::format("loss 측정으로는 판단할 수 없습니다: B = {}에서 step 0 loss는 각각 {}, sum/mean과 B의 "
                            "상대 차이는 최대 {}.", b, v, err)
              : fmt::format("The loss measurements are inconclusive: step-0 losses {} at B = {}; sum/mean differs "
                            "from B by up to {} (relative).", v, b, err);
  }
  return ko ? fmt::format("loss는 샘플당 평균입니다: B = {}에서 step 0의 loss는 거의 같았고(각각 {}), 합으로 구한 "
                          "loss(--loss-reduction sum)는 B배였습니다(sum/mean과 B의 상대 차이 최대 {}). 그래서 배치 "
                          "크기를 바꿔도 loss의 크기는 변하지 않습니다.", b, v, err)
            : fmt::format("The loss is a per-sample mean: at step 0 it was {} for B = {}, while the summed loss "
                          "(--loss-reduction sum) was B times larger (sum/mean differs from B by at most {}, "
                          "relative). That is why the loss does not change size with the batch.", v, b, err);
}

std::string accumulation_answer(const LabResults& r, bool ko) {
  const auto& a = r.accumulation;
  if (a.raw_verdict != "sum" || a.scaled_verdict != "mean") {
    return ko ? fmt::format("accumulation 측정 결과가 예상과 다릅니다: 나누지 않은 경우 {}, loss/K의 경우 {}.",
                            a.raw_verdict, a.scaled_verdict)
              : fmt::format("Accumulation did not behave as expected: raw {}, loss/K {}.", a.raw_verdict,
                            a.scaled_verdict);
  }
  return ko ? fmt::format("gradient는 더해집니다: backward를 K = {}번 호출한 뒤 .grad는 전체 배치 평균 gradient의 "
                          "{:.3f}배, 즉 micro-batch gradient들의 합이었고 아무것도 이를 나누지 않습니다. 각 micro-batch의 "
                          "loss를 K로 나누면(gradsync::accumulate) 전체 배치 평균 gradient와 같아졌습니다(최대 |차이| {}). "
                          "loss를 나누지 않는 accumulation 코드는 K배 큰 gradient로 학습하며, SGD에서는 learning rate를 "
                          "K배 키운 것과 같습니다.", a.micro_batches, a.raw_ratio, sci(a.scaled_to_mean))
            : fmt::format("Gradients add up: after K = {} backward passes .grad was {:.3f} times the full-batch mean "
                          "gradient, the sum of the micro-batch gradients, and nothing divides it. Dividing each "
                          "micro-batch loss by K (gradsync::accumulate) gave the full-batch mean gradient (max |diff| "
                          "{}). Accumulation code that does not divide trains on a K times larger gradient: with SGD, "
                          "the same as a K times larger learning rate.", a.micro_batches, a.raw_ratio,
                          sci(a.scaled_to_mean));
}

std::string ddp_answer(const LabResults& r, bool ko) {
  const auto sizes = multi_rank_sizes(r);
  if (sizes.empty()) {
    return ko ? "world size 1만 측정했습니다. 이때는 합과 평균이 같은 gradient이므로 구별할 수 없습니다: "
                "--world-sizes 1,2,4로 실행하세요."
              : "Only world size 1 was measured, where the sum and the mean are the same gradient: run with "
                "--world-sizes 1,2,4 to tell them apart.";
  }
  double to_mean = 0, to_sum = INFINITY, before = 0;
  std::vector<std::string> wrong;
  for (const auto& d : r.ddp) {
    if (d.world_size < 2) continue;
    to_mean = std::max(to_mean, d.to_mean);
    to_sum = std::min(to_sum, d.to_sum);
    for (const auto& g : d.ranks) before = std::max(before, g.local_to_mean);
    if (d.verdict != "mean") wrong.push_back(fmt::format("N={}: {}", d.world_size, d.verdict));
  }
  const auto ns = fmt::format("{}", fmt::join(sizes, ", "));
  if (!wrong.empty()) {
    return ko ? fmt::format("이번 실행에서 DDP가 모든 경우에 평균을 내지는 않았습니다: {}.", fmt::join(wrong, "; "))
              : fmt::format("DDP did not average in every run: {}.", fmt::join(wrong, "; "));
  }
  return ko ? fmt::format("DDP는 평균을 냅니다: 프로세스 N = {}개에서 동기화된 gradient는 같은 global batch를 한 "
                          "프로세스에서 계산한 평균 gradient와 같았고(최대 |차이| {} 이하), 각 rank gradient의 합과는 "
                          "달랐습니다(최대 |차이| {} 이상). 동기화 전 rank별 gradient는 평균과 최대 {}만큼 달랐습니다. "
                          "N = 1에서는 합과 평균이 같은 값입니다.", ns, sci(to_mean), sci(to_sum), sci(before))
            : fmt::format("DDP averages: with N = {} ranks the synchronised gradient equalled the single-process mean "
                          "gradient on the same global batch (max |diff| at most {}) and not the sum of the ranks' "
                          "gradients (max |diff| at least {}); before synchronisation the ranks' gradients differed "
                          "from it by up to {}. At N = 1 the sum and the mean are the same.", ns, sci(to_mean),
                          sci(to_sum), sci(before));
}

std::string uneven_answer(const LabResults& r, bool ko) {
  if (r.uneven.empty()) return "";
  const auto& u = r.uneven.back();
  std::string mean_part;
  if (u.verdict != "mean of per-rank means") {
    mean_part = ko ? fmt::format("rank별 배치 크기가 다를 때(N = {}) Reduction::Mean을 쓴 DDP 결과는 {}였습니다.",
                                 u.world_size, u.verdict)
                   : fmt::format("With uneven per-rank batches (N = {}) DDP's Reduction::Mean gradient was: {}.",
                                 u.world_size, u.verdict);
  } else {
    mean_part = ko ? fmt::format("평균은 샘플이 아니라 rank에 대한 것입니다: rank마다 배치 크기가 다르면(N = {}: {}) "
                                 "DDP(Reduction::Mean)의 결과는 rank별 평균 gradient들의 평균이었고, 전체 샘플에 대한 "
                                 "평균과는 {}만큼 달랐습니다.", u.world_size, join_samples(u.samples),
                                 sci(u.to_global_mean))
                   : fmt::format("The mean is over ranks, not samples: with uneven per-rank batches (N = {}: {}) DDP "
                                 "(Reduction::Mean) gave the mean of the per-rank mean gradients, {} away from the mean "
                                 "over all samples.", u.world_size, join_samples(u.samples), sci(u.to_global_mean));
  }
  std::string global_part;
  if (u.global_verdict != "sample mean") {
    global_part = ko ? fmt::format(" 같은 분할에서 Reduction::GlobalMean의 결과는 {}였습니다(전체 샘플 평균과의 최대 "
                                   "|차이| {}).", u.global_verdict, sci(u.global_to_sample_mean))
                     : fmt::format(" On the same shares Reduction::GlobalMean gave: {} (max |diff| to the mean over all "
                                   "samples {}).", u.global_verdict, sci(u.global_to_sample_mean));
  } else {
    global_part = ko ? fmt::format(" 같은 분할에서 Reduction::GlobalMean(각 rank는 샘플 loss의 합을 backward하고, "
                                   "reducer가 전체 샘플 수 T = {}로 나눔)은 전체 샘플에 대한 평균 gradient를 냈습니다"
                                   "(최대 |차이| {}).", u.global_items, sci(u.global_to_sample_mean))
                     : fmt::format(" On the same shares Reduction::GlobalMean (each rank backpropagates its summed "
                                   "sample losses, the reducer divides by the step's T = {} samples) gave the mean over "
                                   "all samples (max |diff| {}).", u.global_items, sci(u.global_to_sample_mean));
  }
  return mean_part + global_part;
}

std::string sharded_answer(const LabResults& r, bool ko) {
  if (r.ddp.empty()) return "";
  double to_mean = 0, to_sum = INFINITY;
  std::vector<std::string> wrong;
  std::vector<int> all, multi;
  for (const auto& d : r.ddp) {
    all.push_back(d.world_size);
    to_mean = std::max(to_mean, d.fsdp_to_mean);
    if (d.world_size >= 2) {
      multi.push_back(d.world_size);
      to_sum = std::min(to_sum, d.fsdp_to_sum);
    }
    if (d.fsdp_verdict != "mean") wrong.push_back(fmt::format("N={}: {}", d.world_size, d.fsdp_verdict));
  }
  if (!wrong.empty()) {
    return ko ? fmt::format("샤딩(FSDP full-shard)이 모든 경우에 평균을 내지는 않았습니다: {}.", fmt::join(wrong, "; "))
              : fmt::format("Sharded FSDP (full shard) did not average in every run: {}.", fmt::join(wrong, "; "));
  }
  const auto ns = fmt::format("{}", fmt::join(all, ", "));
  if (multi.empty()) {
    return ko ? fmt::format("샤딩(FSDP full-shard, N = {})이 적용한 gradient는 한 프로세스의 평균 gradient와 같았습니다"
                            "(최대 |차이| {}). N = 1에서는 합과 평균이 같은 값입니다.", ns, sci(to_mean))
              : fmt::format("Sharded FSDP (full shard, N = {}) applied the single-process mean gradient (max |diff| "
                            "{}); at N = 1 the sum and the mean are the same.", ns, sci(to_mean));
  }
  return ko ? fmt::format("샤딩도 평균을 냅니다: FullyShardedDataParallel(FullShard, ZeRO-3)로 N = {}에서 SGD 한 "
                          "step(lr = 1)을 밟은 뒤, 처음 파라미터에서 갱신된 파라미터(state_dict())를 뺀 gradient는 한 "
                          "프로세스의 평균 gradient와 같았고(최대 |차이| {} 이하), rank gradient의 합과는 달랐습니다"
                          "(N ≥ 2에서 최대 |차이| {} 이상). 각 rank는 자기 shard만 갱신하지만 그 shard의 gradient는 "
                          "1/N을 곱한 뒤 SUM reduce-scatter한 평균입니다.", ns, sci(to_mean), sci(to_sum))
            : fmt::format("Sharding averages too: with FullyShardedDataParallel (FullShard, ZeRO-3) at N = {}, one SGD "
                          "step (lr = 1) moved the parameters (gathered with state_dict()) by the single-process mean "
                          "gradient (max |diff| at most {}), not by the sum of the ranks' gradients (max |diff| at least "
                          "{} for N >= 2). Each rank updates only its shard, but that shard's gradient is x 1/N then a "
                          "SUM reduce-scatter: a mean over ranks.", ns, sci(to_mean), sci(to_sum));
}

}  // namespace

std::vector<std::string> answer_paragraphs(const LabResults& r, const std::string& language) {
  const bool ko = language == "ko";
  std::vector<std::string> parts{loss_answer(r, ko), accumulation_answer(r, ko), ddp_answer(r, ko),
                                 uneven_answer(r, ko), sharded_answer(r, ko), tokens_answer(r, ko),
                                 batch_norm_answer(r, ko)};
  parts.erase(std::remove(parts.begin(), parts.end(), std::string()), parts.end());
  return parts;
}

std::string answer_text(const LabResults& r, const std::string& language) {
  return fmt::format("{}", fmt::join(answer_paragraphs(r, language), "\n"));
}

}  // namespace gradsync::cli
