// defines: the `gradsync lab` command, which answers "do data-parallel gradients sum or average?" by measurement
// on real data: its configuration, the measured results of every experiment, and the functions that produce
// them. Split by concern:
//   lab.cpp              the command: options, the order of the experiments, progress, output files
//   lab_experiments.cpp  loss vs batch size and accumulation (in this process), the DDP analysis (the single
//                        process reference against what the ranks measured)
//   lab_analysis.cpp     accumulation divided by K afterwards, FSDP with accumulation, DDP with summed losses
//                        (their single-process references; lab_analysis.h, shared with lab_experiments.cpp)
//   lab_tokens.cpp       a language model on real text: per-micro-batch token means against the token mean
//   lab_batch_norm.cpp   BatchNorm's statistics under DDP, with and without SyncBatchNorm
//   lab_rank.cpp         the hidden `gradsync lab-rank` subcommand: one DDP (and FSDP) rank, started through
//                        launch()
//   lab_report.cpp       terminal table, JSON, CSV files, gnuplot plots
//   lab_claims.cpp       the claims table: statements about sum or mean, each graded by the experiment deciding it
//   lab_claims_report.cpp  the claims in the table, JSON, CSV, plot and report.md
//   lab_tokens_report.cpp, lab_batch_norm_report.cpp  those experiments in the table, JSON, report and answer
//   lab_answer.cpp       the answer, in English and Korean, written from the verdicts
//   lab_markdown.cpp     report.md
//
// Every verdict compares a measured figure with a stated tolerance (LabConfig::tolerance); a verdict the numbers
// cannot support is never printed (e.g. at world size 1 the sum and the mean are the same gradient, and the
// report says so instead of claiming the sum was ruled out).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "data/models.h"

namespace CLI {
class App;
}

