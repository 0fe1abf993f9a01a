// The lab's output (see lab.h): the terminal table, the JSON document, and the out directory: results.json, CSV
// files, gnuplot data, script and plots (report.md comes from lab_markdown.cpp, the answer from lab_answer.cpp).
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "lab/lab.h"
#include "launch/gnuplot.h"
#include "launch/spawn.h"

namespace gradsync::cli {
namespace fs = std::filesystem;

// ---- terminal table ----------------------------------------------------------------------------------------

std::string sci(double value) { return fmt::format("{:.1e}", value); }
std::string join_samples(const std::vector<int64_t>& samples) { return fmt::format("{}", fmt::join(samples, "+")); }

std::vector<ResultRow> result_rows(const LabResults& r) {
  std::vector<ResultRow> rows;
  for (const auto& run : r.loss.runs) {
    rows.push_back({fmt::format("loss, B={}", run.batch),
                    fmt::format("step-0 loss {:.4f}, summed {:.1f} = {:.2f} x; final {:.4f} after {} steps",
                                run.step0_mean(), run.step0_sum, run.sum_over_mean(), run.final_loss(),
                                run.losses.size()),
                    r.loss.verdict});
  }
  const auto& a = r.accumulation;
  rows.push_back({fmt::format("accumulate, K={} x {}", a.micro_batches, a.micro_batch),
                  fmt::format("|.grad| = {:.4f} x |full-batch mean grad|; max |diff| to K x mean {}", a.raw_ratio,
                              sci(a.raw_to_sum)),
                  a.raw_verdict});
  rows.push_back({"accumulate, loss / K",
                  fmt::format("max |diff| to the full-batch mean gradient {}", sci(a.scaled_to_mean)),
                  a.scaled_verdict});
  for (const auto& d : r.ddp) {
    double before = 0;
    for (const auto& g : d.ranks) before = std::max(before, g.local_to_mean);
    rows.push_back({fmt::format("DDP, N={} ({} x {})", d.world_size, d.world_size, d.global_batch / d.world_size),
                    fmt::format("max |diff| to 1-process mean {}, to sum {}; before sync {}", sci(d.to_mean),
                                sci(d.to_sum), sci(before)),
                    d.note.empty() ? d.verdict : fmt::format("{} ({})", d.verdict, d.note)});
  }
  for (const auto& u : r.uneven) {
    rows.push_back({fmt::format("uneven, N={} ({}), Mean", u.world_size, join_samples(u.samples)),
                    fmt::format("max |diff| to mean of rank means {}, to sample mean {}", sci(u.to_mean_of_means),
                                sci(u.to_global_mean)),
                    u.verdict});
    rows.push_back({fmt::format("uneven, N={}, GlobalMean", u.world_size),
                    fmt::format("max |diff| to sample mean {}, to mean of rank means {}; T = {}",
                                sci(u.global_to_sample_mean), sci(u.global_to_mean_of_means), u.global_items),
                    u.global_verdict});
  }
  for (const auto& d : r.ddp) {
    rows.push_back({fmt::format("sharded FSDP full-shard, N={} ({} x {})", d.world_size, d.world_size,
                                d.global_batch / d.world_size),
                    fmt::format("applied gradient (one SGD step, lr 1): max |diff| to 1-process mean {}, to sum {}",
                                sci(d.fsdp_to_mean), sci(d.fsdp_to_sum)),
                    d.fsdp_note.empty() ? d.fsdp_verdict : fmt::format("{} ({})", d.fsdp_verdict, d.fsdp_note)});
  }
  const auto more = claim_experiment_rows(r);
  rows.insert(rows.end(), more.begin(), more.end());
  const auto tokens = token_rows(r);
  rows.insert(rows.end(), tokens.begin(), tokens.end());
  const auto batch_norm = batch_norm_rows(r);
  rows.insert(rows.end(), batch_norm.begin(), batch_norm.end());
  return rows;
}

namespace {

// ---- files -------------------------------------------------------------------------------------------------

class OutDir {
 public:
  explicit OutDir(LabResults& r) : r_(r), dir_(r.config.out_dir) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw ConfigError(fmt::format("--out {}: cannot create the directory: {}", dir_, ec.message()));
  }
  void write(const std::string& name, const std::string& text) {
    const auto path = dir_ + "/" + name;
    std::ofstream out(path);
    out << text;
    if (!out.flush()) throw Error(fmt::format("lab: cannot write {}", path));
    if (std::find(r_.files.begin(), r_.files.end(), name) == r_.files.end()) r_.files.push_back(name);
  }
  const std::string& dir() const { return dir_; }

