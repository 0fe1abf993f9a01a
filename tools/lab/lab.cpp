// `gradsync lab`: "do data-parallel gradients sum or average?" answered with measurements (see lab.h). The
// command prepares one initial model state and one global batch, runs the experiments in order, starts the
// DDP ranks itself (launch() re-running this executable as `gradsync lab-rank`), then writes the report.
// Progress goes to stderr; stdout carries the table, or with --json one JSON document, printed after the last
// progress line and flushed before the done line (print_answer), so the two streams never interleave.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "data/data.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"
#include "lab/lab.h"
#include "launch/backend_flag.h"
#include "launch/launch.h"
#include "launch/spawn.h"
#include "train/flag.h"
#include "data/models.h"

namespace gradsync::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kMaxWorldSize = 64;

// The ranks' files live in a TempDir (launch/spawn.h), removed with it.
using ScratchDir = TempDir;

void validate(const LabConfig& c) {
  if (c.world_sizes.empty()) throw ConfigError("--world-sizes is empty; expected e.g. 1,2,4");
  for (int n : c.world_sizes) {
    if (n < 1 || n > kMaxWorldSize) {
      throw ConfigError(fmt::format("--world-sizes: {} is out of range; expected 1..{}", n, kMaxWorldSize));
    }
    if (c.ddp_batch / n < std::max<int64_t>(c.accumulate, 1)) {
      throw ConfigError(fmt::format("--world-sizes: {} ranks cannot share a global batch of {} in {} micro-batches "
                                    "each", n, c.ddp_batch, c.accumulate));
    }
  }
  if (std::set<int>(c.world_sizes.begin(), c.world_sizes.end()).size() != c.world_sizes.size()) {
    throw ConfigError("--world-sizes lists a world size twice");
  }
  const auto spec = parse_flag("--model", c.model, parse_model_spec);
  if (spec.input_size() != 784 || spec.output_size() != 10) {
    throw ConfigError(fmt::format("--model {}: the lab trains on 28x28 images in 10 classes, so the model needs 784 "
                                  "inputs and 10 outputs (it has {} and {})", c.model, spec.input_size(),
                                  spec.output_size()));
  }
}

// The model's initial state and the global batch every in-process and DDP measurement uses. Returns the data
// set's size.
int64_t prepare_inputs(const LabConfig& c, const std::string& init_state, const std::string& batch_file) {
  const auto spec = parse_model_spec(c.model);
  fmt::print(stderr, "[lab] loading {}\n", c.data);
  auto data = load_dataset(c.data, spec.input_size(), spec.output_size(), LossKind::CrossEntropy, c.seed);
  const int64_t needed = std::max({*std::max_element(c.batch_sizes.begin(), c.batch_sizes.end()), c.ddp_batch,
                                   c.accumulate * c.micro_batch});
  if (data.size() < needed) {
    throw ConfigError(fmt::format("--data {}: {} samples; the lab needs at least {} (its largest batch)", c.data,
                                  data.size(), needed));
  }
  torch::manual_seed(c.seed);
  auto model = make_model(spec);
  save_state_dict(state_dict(*model), init_state);
  // A random global batch, the same for every experiment and world size.
  auto generator = at::detail::createCPUGenerator(c.seed + 1);
  auto rows = torch::randperm(data.size(), generator, torch::kLong)
                  .narrow(0, 0, std::max(c.ddp_batch, c.accumulate * c.micro_batch));
  save_state_dict({{"inputs", data.inputs.index_select(0, rows).contiguous()},
                   {"targets", data.targets.index_select(0, rows).contiguous()}},
                  batch_file);
  return data.size();
}