namespace gradsync::cli {

struct LabConfig {
  std::string out_dir = "lab-report";
  bool quick = false;
  bool json = false;
  std::vector<int> world_sizes{1, 2, 4};
  std::string backend;                  // --backend gloo|mpi for the DDP ranks ("" = gloo)
  std::string data = "fashion-mnist";   // synthetic:N only when asked for
  std::string model = "mlp:784-128-10";
  uint64_t seed = 0;
  // Loss vs batch size: local training with `gradsync train`'s loop (train_rank), SGD at a fixed lr.
  std::vector<int64_t> batch_sizes{256, 1024, 4096};
  int64_t loss_steps = 300;
  double lr = 0.1;
  // Accumulation: K micro-batches of b samples against the full batch of K*b.
  int64_t accumulate = 4;
  int64_t micro_batch = 256;
  // DDP: the global batch every world size splits (rounded down to a multiple of N).
  int64_t ddp_batch = 4096;
  // Max |difference| over every gradient element below which two gradients count as equal. float32
  // gradients of this model are O(1e-2); summing them in a different order changes them by O(1e-9).
  double tolerance = 1e-5;
  double rank_timeout_seconds = 120;
  bool tokens = true;  // the tokens experiment (needs Debian's fortunes)
  bool batch_norm = true;  // the BatchNorm experiment (mlp-bn under DDP, with and without SyncBatchNorm)
};

// The defaults of the full run, or of --quick (fewer steps, smaller DDP batch).
LabConfig lab_defaults(bool quick);

// ---- results -----------------------------------------------------------------------------------------

struct LossRun {
  int64_t batch = 0;
  std::vector<double> losses;  // per step, mean reduction (what `gradsync train` logs)
  double step0_sum = 0;        // the same first batch with --loss-reduction sum
  double seconds = 0;
  double step0_mean() const { return losses.empty() ? 0 : losses.front(); }
  double final_loss() const { return losses.empty() ? 0 : losses.back(); }
  double sum_over_mean() const { return step0_sum / step0_mean(); }
};

struct LossResult {
  int64_t steps = 0;
  double lr = 0;
  std::vector<LossRun> runs;
  double step0_spread = 0;   // (max - min) / mean of the step-0 mean losses over the batch sizes
  double ratio_error = 0;    // max over B of |sum/mean - B| / B
  std::string verdict;       // "per-sample mean" or "inconclusive"
};

struct AccumulationResult {
  int64_t micro_batches = 0;  // K
  int64_t micro_batch = 0;    // b
  double full_norm = 0;       // |g| of the mean loss over all K*b samples
  double raw_norm = 0;        // |.grad| after K backward passes of the micro-batch mean loss
  double raw_ratio = 0;       // raw_norm / full_norm
  double raw_to_sum = 0;      // max |raw - K*g|
  double raw_to_mean = 0;     // max |raw - g|
  double scaled_to_mean = 0;  // max |accumulate() (loss/K) - g|
  std::string raw_verdict;     // "sum" when raw ~ K*g and not g
  std::string scaled_verdict;  // "mean" when the loss/K gradient ~ g
  // Dividing the accumulated .grad by K afterwards (DeepSpeed's division by gradient_accumulation_steps) instead
  // of each micro-batch loss (accumulate()). Equal micro-batches: the same K x b samples as above.
  double divided_to_scaled = 0;  // max |raw/K - accumulate()'s gradient|
  double divided_to_mean = 0;    // max |raw/K - g|
  double divided_to_raw = 0;     // max |raw/K - raw|: how far dividing moved it from the undivided sum
  // Unequal micro-batches: the same K x b samples split into K micro-batches of sizes proportional to 1..K.
  std::vector<int64_t> unequal_sizes;
  double unequal_divided_to_mean = 0;         // max |raw/K - gradient of the mean over all K x b samples|
  double unequal_divided_to_micro_means = 0;  // max |raw/K - mean over k of the micro-batch mean gradients|
  double unequal_global_to_mean = 0;          // max |(summed losses)/(K x b) - gradient of the mean over all|
  std::string divided_verdict;          // "mean" when raw/K ~ g on equal micro-batches and not the raw sum
  std::string unequal_divided_verdict;  // "mean of micro-batch means", "sample mean" or "neither"
  double seconds = 0;
};

// One rank's gradients, compared by the parent with its single-process references.
struct RankGradients {
  int rank = 0;
  int64_t samples = 0;
  double local_to_shard = 0;   // before sync vs the parent's gradient of the same shard (consistency)
  double local_to_mean = 0;    // before sync vs the global mean: how different the ranks start
  double local_norm = 0;
  double synced_to_mean = 0;
  double synced_to_sum = 0;
  double synced_to_rank0 = 0;  // after sync every rank must hold the same gradient
  double local_probe = 0;      // one gradient element (probe_name) before and after sync
  double synced_probe = 0;
};

// FullyShardedDataParallel (FullShard) with K micro-batches per rank on the even shares, in both accumulation
// modes: the gradient one SGD step (lr = 1) applied, against the single-process gradients of the same samples.
struct FsdpAccumulationResult {
  int64_t micro_batches = 0;  // K
  int64_t micro_batch = 0;    // samples per micro-batch on every rank
  double full_to_mean = 0;    // ShardedAccumulation::UnshardedGradients (no_sync): max |applied - mean|
  double full_to_sum = 0;     //   min over ranks of max |applied - sum over ranks of their mean gradients|
  double sharded_to_mean = 0;  // ShardedAccumulation::ReduceEveryMicroStep
  double sharded_to_sum = 0;
  double between_ranks = 0;   // max over both modes of max |applied - rank 0's|
  std::string verdict;  // "mean" when both modes give the mean and not the sum, "sum" or "neither"
  std::string note;     // "N=1: sum = mean", or why the verdict is "neither"
};

// DDP (Reduction::Mean) when every rank's loss is the SUM over its samples (`--loss-reduction sum`).
struct SummedLossResult {
  double to_sum_over_n = 0;  // max over ranks of max |synced - (1/N) grad of the summed loss of the global batch|
  double to_sum = 0;         // min over ranks of max |synced - grad of the summed loss of the global batch|
  double max_abs = 0;        // max |grad of the summed loss| / N: the scale
  // The verdict compares to_sum_over_n / max_abs and to_sum / max_abs with the tolerance: summed gradients, and
  // their float32 rounding, are B/N times larger than mean ones.
  std::string verdict;       // "sum / N", "sum" or "neither"
  std::string note;          // "N=1: sum / N = sum"
};

struct DdpResult {
  int world_size = 0;
  int64_t global_batch = 0;
  double to_mean = 0;   // max over ranks and elements of |synced - single-process mean gradient|
  double to_sum = 0;    // min over ranks of max |synced - sum of per-rank mean gradients|
  double between_ranks = 0;
  double mean_max_abs = 0;  // max |g| of the mean gradient: the scale the differences are compared with
  std::string probe_name;   // e.g. "2.bias[0]"
  double probe_mean = 0, probe_sum = 0;
  std::vector<RankGradients> ranks;
  std::string verdict;  // "mean", "sum" or "neither"
  std::string note;
  // FullyShardedDataParallel (FullShard) on the same even shares: initial - parameters after one SGD step with
  // lr = 1, i.e. the gradient FSDP applied, gathered whole on every rank.
  double fsdp_to_mean = 0;          // max over ranks of max |fsdp - single-process mean gradient|
  double fsdp_to_sum = 0;           // min over ranks of max |fsdp - sum of per-rank mean gradients|
  double fsdp_between_ranks = 0;    // max |fsdp - rank 0's|
  std::string fsdp_verdict;         // "mean", "sum" or "neither"
  std::string fsdp_note;
  FsdpAccumulationResult fsdp_accumulation;
  SummedLossResult summed_loss;
  double seconds = 0;
};

// Ranks given different numbers of samples (rank r gets a share proportional to r+1).
struct UnevenResult {
  int world_size = 0;
  std::vector<int64_t> samples;
  // DDP with Reduction::Mean (PyTorch's): each rank's loss the mean over its own share.
  double to_mean_of_means = 0;  // max |synced - (1/N) sum_r g_r|
  double to_global_mean = 0;    // max |synced - gradient of the mean over all samples|
  std::string verdict;          // "mean of per-rank means", "sample mean" or "neither"
  // DDP with Reduction::GlobalMean (accumulate_global_mean, summed losses) on the same shares.
  double global_to_sample_mean = 0;     // max over ranks of max |synced - gradient of the mean over all samples|
  double global_to_mean_of_means = 0;   // min over ranks of max |synced - (1/N) sum_r g_r|
  double global_between_ranks = 0;      // max |synced - rank 0's synced|
  int64_t global_items = 0;             // the step's item count T the ranks agreed on (= the global batch)
  std::string global_verdict;           // "sample mean", "mean of per-rank means" or "neither"
};

// The tokens experiment (lab_tokens.cpp): a gpt on fortunes, one step at (N, K), each gradient against one process's
// gradient of the token mean over the step's sequences (relative: ||g - g_ref||_2 / ||g_ref||_2, float64).
struct TokenRow {
  int world_size = 0;
  int64_t accumulate = 0;
  double global_mean_rel_diff = 0;              // (b) Reduction::GlobalMean
  double mean_of_means_rel_diff = 0;            // (a) per-micro-batch token means / K, DDP's mean over ranks
  double mean_of_means_predicted_rel_diff = 0;  // what (a)'s weights 1/(N*K*n_rk) per token predict
  double mean_of_means_to_prediction = 0;       // (a) against that prediction
  double global_mean_to_prediction = 0;         // (b) against it
};

// Longer training at one (N, K): each run's logged loss per step, and its final parameters' update against the
// reference's (relative).
struct TokenCurves {
  int world_size = 0;
  int64_t accumulate = 0;
  int64_t steps = 0;
  std::vector<double> reference, mean_of_means, global_mean;
  double mean_of_means_final_rel_diff = 0;
  double global_mean_final_rel_diff = 0;
};

struct TokensResult {
  std::string model;
  int64_t global_batch = 0;  // sequences per step
  std::vector<TokenRow> rows;
  TokenCurves curves;
  double seconds = 0;
};

// Runs the tokens experiment in `scratch`/tokens (`gradsync train` runs of this executable).
TokensResult run_tokens(const LabConfig& config, const std::string& scratch);
nlohmann::ordered_json tokens_json(const TokensResult& tokens);

// The BatchNorm experiment (lab_batch_norm.cpp): mlp-bn on the lab's images, small per-rank batches, one step of
// `gradsync train` in float64; the first BatchNorm's running statistics (mean and variance, one vector) that rank 0
// saved, against what each hypothesis predicts from the ranks' own batch statistics (relative: ||s - p|| / ||p||).
struct BatchNormRow {
  int world_size = 0;
  std::vector<int64_t> equal_samples;   // per rank, plain BatchNorm under DDP
  std::vector<int64_t> uneven_samples;  // per rank, --sync-bn --no-pad
  double ddp_to_averaged = 0;     // DDP: against the statistics averaged over the ranks
  double ddp_to_rank0 = 0;        // DDP: against rank 0's own batch statistics
  double sync_to_weighted = 0;    // SyncBatchNorm: against the count-weighted statistics of the union
  double sync_to_plain_mean = 0;  // SyncBatchNorm: against the plain mean of the ranks' statistics
};

struct BatchNormResult {
  std::string model;
  std::vector<BatchNormRow> rows;
  double seconds = 0;
};

// Runs the BatchNorm experiment in `scratch`/batch_norm (`gradsync train` runs of this executable) on the first
// rows of the lab's batch file.
BatchNormResult run_batch_norm(const LabConfig& config, const std::string& scratch, const std::string& batch_file);
nlohmann::ordered_json batch_norm_json(const BatchNormResult& result);
// One `gradsync train` run of this executable (flags after "train"), its output in `log`; Error naming `what` and
// quoting the log when it fails.
void run_lab_train(const LabConfig& config, const std::vector<std::string>& flags, const std::string& log,
                   const std::string& what);

// One statement about sum or mean (from the three answers to the question, or a belief users repeat), graded by
// the experiment that decides it: its deviation from what the statement predicts and from the alternative.
struct ClaimResult {
  std::string id;          // "ddp-sums"
  std::string source;      // "answer 1", "answer 2", "answer 3", "common belief"
  std::string claim_en, claim_ko;
  std::string experiment;  // which measurement decides it
  std::string measured;    // its figures, e.g. "N=2: 1.1e-08 vs 3.5e-02; N=4: 9.3e-09 vs 1.0e-01"
  double deviation_true = 0;   // from what the claim predicts (the largest over the cases)
  double deviation_false = 0;  // from the alternative (the smallest over the cases)
  double tolerance = 0;
  std::string verdict;     // "true", "false", "true only when ...", "inconclusive"
  std::string verdict_ko;
};

struct PlotStatus {
  bool rendered = false;
  std::string message;              // why not, or the gnuplot error
  std::vector<std::string> files;   // PNGs written (relative to the out dir)
};

struct LabResults {
  LabConfig config;
  int64_t dataset_size = 0;
  LossResult loss;
  AccumulationResult accumulation;
  std::vector<DdpResult> ddp;
  std::vector<UnevenResult> uneven;
  TokensResult tokens;              // empty rows with --no-tokens
  BatchNormResult batch_norm;       // empty rows with --no-batch-norm
  std::vector<ClaimResult> claims;  // graded from everything above (lab_claims.cpp)
  PlotStatus plots;
  std::vector<std::string> files;  // everything written to the out dir
  double seconds = 0;
};

// ---- experiments (lab_experiments.cpp) -------------------------------------------------------------------

// The lab's model with the state in `init_state` (written once by the command, so every process starts equal).
Model lab_model(const std::string& spec, const std::string& init_state);
// The first `rows` samples of the batch file the command wrote (a state-dict file with "inputs", "targets").
std::pair<torch::Tensor, torch::Tensor> read_batch(const std::string& batch_file, int64_t rows);
// Every parameter's .grad, flattened and concatenated in parameter order (a copy).
torch::Tensor flat_gradient(torch::nn::Module& model);
// max |a - b| over all elements, computed in float64.
double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b);