 private:
  LabResults& r_;
  std::string dir_;
};

void write_data(OutDir& out, const LabResults& r) {
  std::string curves = "batch,step,loss\n", wide = "step";
  std::string summary = "batch,steps,step0_loss,step0_loss_sum,sum_over_mean,final_loss,seconds\n";
  size_t steps = 0;
  for (const auto& run : r.loss.runs) {
    for (size_t s = 0; s < run.losses.size(); ++s) curves += fmt::format("{},{},{}\n", run.batch, s, run.losses[s]);
    summary += fmt::format("{},{},{},{},{},{},{}\n", run.batch, run.losses.size(), run.step0_mean(), run.step0_sum,
                           run.sum_over_mean(), run.final_loss(), run.seconds);
    wide += fmt::format(" B={}", run.batch);
    steps = std::max(steps, run.losses.size());
  }
  wide += "\n";
  for (size_t s = 0; s < steps; ++s) {
    wide += std::to_string(s);
    for (const auto& run : r.loss.runs) wide += s < run.losses.size() ? fmt::format(" {}", run.losses[s]) : " NaN";
    wide += "\n";
  }
  out.write("loss_curves.csv", curves);
  out.write("loss_summary.csv", summary);
  out.write("loss_curves.dat", wide);
  const auto& a = r.accumulation;
  out.write("accumulation.csv",
            fmt::format("micro_batches,micro_batch,full_norm,raw_norm,raw_ratio,raw_to_sum,raw_to_mean,scaled_to_mean,"
                        "raw_verdict,scaled_verdict\n{},{},{},{},{},{},{},{},{},{}\n",
                        a.micro_batches, a.micro_batch, a.full_norm, a.raw_norm, a.raw_ratio, a.raw_to_sum,
                        a.raw_to_mean, a.scaled_to_mean, a.raw_verdict, a.scaled_verdict));
  std::string ddp = "world_size,global_batch,to_mean,to_sum,between_ranks,verdict,note\n";
  std::string ranks = "world_size,rank,samples,local_to_mean,local_to_shard,local_norm,synced_to_mean,synced_to_sum,"
                      "synced_to_rank0,local_probe,synced_probe\n";
  std::string deviation = "# world_size to_mean to_sum\n";
  std::string rank_bars = "# label before_sync_to_mean after_sync_to_mean\n";
  for (const auto& d : r.ddp) {
    ddp += fmt::format("{},{},{},{},{},{},{}\n", d.world_size, d.global_batch, d.to_mean, d.to_sum, d.between_ranks,
                       d.verdict, d.note);
    deviation += fmt::format("{} {} {}\n", d.world_size, d.to_mean, d.to_sum);
    for (const auto& g : d.ranks) {
      ranks += fmt::format("{},{},{},{},{},{},{},{},{},{},{}\n", d.world_size, g.rank, g.samples, g.local_to_mean,
                           g.local_to_shard, g.local_norm, g.synced_to_mean, g.synced_to_sum, g.synced_to_rank0,
                           g.local_probe, g.synced_probe);
      rank_bars += fmt::format("N={}/r{} {} {}\n", d.world_size, g.rank, g.local_to_mean, g.synced_to_mean);
    }
  }
  out.write("ddp.csv", ddp);
  out.write("ddp_ranks.csv", ranks);
  out.write("ddp_deviation.dat", deviation);
  out.write("ddp_ranks.dat", rank_bars);
  std::string uneven = "world_size,samples,to_mean_of_means,to_global_mean,verdict,global_mean_to_sample_mean,"
                       "global_mean_to_mean_of_means,global_mean_between_ranks,global_mean_items,global_mean_verdict\n";
  for (const auto& u : r.uneven) {
    uneven += fmt::format("{},{},{},{},{},{},{},{},{},{}\n", u.world_size, join_samples(u.samples), u.to_mean_of_means,
                          u.to_global_mean, u.verdict, u.global_to_sample_mean, u.global_to_mean_of_means,
                          u.global_between_ranks, u.global_items, u.global_verdict);
  }
  out.write("uneven.csv", uneven);
  const auto [claims_csv, claims_dat] = claims_data(r);
  out.write("claims.csv", claims_csv);
  out.write("claims.dat", claims_dat);
}

void write_token_data(OutDir& out, const LabResults& r) {
  if (r.tokens.rows.empty()) return;
  const auto [tokens_csv, tokens_dat] = tokens_data(r);
  out.write("tokens.csv", tokens_csv);
  out.write("tokens_curves.dat", tokens_dat);
}

std::string gnuplot_script(const LabResults& r) {
  const auto& c = r.config;
  return fmt::format(R"gp(# gradsync lab plots. Render again with: gnuplot plots.gp (in this directory)
if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {{
  set terminal pngcairo size 960,600 noenhanced font "DejaVu Sans,11"
}} else {{
  set terminal png size 960,600 noenhanced
}}
set grid
set key top right

set output "loss_vs_batch.png"
set title "Training loss per step (per-sample mean) - {model}, {data}, SGD lr {lr:g}"
set xlabel "optimizer step"
set ylabel "loss (mean over the batch's samples)"
plot for [i=2:{last_column}] "loss_curves.dat" using 1:i with lines lw 2 title columnheader(i)

floor = 1e-12
v(x) = x > floor ? x : floor
txt(x) = x > 0 ? sprintf("%.1e", x) : "0"
set logscale y
set format y "%.0e"
set yrange [floor:10]
set boxwidth 0.36
set style fill solid 0.85 border -1
set key top left
set bmargin 5
set label 1 "max |diff| over every gradient element; 0 is drawn at 1e-12. At N = 1 the sum and the mean are the same gradient." at screen 0.02, screen 0.03

set output "ddp_deviation.png"
set title "DDP gradient (Reduction::Mean) against one process on the same global batch"
set xlabel "world size"
set ylabel "max |diff|"
plot "ddp_deviation.dat" using ($0-0.19):(v($2)):xtic(sprintf("N = %d", int($1))) with boxes lc rgb "#2b6cb0" title "to the single-process mean gradient", \
     "" using ($0+0.19):(v($3)) with boxes lc rgb "#c53030" title "to the sum of the per-rank gradients", \
     "" using ($0-0.19):(v($2)*4):(txt($2)) with labels notitle, \
     "" using ($0+0.19):(v($3)*4):(txt($3)) with labels notitle, \
     {tol:g} with lines dt 2 lw 2 lc rgb "black" title "tolerance {tol:g}"

set output "ddp_ranks.png"
set title "Each rank's gradient against the single-process mean, before and after DDP's synchronisation"
set xlabel "world size / rank"
set label 1 "max |diff| over every gradient element; 0 is drawn at 1e-12" at screen 0.02, screen 0.03
plot "ddp_ranks.dat" using ($0-0.19):(v($2)):xtic(1) with boxes lc rgb "#dd6b20" title "before sync (the rank's own gradient)", \
     "" using ($0+0.19):(v($3)) with boxes lc rgb "#2b6cb0" title "after sync", \
     "" using ($0-0.19):(v($2)*4):(txt($2)) with labels font ",9" notitle, \
     "" using ($0+0.19):(v($3)*4):(txt($3)) with labels font ",9" notitle, \
     {tol:g} with lines dt 2 lw 2 lc rgb "black" title "tolerance {tol:g}"
)gp",
                     fmt::arg("model", c.model), fmt::arg("data", c.data), fmt::arg("lr", c.lr),
                     fmt::arg("last_column", r.loss.runs.size() + 1), fmt::arg("tol", c.tolerance)) +
         claims_gnuplot(r) + tokens_gnuplot(r);
}