DdpResult run_ddp(const LabConfig& c, int n, const ScratchDir& scratch, UnevenResult* uneven) {
  const auto start = Clock::now();
  const int64_t global = usable_batch(c.ddp_batch, n);
  fmt::print(stderr, "[lab] DDP, world size {}: starting {} rank(s), {} samples each\n", n, n, global / n);
  const auto rank_dir = scratch.file(fmt::format("ddp-{}", n));
  fs::create_directories(rank_dir);
  LaunchOptions options;
  options.nproc = n;
  options.backend = backend_of(c.backend);
  options.command = {self_executable(), "lab-rank", "--out", rank_dir, "--init", scratch.file("init.pt"),
                     "--batch", scratch.file("batch.pt"), "--model", c.model, "--global-batch",
                     std::to_string(global), "--accumulate", std::to_string(c.accumulate), "--timeout",
                     fmt::format("{}", c.rank_timeout_seconds)};
  const int status = launch(options);
  if (status != 0) {
    throw Error(fmt::format("lab: the DDP ranks at world size {} failed (exit status {}; their errors are above)",
                            n, status));
  }
  auto result = analyse_ddp(c, n, rank_dir, scratch.file("init.pt"), scratch.file("batch.pt"), uneven);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  fmt::print(stderr, "[lab]   max |diff| to the mean {:.1e}, to the sum {:.1e}: {}{}  ({:.1f} s)\n", result.to_mean,
             result.to_sum, result.verdict, result.note.empty() ? "" : " (" + result.note + ")", result.seconds);
  if (uneven && n >= 2) {
    fmt::print(stderr, "[lab]   uneven shares: Mean {:.1e} from the sample mean ({}); GlobalMean {:.1e} ({})\n",
               uneven->to_global_mean, uneven->verdict, uneven->global_to_sample_mean, uneven->global_verdict);
  }
  fmt::print(stderr, "[lab]   FSDP full-shard: max |diff| to the mean {:.1e}, to the sum {:.1e}: {}{}\n",
             result.fsdp_to_mean, result.fsdp_to_sum, result.fsdp_verdict,
             result.fsdp_note.empty() ? "" : " (" + result.fsdp_note + ")");
  const auto& fa = result.fsdp_accumulation;
  fmt::print(stderr, "[lab]   FSDP, K = {} micro-batches of {}: unsharded gradients {:.1e} from the mean, {:.1e} "
             "from the sum; reduce every micro-step {:.1e}, {:.1e}: {}{}\n", fa.micro_batches, fa.micro_batch,
             fa.full_to_mean, fa.full_to_sum, fa.sharded_to_mean, fa.sharded_to_sum, fa.verdict,
             fa.note.empty() ? "" : " (" + fa.note + ")");
  const auto& sl = result.summed_loss;
  fmt::print(stderr, "[lab]   DDP, summed loss (max |G/N| {:.3g}): max |diff| to G/N {:.1e}, to G {:.1e}; relative "
             "{:.1e}, {:.1e}: {}{}\n", sl.max_abs, sl.to_sum_over_n, sl.to_sum, sl.to_sum_over_n / sl.max_abs,
             sl.to_sum / sl.max_abs, sl.verdict, sl.note.empty() ? "" : " (" + sl.note + ")");
  return result;
}

bool conclusive(const LabResults& r) {
  bool ok = r.loss.verdict != "inconclusive" && r.accumulation.raw_verdict != "neither" &&
            r.accumulation.scaled_verdict != "neither";
  for (const auto& d : r.ddp) ok = ok && d.verdict != "neither";
  for (const auto& u : r.uneven) ok = ok && u.verdict != "neither" && u.global_verdict != "neither";
  for (const auto& t : r.tokens.rows) {
    ok = ok && t.global_mean_rel_diff <= r.config.tolerance && t.mean_of_means_to_prediction <= r.config.tolerance;
  }
  for (const auto& b : r.batch_norm.rows) {
    ok = ok && b.ddp_to_rank0 <= r.config.tolerance && b.sync_to_weighted <= r.config.tolerance;
  }
  return ok;
}

// The answer (the table and the text, or the JSON document) on stdout in one piece. stderr is unbuffered but
// stdout is fully buffered when it is a pipe or a file, so without the flushes a `2>&1` capture would show the
// next progress line inside the answer: everything on stderr is out before the answer starts, and the answer is
// out before anything else goes to stderr.
void print_answer(const LabResults& results) {
  const LabConfig& c = results.config;
  std::fflush(stderr);
  if (c.json) {
    fmt::print("{}\n", to_json(results).dump(2));
  } else {
    fmt::print("{}\n{}\n\n{}\n\nreport, raw numbers and plots: {}/report.md\n", format_table(results),
               answer_text(results, "en"), answer_text(results, "ko"), c.out_dir);
  }
  std::fflush(stdout);
}

struct LabCli {
  std::string out_dir = "lab-report";
  bool quick = false;
  bool json = false;
  std::vector<int> world_sizes{1, 2, 4};
  std::string backend;
  std::string data = "fashion-mnist";
  std::string model = "mlp:784-128-10";
  uint64_t seed = 0;
  bool no_tokens = false;
  bool no_batch_norm = false;
};