LossResult run_loss_vs_batch(const LabConfig& config);
AccumulationResult run_accumulation(const LabConfig& config, const std::string& init_state,
                                    const std::string& batch_file);
// Rank r's share of a global batch of `global` samples: equal shares (the remainder is not used, see
// usable_batch), or shares proportional to r+1 (the rounding remainder goes to the last rank).
int64_t usable_batch(int64_t global, int world_size);
std::vector<int64_t> even_split(int64_t global, int world_size);
std::vector<int64_t> uneven_split(int64_t global, int world_size);
// Compares what the ranks of one DDP run wrote into `rank_dir` with gradients this process computes itself on
// the same data (the single-process reference). Fills `uneven` when world_size >= 2.
DdpResult analyse_ddp(const LabConfig& config, int world_size, const std::string& rank_dir,
                      const std::string& init_state, const std::string& batch_file, UnevenResult* uneven);

// ---- claims (lab_claims.cpp) --------------------------------------------------------------------------------

// Every claim of the claims table graded against the results (which must be complete).
std::vector<ClaimResult> grade_claims(const LabResults& results);
// The claims in the lab's outputs (lab_claims_report.cpp): the terminal section, the JSON list, claims.csv and
// claims.dat, the claims.png part of plots.gp, and the report.md table in "en" or "ko".
std::string claims_table(const LabResults& results);
nlohmann::ordered_json claims_json(const LabResults& results);
std::pair<std::string, std::string> claims_data(const LabResults& results);
std::string claims_gnuplot(const LabResults& results);
std::string claims_markdown(const LabResults& results, const std::string& language);