// Runs `gnuplot plots.gp` in the out dir, its output going to gnuplot.log there.
void render_plots(OutDir& out, LabResults& r) {
  PlotStatus& p = r.plots;
  if (auto missing = gnuplot_missing(); !missing.empty()) {
    p.message = fmt::format("{}; the data and plots.gp are in {}/, render them with `gnuplot plots.gp` there", missing,
                            out.dir());
    return;
  }
  const std::string log = out.dir() + "/gnuplot.log";
  const int status = run_logged({"gnuplot", "plots.gp"}, out.dir(), log, std::chrono::minutes(2)).value_or(-1);
  const std::string text = read_text(log);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    p.message = fmt::format("gnuplot failed (status {}): {}", status, text.substr(0, 2000));
    return;
  }
  std::vector<std::string> pngs{"loss_vs_batch.png", "ddp_deviation.png", "ddp_ranks.png", "claims.png"};
  if (!r.tokens.rows.empty()) pngs.push_back("tokens.png");
  for (const auto& png : pngs) {
    if (fs::exists(out.dir() + "/" + png)) p.files.push_back(png);
  }
  p.rendered = p.files.size() == pngs.size();
  if (!p.rendered) p.message = "gnuplot ran but did not write every PNG: " + text.substr(0, 2000);
  r.files.insert(r.files.end(), p.files.begin(), p.files.end());
}

}  // namespace

