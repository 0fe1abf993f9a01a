// The claims table in every form the lab writes (see lab_claims.cpp for how claims are graded): terminal table,
// JSON, claims.csv and claims.dat, the claims.png plot, and the report.md section in English and Korean.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "lab/lab.h"

namespace gradsync::cli {
namespace {

std::string csv_cell(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

// "true", "false", "conditional" or "inconclusive": what fits under a plot's bar.
std::string short_verdict(const std::string& verdict) {
  if (verdict.rfind("true only", 0) == 0) return "conditional";
  return verdict.substr(0, verdict.find(' '));
}

}  // namespace

std::string claims_table(const LabResults& r) {
  std::string out = "\nclaims (distance of the measurement from what the claim predicts vs from the alternative):\n";
  for (const auto& c : r.claims) {
    out += fmt::format("  [{}] {} ({})\n      {}: {} vs {} -- {}\n", c.verdict, c.claim_en, c.source, c.id,
                       sci(c.deviation_true), sci(c.deviation_false), c.measured);
  }
  return out;
}

nlohmann::ordered_json claims_json(const LabResults& r) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& c : r.claims) {
    out.push_back({{"id", c.id},
                   {"source", c.source},
                   {"claim", c.claim_en},
                   {"claim_ko", c.claim_ko},
                   {"experiment", c.experiment},
                   {"measured", c.measured},
                   {"deviation_from_claim", c.deviation_true},
                   {"deviation_from_alternative", c.deviation_false},
                   {"tolerance", c.tolerance},
                   {"verdict", c.verdict},
                   {"verdict_ko", c.verdict_ko}});
  }
  return out;
}

// claims.csv (every field) and claims.dat (what the plot draws: one row per claim).
std::pair<std::string, std::string> claims_data(const LabResults& r) {
  std::string csv = "id,source,claim,verdict,deviation_from_claim,deviation_from_alternative,tolerance,measured\n";
  std::string dat = "# id deviation_from_claim deviation_from_alternative\n";
  for (const auto& c : r.claims) {
    csv += fmt::format("{},{},{},{},{},{},{},{}\n", c.id, csv_cell(c.source), csv_cell(c.claim_en),
                       csv_cell(c.verdict), c.deviation_true, c.deviation_false, c.tolerance, csv_cell(c.measured));
    dat += fmt::format("\"{} ({})\" {} {}\n", c.id, short_verdict(c.verdict), c.deviation_true, c.deviation_false);
  }
  return {csv, dat};
}

// Appended to plots.gp after the other plots (their log scale and helpers v(), txt() are still set).
std::string claims_gnuplot(const LabResults& r) {
  return fmt::format(R"gp(
set output "claims.png"
set terminal push
set size 1,1
set title "Each claim: how far the measurement is from what the claim predicts, and from the alternative"
set xlabel ""
set ylabel "max |diff| (relative where the row says so)"
set xtics rotate by -30 font ",9"
set bmargin 9
set yrange [floor:1000]
set key top center horizontal
set label 1 "a claim is true when its red bar is under the tolerance and its blue bar above; false the other way round" at screen 0.02, screen 0.03
plot "claims.dat" using ($0-0.19):(v($2)):xtic(1) with boxes lc rgb "#c53030" title "from what the claim predicts", \
     "" using ($0+0.19):(v($3)) with boxes lc rgb "#2b6cb0" title "from the alternative", \
     {tol:g} with lines dt 2 lw 2 lc rgb "black" title "tolerance {tol:g}"
)gp",
                     fmt::arg("tol", r.config.tolerance));
}

std::string source_ko(const std::string& source) {
  if (source.rfind("answer ", 0) == 0) return "답변 " + source.substr(7);
  return source == "common belief" ? "흔한 믿음" : source;
}

std::string claims_markdown(const LabResults& r, const std::string& language) {
  const bool ko = language == "ko";
  std::string out = ko ? "| 주장 | 출처 | 판정 | 주장과의 거리 | 대안과의 거리 | 측정 |\n|---|---|---|---|---|---|\n"
                       : "| claim | source | verdict | from the claim | from the alternative | measured |\n"
                         "|---|---|---|---|---|---|\n";
  for (const auto& c : r.claims) {
    out += fmt::format("| {} | {} | **{}** | {} | {} | {} |\n", markdown_cell(ko ? c.claim_ko : c.claim_en),
                       ko ? source_ko(c.source) : c.source,
                       markdown_cell(ko ? c.verdict_ko : c.verdict), sci(c.deviation_true), sci(c.deviation_false),
                       markdown_cell(c.measured));
  }
  return out;
}

std::vector<ResultRow> claim_experiment_rows(const LabResults& r) {
  const auto& a = r.accumulation;
  std::vector<ResultRow> rows{
      {fmt::format("accumulate, .grad / K={} after", a.micro_batches),
       fmt::format("max |diff| to loss / K {}, to the full-batch mean {}, to the undivided sum {}",
                   sci(a.divided_to_scaled), sci(a.divided_to_mean), sci(a.divided_to_raw)),
       a.divided_verdict},
      {fmt::format("accumulate, unequal ({}), .grad / K", join_samples(a.unequal_sizes)),
       fmt::format("max |diff| to the sample mean {}, to the mean of micro-batch means {}; summed / total {}",
                   sci(a.unequal_divided_to_mean), sci(a.unequal_divided_to_micro_means), sci(a.unequal_global_to_mean)),
       a.unequal_divided_verdict}};
  for (const auto& d : r.ddp) {
    const auto& f = d.fsdp_accumulation;
    rows.push_back({fmt::format("FSDP full-shard, N={}, K={} x {}", d.world_size, f.micro_batches, f.micro_batch),
                    fmt::format("no_sync: to mean {}, to sum {}; every micro-step: to mean {}, to sum {}",
                                sci(f.full_to_mean), sci(f.full_to_sum), sci(f.sharded_to_mean), sci(f.sharded_to_sum)),
                    f.verdict});
    const auto& s = d.summed_loss;
    rows.push_back({fmt::format("DDP, N={}, loss summed over samples", d.world_size),
                    fmt::format("max |diff| to (summed-loss gradient) / N {}, to the summed-loss gradient {} (scale {})",
                                sci(s.to_sum_over_n), sci(s.to_sum), sci(s.max_abs)),
                    s.verdict});
  }
  return rows;
}

}  // namespace gradsync::cli