// ---- one DDP rank (lab_rank.cpp) --------------------------------------------------------------------------

struct LabRankArgs {
  std::string out_dir;     // the rank writes rank<r>.pt (gradients) and rank<r>.json (measurements) here
  std::string init_state;
  std::string batch_file;
  std::string model;
  int64_t global_batch = 0;  // already a multiple of the world size
  int64_t accumulate = 1;    // K micro-batches per rank in the FSDP accumulation measurement
  double timeout_seconds = 120;
};
// Joins the job from the launcher's environment; with DistributedDataParallel (Reduction::Mean, the default)
// measures its gradient before synchronisation (under no_sync) and after, on an even and an uneven split; on
// the uneven split also the gradient of a second DDP copy built with Reduction::GlobalMean; on the even split the
// gradient FullyShardedDataParallel (FullShard) applied in one SGD step.
void run_lab_rank(const LabRankArgs& args);
std::string lab_rank_tensors(const std::string& dir, int rank);
// `gradsync lab` (and the hidden lab-rank): adds the subcommands to `root`; callbacks store the exit status.
void add_lab_command(CLI::App& root, int& exit_code);
// Registers the hidden `gradsync lab-rank` subcommand (add_lab_command calls it).
void add_lab_rank_command(CLI::App& root, int& exit_code);
std::string lab_rank_json(const std::string& dir, int rank);