std::string format_table(const LabResults& r) {
  const auto rows = result_rows(r);
  std::array<size_t, 3> width{10, 8, 7};
  for (const auto& row : rows) {
    for (size_t i = 0; i < 3; ++i) width[i] = std::max(width[i], row[i].size());
  }
  std::string text = fmt::format("gradsync lab: sum or mean? ({}, {}, {}; {:.0f} s)\n",
                                 r.config.quick ? "quick" : "full", r.config.data, r.config.model, r.seconds);
  text += fmt::format("two gradients are equal when max |diff| over every element < {:g}\n\n", r.config.tolerance);
  auto line = [&](const ResultRow& row) {
    return fmt::format("{:<{}}  {:<{}}  {}\n", row[0], width[0], row[1], width[1], row[2]);
  };
  text += line({"experiment", "measured", "verdict"});
  text += line({std::string(width[0], '-'), std::string(width[1], '-'), std::string(width[2], '-')});
  for (const auto& row : rows) text += line(row);
  return text + claims_table(r);
}

namespace {

using json = nlohmann::ordered_json;

json loss_json(const LossResult& loss) {
  json runs = json::array();
  for (const auto& run : loss.runs) {
    runs.push_back({{"batch", run.batch}, {"step0_loss", run.step0_mean()}, {"step0_loss_sum", run.step0_sum},
                    {"sum_over_mean", run.sum_over_mean()}, {"final_loss", run.final_loss()},
                    {"losses", run.losses}, {"seconds", run.seconds}});
  }
  return {{"steps", loss.steps}, {"optimizer", "sgd"}, {"lr", loss.lr}, {"step0_spread", loss.step0_spread},
          {"sum_over_mean_error", loss.ratio_error}, {"verdict", loss.verdict}, {"runs", runs}};
}

json accumulation_json(const AccumulationResult& a) {
  return {{"micro_batches", a.micro_batches}, {"micro_batch", a.micro_batch},
          {"full_batch_norm", a.full_norm}, {"raw_norm", a.raw_norm}, {"raw_ratio", a.raw_ratio},
          {"raw_max_abs_diff_to_sum", a.raw_to_sum}, {"raw_max_abs_diff_to_mean", a.raw_to_mean},
          {"scaled_max_abs_diff_to_mean", a.scaled_to_mean}, {"raw_verdict", a.raw_verdict},
          {"scaled_verdict", a.scaled_verdict},
          {"divided_by_k", {{"max_abs_diff_to_scaled", a.divided_to_scaled}, {"max_abs_diff_to_mean", a.divided_to_mean},
                            {"max_abs_diff_to_undivided", a.divided_to_raw}, {"verdict", a.divided_verdict}}},
          {"unequal_micro_batches", {{"sizes", a.unequal_sizes},
                                     {"divided_max_abs_diff_to_sample_mean", a.unequal_divided_to_mean},
                                     {"divided_max_abs_diff_to_mean_of_micro_means", a.unequal_divided_to_micro_means},
                                     {"global_mean_max_abs_diff_to_sample_mean", a.unequal_global_to_mean},
                                     {"verdict", a.unequal_divided_verdict}}},
          {"seconds", a.seconds}};
}

json rank_json(const RankGradients& g) {
  return {{"rank", g.rank},
          {"samples", g.samples},
          {"before_sync", {{"max_abs_diff_to_mean", g.local_to_mean},
                           {"max_abs_diff_to_own_shard", g.local_to_shard},
                           {"norm", g.local_norm},
                           {"probe", g.local_probe}}},
          {"after_sync", {{"max_abs_diff_to_mean", g.synced_to_mean},
                          {"max_abs_diff_to_sum", g.synced_to_sum},
                          {"max_abs_diff_to_rank0", g.synced_to_rank0},
                          {"probe", g.synced_probe}}}};
}

json ddp_json(const DdpResult& d) {
  json ranks = json::array();
  for (const auto& g : d.ranks) ranks.push_back(rank_json(g));
  return {{"world_size", d.world_size}, {"global_batch", d.global_batch},
          {"samples_per_rank", d.global_batch / d.world_size}, {"max_abs_diff_to_mean", d.to_mean},
          {"max_abs_diff_to_sum", d.to_sum}, {"max_abs_diff_between_ranks", d.between_ranks},
          {"mean_gradient_max_abs", d.mean_max_abs}, {"verdict", d.verdict}, {"note", d.note},
          {"probe", {{"parameter", d.probe_name}, {"mean", d.probe_mean}, {"sum", d.probe_sum}}},
          {"summed_loss", {{"max_abs_diff_to_sum_over_n", d.summed_loss.to_sum_over_n},
                           {"max_abs_diff_to_sum", d.summed_loss.to_sum}, {"scale", d.summed_loss.max_abs},
                           {"verdict", d.summed_loss.verdict}}},
          {"ranks", ranks}, {"seconds", d.seconds}};
}

json uneven_json(const UnevenResult& u) {
  return {{"world_size", u.world_size}, {"samples", u.samples},
          {"max_abs_diff_to_mean_of_rank_means", u.to_mean_of_means},
          {"max_abs_diff_to_sample_mean", u.to_global_mean}, {"verdict", u.verdict},
          {"sample_weighted_reduction", "measured: global_mean (Reduction::GlobalMean)"},
          {"global_mean", {{"reduction", "global-mean"},
                           {"max_abs_diff_to_sample_mean", u.global_to_sample_mean},
                           {"max_abs_diff_to_mean_of_rank_means", u.global_to_mean_of_means},
                           {"max_abs_diff_between_ranks", u.global_between_ranks},
                           {"total_items", u.global_items},
                           {"verdict", u.global_verdict}}}};
}

// The FSDP (full shard) half of a DdpResult.
json sharded_json(const DdpResult& d) {
  return {{"world_size", d.world_size}, {"strategy", "full_shard"}, {"global_batch", d.global_batch},
          {"samples_per_rank", d.global_batch / d.world_size},
          {"measured", "initial - updated parameters after one SGD step (lr 1), state_dict()"},
          {"max_abs_diff_to_mean", d.fsdp_to_mean}, {"max_abs_diff_to_sum", d.fsdp_to_sum},
          {"max_abs_diff_between_ranks", d.fsdp_between_ranks}, {"verdict", d.fsdp_verdict},
          {"note", d.fsdp_note},
          {"accumulation", {{"micro_batches", d.fsdp_accumulation.micro_batches},
                            {"micro_batch", d.fsdp_accumulation.micro_batch},
                            {"no_sync", {{"max_abs_diff_to_mean", d.fsdp_accumulation.full_to_mean},
                                         {"max_abs_diff_to_sum", d.fsdp_accumulation.full_to_sum}}},
                            {"every_micro_step", {{"max_abs_diff_to_mean", d.fsdp_accumulation.sharded_to_mean},
                                                  {"max_abs_diff_to_sum", d.fsdp_accumulation.sharded_to_sum}}},
                            {"verdict", d.fsdp_accumulation.verdict}}}};
}

// One JSON array: convert(result) for each result, in order.
template <class Result, class Convert>
json json_array(const std::vector<Result>& results, Convert convert) {
  json out = json::array();
  for (const auto& result : results) out.push_back(convert(result));
  return out;
}

}  // namespace

