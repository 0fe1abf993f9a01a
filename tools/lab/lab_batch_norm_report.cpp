// The BatchNorm experiment in the lab's outputs (see lab_batch_norm.cpp): table rows, the report section and the
// answer paragraph in English and Korean. Its two claims are graded with the others (lab_claims.cpp).
#include <algorithm>

#include <fmt/format.h>

#include "lab/lab.h"

namespace gradsync::cli {

std::vector<ResultRow> batch_norm_rows(const LabResults& r) {
  std::vector<ResultRow> rows;
  const double tol = r.config.tolerance;
  for (const auto& b : r.batch_norm.rows) {
    rows.push_back({fmt::format("BatchNorm under DDP, N={} ({})", b.world_size, join_samples(b.equal_samples)),
                    fmt::format("running stats vs averaged over ranks {}, vs rank 0's own {}", sci(b.ddp_to_averaged),
                                sci(b.ddp_to_rank0)),
                    b.ddp_to_rank0 <= tol && b.ddp_to_averaged > tol ? "rank 0's own" : "neither"});
    rows.push_back({fmt::format("SyncBatchNorm, N={} ({})", b.world_size, join_samples(b.uneven_samples)),
                    fmt::format("running stats vs count-weighted {}, vs plain mean over ranks {}",
                                sci(b.sync_to_weighted), sci(b.sync_to_plain_mean)),
                    b.sync_to_weighted <= tol && b.sync_to_plain_mean > tol ? "count-weighted" : "neither"});
  }
  return rows;
}

std::string batch_norm_section(const LabResults& r) {
  if (r.batch_norm.rows.empty()) return "";
  std::string s = fmt::format(
      "## 7. BatchNorm statistics\n\n"
      "`{}`, one step of `gradsync train` in float64 without shuffling, so the lab knows every rank's samples and "
      "computes their statistics at the first BatchNorm itself. Figures are ||s − p||₂ / ||p||₂ between the running "
      "mean and variance rank 0 saved (s) and a prediction (p): BatchNorm's update from (0, 1) with momentum 0.1.\n\n"
      "| N | plain BatchNorm under DDP (samples) | vs averaged over ranks | vs rank 0's own | --sync-bn (samples) | "
      "vs count-weighted | vs plain mean over ranks |\n|---|---|---|---|---|---|---|\n",
      r.batch_norm.model);
  for (const auto& b : r.batch_norm.rows) {
    s += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", b.world_size, join_samples(b.equal_samples),
                     sci(b.ddp_to_averaged), sci(b.ddp_to_rank0), join_samples(b.uneven_samples),
                     sci(b.sync_to_weighted), sci(b.sync_to_plain_mean));
  }
  return s + "\nUnder DDP each rank normalises with its own batch and keeps its own running statistics; rank 0's are "
             "broadcast before the next forward, so rank 0's are the ones that survive. SyncBatchNorm gathers every "
             "rank's count, mean and variance and combines them weighted by count: the union's statistics.\n\n";
}

std::string batch_norm_answer(const LabResults& r, bool ko) {
  if (r.batch_norm.rows.empty()) return "";
  double ddp_rank0 = 0, ddp_avg = 1e300, sync_w = 0, sync_plain = 1e300;
  for (const auto& b : r.batch_norm.rows) {
    ddp_rank0 = std::max(ddp_rank0, b.ddp_to_rank0);
    ddp_avg = std::min(ddp_avg, b.ddp_to_averaged);
    sync_w = std::max(sync_w, b.sync_to_weighted);
    sync_plain = std::min(sync_plain, b.sync_to_plain_mean);
  }
  return ko ? fmt::format("BatchNorm 통계는 DDP에서 평균 내지 않습니다. 각 rank가 자기 배치로 정규화하고, 다음 forward "
                          "전에 rank 0의 running 통계가 broadcast됩니다: 저장된 값은 rank 0의 것과 {} 차이, rank 평균과는 "
                          "최소 {} 차이였습니다. SyncBatchNorm(--sync-bn)은 rank별 개수로 가중합니다: 불균등한 rank에서 "
                          "개수 가중 통계와 {}, 단순 평균과는 최소 {} 차이였습니다.",
                          sci(ddp_rank0), sci(ddp_avg), sci(sync_w), sci(sync_plain))
            : fmt::format("BatchNorm statistics are not averaged under DDP: each rank normalises with its own batch, "
                          "and rank 0's running statistics are broadcast before the next forward; the saved ones were "
                          "{} from rank 0's own and at least {} from the ranks' average. SyncBatchNorm (--sync-bn) "
                          "weights each rank by its count: on uneven ranks it was {} from the count-weighted statistics "
                          "and at least {} from their plain mean.",
                          sci(ddp_rank0), sci(ddp_avg), sci(sync_w), sci(sync_plain));
}

}  // namespace gradsync::cli