// ---- report (lab_report.cpp, lab_answer.cpp, lab_markdown.cpp) ----------------------------------------------------

// Keys in the order of the report (ordered_json), so the document reads like the table.
nlohmann::ordered_json to_json(const LabResults& results);
// One row per experiment: what was measured, the figure, the verdict.
// A figure as every table writes it: "1.1e-08" (lab_report.cpp).
std::string sci(double value);
// Per-rank (or per-micro-batch) sample counts as the tables write them: "102+204+307+411" (lab_report.cpp).
std::string join_samples(const std::vector<int64_t>& samples);
// Text for a markdown table cell: '|' escaped (lab_markdown.cpp).
std::string markdown_cell(const std::string& text);
using ResultRow = std::array<std::string, 3>;
std::vector<ResultRow> result_rows(const LabResults& results);
// The tokens experiment's rows, tokens.csv and tokens_curves.dat, its plot, report section and answer paragraph
// (lab_tokens_report.cpp); empty without the experiment.
std::vector<ResultRow> token_rows(const LabResults& results);
std::pair<std::string, std::string> tokens_data(const LabResults& results);
std::string tokens_gnuplot(const LabResults& results);
std::string tokens_section(const LabResults& results);
std::string tokens_answer(const LabResults& results, bool ko);
// The BatchNorm experiment's table rows, report section and answer paragraph (lab_batch_norm_report.cpp); empty
// without the experiment.
std::vector<ResultRow> batch_norm_rows(const LabResults& results);
std::string batch_norm_section(const LabResults& results);
std::string batch_norm_answer(const LabResults& results, bool ko);
// Experiment-table rows of the measurements only the claims use (divided accumulation, FSDP accumulation, DDP
// with a summed loss).
std::vector<ResultRow> claim_experiment_rows(const LabResults& results);
std::string format_table(const LabResults& results);
// The answer to the question, one paragraph per experiment, written from the verdicts and numbers:
// language "en" or "ko". answer_text joins the paragraphs with newlines.
std::vector<std::string> answer_paragraphs(const LabResults& results, const std::string& language);
std::string answer_text(const LabResults& results, const std::string& language);
// report.md: every experiment's numbers, the plots, the answer in English and Korean, the definitions.
std::string report_markdown(const LabResults& results);
// Writes report.md, results.json, the CSV files, the gnuplot data and script, and renders the PNGs.
// Fills results.files and results.plots.
void write_report(LabResults& results);

}  // namespace gradsync::cli