nlohmann::ordered_json to_json(const LabResults& r) {
  const auto& c = r.config;
  return {
      {"command", "gradsync lab"},
      {"mode", c.quick ? "quick" : "full"},
      {"data", c.data},
      {"dataset_size", r.dataset_size},
      {"model", c.model},
      {"seed", c.seed},
      {"world_sizes", c.world_sizes},
      {"tolerance", c.tolerance},
      {"seconds", r.seconds},
      {"loss_vs_batch", loss_json(r.loss)},
      {"accumulation", accumulation_json(r.accumulation)},
      {"ddp", json_array(r.ddp, ddp_json)},
      {"uneven", json_array(r.uneven, uneven_json)},
      {"sharded", json_array(r.ddp, sharded_json)},
      {"tokens", r.tokens.rows.empty() ? json::array() : json(tokens_json(r.tokens)["rows"])},
      {"tokens_experiment", r.tokens.rows.empty() ? json(nullptr) : json(tokens_json(r.tokens))},
      {"batch_norm", r.batch_norm.rows.empty() ? json(nullptr) : json(batch_norm_json(r.batch_norm))},
      {"claims", claims_json(r)},
      {"answer", {{"en", answer_text(r, "en")}, {"ko", answer_text(r, "ko")}}},
      {"out_dir", c.out_dir},
      {"plots", {{"rendered", r.plots.rendered}, {"files", r.plots.files}, {"message", r.plots.message}}},
      {"files", r.files},
  };
}

void write_report(LabResults& r) {
  OutDir out(r);
  write_data(out, r);
  write_token_data(out, r);
  out.write("plots.gp", gnuplot_script(r));
  render_plots(out, r);
  r.files.push_back("report.md");
  r.files.push_back("results.json");
  out.write("report.md", report_markdown(r));
  out.write("results.json", to_json(r).dump(2) + "\n");
}

}  // namespace gradsync::cli