int run_lab(const LabCli& cli) {
  const auto start = Clock::now();
  LabResults results;
  LabConfig& c = results.config;
  c = lab_defaults(cli.quick);
  c.out_dir = cli.out_dir;
  c.json = cli.json;
  c.world_sizes = cli.world_sizes;
  c.backend = cli.backend;
  c.data = cli.data;
  c.model = cli.model;
  c.seed = cli.seed;
  c.tokens = !cli.no_tokens;
  c.batch_norm = !cli.no_batch_norm;
  validate(c);
  fmt::print(stderr, "[lab] sum or mean? {} run: model {}, data {}, world sizes {}\n", c.quick ? "quick" : "full",
             c.model, c.data, fmt::join(c.world_sizes, ","));

  ScratchDir scratch("gradsync-lab");
  results.dataset_size = prepare_inputs(c, scratch.file("init.pt"), scratch.file("batch.pt"));
  results.loss = run_loss_vs_batch(c);
  results.accumulation = run_accumulation(c, scratch.file("init.pt"), scratch.file("batch.pt"));
  for (int n : c.world_sizes) {
    UnevenResult uneven;
    results.ddp.push_back(run_ddp(c, n, scratch, &uneven));
    if (n >= 2) results.uneven.push_back(uneven);
  }
  if (c.tokens) results.tokens = run_tokens(c, scratch.path());
  if (c.batch_norm) results.batch_norm = run_batch_norm(c, scratch.path(), scratch.file("batch.pt"));
  results.claims = grade_claims(results);
  results.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  fmt::print(stderr, "[lab] writing {}/\n", c.out_dir);
  write_report(results);
  if (!results.plots.rendered) fmt::print(stderr, "[lab] plots: {}\n", results.plots.message);

  print_answer(results);
  fmt::print(stderr, "[lab] done in {:.0f} s\n", results.seconds);
  std::fflush(stderr);
  if (!conclusive(results)) {
    fmt::print(stderr, "gradsync lab: a measurement matched neither hypothesis within {:g} (see the table)\n",
               c.tolerance);
    return 1;
  }
  return 0;
}

}  // namespace

LabConfig lab_defaults(bool quick) {
  LabConfig c;
  c.quick = quick;
  if (quick) {
    c.loss_steps = 30;
    c.ddp_batch = 1024;
  }
  return c;
}

void add_lab_command(CLI::App& root, int& exit_code) {
  auto cli = std::make_shared<LabCli>();
  auto* cmd = root.add_subcommand(
      "lab", "Sum or mean? Measure how losses, accumulated gradients and DDP gradients combine, on real data; "
             "writes a report with plots");
  cmd->add_option("--out", cli->out_dir, "directory for report.md, raw numbers and plots (default lab-report)");
  cmd->add_flag("--quick", cli->quick, "fewer training steps and a smaller DDP batch (about a minute)");
  cmd->add_option("--world-sizes", cli->world_sizes, "DDP world sizes to measure (default 1,2,4)")->delimiter(',');
  add_backend_flag(cmd, cli->backend);
  cmd->add_flag("--json", cli->json, "print the results as one JSON document (progress stays on stderr)");
  cmd->add_option("--data", cli->data, "fashion-mnist (default) or synthetic:N (N >= 4096)");
  cmd->add_option("--seed", cli->seed, "seed of the model, the batch and the sampler (default 0)");
  cmd->add_option("--model", cli->model, "the model every experiment trains: a train spec with 784 inputs and 10 "
                  "outputs, e.g. cnn:8-16-10 or res:784-64-2-10 (default mlp:784-128-10)");
  cmd->add_flag("--no-tokens", cli->no_tokens, "skip the tokens experiment (a gpt on Debian's fortunes: the mean of "
                "per-micro-batch token means against the token mean)");
  cmd->add_flag("--no-batch-norm", cli->no_batch_norm, "skip the BatchNorm experiment (mlp-bn under DDP: per-rank "
                "statistics, and SyncBatchNorm's count-weighted ones)");
  cmd->callback([cli, &exit_code] { exit_code = run_lab(*cli); });
  add_lab_rank_command(root, exit_code);
}

}  // namespace gradsync::cli
