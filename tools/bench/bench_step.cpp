// `gradsync bench` (see bench.h): gradsync's step against PyTorch's on the same model, batch, threads and world
// size. Each run is a fresh job: gradsync's is `gradsync train` with --log (its per-step seconds, bytes sent and
// peak memory), PyTorch's is pytorch_ddp_program() under `gradsync launch` (torchrun's environment). Runs alternate
// so that both sides see the same drift of this machine; the ratio is of the pooled medians, and run_ratios, of
// each gradsync run to the PyTorch run right after it, show how far one pair of runs can stray from it. --floor adds
// a third job per run, the compute floor (run_floor()).
#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>

#include <fmt/format.h>

#include "bench/bench.h"
#include "data/models.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "launch/spawn.h"
#include "train/flag.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

// The sides of one bench, each pooled over its runs (pytorch, floor and plain_bn stay empty unless asked for).
struct Measured {
  StepStats gradsync, pytorch, floor;
  StepStats plain_bn;  // --sync-bn: gradsync's job without it
  StepStats traced;    // --trace: gradsync's job with it
};

// Ranges and choices are checked by CLI11's validators (bench_command.cpp); the model and wrap specs only here.
void validate(const BenchConfig& c) {
  parse_flag("--model", c.model, parse_model_spec);
  if (c.floor && c.strategy == "local") {
    throw ConfigError("--floor runs a local process per rank to show what a distributed strategy adds to the "
                      "compute; with --strategy local there is no communication to show");
  }
  if (c.sync_bn && (!parse_model_spec(c.model).batch_norm || c.strategy == "local")) {
    throw ConfigError(fmt::format("--sync-bn times SyncBatchNorm against plain BatchNorm: it needs an mlp-bn model "
                                  "and a data-parallel strategy, not --model {} with --strategy {}", c.model,
                                  c.strategy));
  }
  if (c.compare_pytorch && c.strategy == "fsdp-full" && c.wrap.rfind("params:", 0) == 0) {
    throw ConfigError(fmt::format("--wrap {}: PyTorch's fully_shard, which --compare-pytorch runs for fsdp-full, has "
                                  "no units grouped by size; use --wrap children, type:T[,U] or list:A[,B], or no "
                                  "--wrap (gradsync's default units, PyTorch's root alone)", c.wrap));
  }
  if (c.wrap.empty()) return;
  if (c.strategy == "local" || c.strategy == "ddp") {
    throw ConfigError(fmt::format("--wrap applies to --strategy fsdp-full, fsdp-grad-op, fsdp-no-shard or zero1, "
                                  "not {}", c.strategy));
  }
  parse_flag("--wrap", c.wrap, parse_wrap_policy);
}

int ranks_of(const BenchConfig& c) { return c.strategy == "local" ? 1 : c.world_size; }

// A gpt's sample is a sequence of its context's length, every position a target; other models' samples are one item.
int64_t tokens_per_sample(const BenchConfig& c) {
  const auto spec = parse_model_spec(c.model);
  return spec.gpt ? spec.input_size() : 1;
}

void require_success(std::optional<int> status, const std::string& what, const std::string& log) {
  if (status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) return;
  std::string text = read_text(log);
  if (text.size() > 4000) text = "..." + text.substr(text.size() - 4000);
  throw Error(fmt::format("bench: the {} run {} (its output follows)\n{}", what,
                          status ? fmt::format("failed (wait status {})", *status) : "timed out", text));
}

EnvMap thread_env(const BenchConfig& c) {
  return {{"OMP_NUM_THREADS", std::to_string(c.threads)}};
}

// `gradsync train` on `ranks` ranks (1: --strategy local) with the bench's model and per-rank batch, logging to `log`;
// `tail` steps more after the measured ones.
std::vector<std::string> train_argv(const BenchConfig& c, const std::string& strategy, int ranks,
                                    const std::string& log, int64_t tail = 0) {
  const int64_t samples = c.per_rank_batch * ranks * 4;  // a few batches: the schedule crosses epochs as needed
  std::vector<std::string> argv{self_executable(), "train", "--model", c.model, "--data",
                                fmt::format("synthetic:{}", samples), "--global-batch",
                                std::to_string(c.per_rank_batch * ranks), "--strategy", strategy, "--steps",
                                std::to_string(c.warmup + c.steps + tail), "--log", log, "--report-memory", "--quiet",
                                "--timeout", fmt::format("{}", c.timeout_seconds)};
  if (strategy == "local") return argv;
  argv.insert(argv.end(), {"--world-size", std::to_string(ranks), "--backend", c.backend});
  if (!c.wrap.empty()) argv.insert(argv.end(), {"--wrap", c.wrap});
  if (c.sync_bn) argv.push_back("--sync-bn");
  return argv;
}

// Runs one job (`what` names it in errors), its output into `out`; throws with that output unless it exited 0.
void run_job(const BenchConfig& c, const std::vector<std::string>& argv, const std::string& out, const char* what) {
  require_success(run_logged(argv, "", out, std::chrono::milliseconds(static_cast<int64_t>(c.timeout_seconds * 1e3)),
                             thread_env(c)),
                  what, out);
}

// The measured steps of a train --log: their seconds, and into `stats` the bytes sent and peak memory.
std::vector<double> read_train_log(const BenchConfig& c, const std::string& log, StepStats& stats) {
  std::ifstream in(log);
  std::vector<double> mine;
  double sent = 0;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    const int64_t step = j.at("step").get<int64_t>();
    if (step < c.warmup || step >= c.warmup + c.steps) continue;
    mine.push_back(j.at("seconds").get<double>());
    sent += j.value("sent_bytes", 0.0);
    if (j.contains("overlap")) {
      stats.compute.push_back(j.at("compute_seconds"));
      stats.communication.push_back(j.at("communication_seconds"));
      stats.exposed.push_back(j.at("exposed_seconds"));
      stats.overlap.push_back(j.at("overlap"));
    }
    stats.peak_rss_bytes = std::max(stats.peak_rss_bytes, j.value("rss_peak", int64_t{-1}));
  }
  stats.bytes_sent_per_step = mine.empty() ? -1 : sent / static_cast<double>(mine.size());
  return mine;
}

void add_run(StepStats& stats, const std::vector<double>& steps) {
  stats.run_medians.push_back(median(steps));
  stats.step_seconds.insert(stats.step_seconds.end(), steps.begin(), steps.end());
}

// One `gradsync train` job (`name`: "gradsync", or "plain-bn" for the job without --sync-bn); appends its measured
// steps to `stats`.
void run_gradsync(const BenchConfig& c, const TempDir& dir, int run, StepStats& stats, const char* name = "gradsync") {
  const std::string log = dir.file(fmt::format("{}-{}.jsonl", name, run));
  auto argv = train_argv(c, c.strategy, ranks_of(c), log);
  if (std::string(name) == "plain-bn") argv.erase(std::remove(argv.begin(), argv.end(), "--sync-bn"), argv.end());
  if (std::string(name) == "traced") argv.insert(argv.end(), {"--trace", fmt::format("{}/run-{}", c.trace, run)});
  run_job(c, argv, dir.file(fmt::format("{}-{}.out", name, run)), name);
  add_run(stats, read_train_log(c, log, stats));
}

// The compute floor: as many `--strategy local` processes as the job has ranks, each on one rank's batch, all at
// once. They share the cores, memory bandwidth and caches as the ranks do but exchange nothing: the step time a
// data-parallel job would have if its communication cost nothing. Every process's steps are pooled (a rank's step
// also waits for the slowest rank, so the floor's median is, if anything, a little below what a free transport gives).
// Nothing synchronises the processes, so each runs `warmup` unmeasured steps after its measured ones as well as
// before: as long as their starts differ by less than that, every measured step shares the cores with the others.
void run_floor(const BenchConfig& c, const TempDir& dir, int run, StepStats& stats) {
  std::vector<std::future<void>> jobs;
  std::vector<std::string> logs;
  for (int p = 0; p < c.world_size; ++p) {
    logs.push_back(dir.file(fmt::format("floor-{}-{}.jsonl", run, p)));
    jobs.push_back(std::async(std::launch::async, run_job, std::cref(c),
                              train_argv(c, "local", 1, logs.back(), /*tail=*/c.warmup),
                              dir.file(fmt::format("floor-{}-{}.out", run, p)), "compute floor (--strategy local)"));
  }
  for (auto& job : jobs) job.wait();  // every process ends before a failure is reported
  for (auto& job : jobs) job.get();
  std::vector<double> steps;
  for (const auto& log : logs) {
    auto mine = read_train_log(c, log, stats);
    steps.insert(steps.end(), mine.begin(), mine.end());
  }
  add_run(stats, steps);
}

// What the PyTorch side runs: fully_shard against fsdp-full, DDP against every other distributed strategy.
std::string pytorch_recipe(const BenchConfig& c) {
  if (c.strategy == "local") return "local";
  return c.strategy == "fsdp-full" ? "fully_shard" : "ddp";
}

// One PyTorch job (pytorch_recipe(): DDP or fully_shard over Gloo, or one process for --strategy local).
void run_pytorch(const BenchConfig& c, const TempDir& dir, int run, StepStats& stats) {
  const int n = ranks_of(c);
  const std::string script = dir.file("pytorch_ddp.py");
  if (run == 0) std::ofstream(script) << pytorch_ddp_program();
  const std::string result = dir.file(fmt::format("pytorch-{}.json", run));
  std::vector<std::string> argv{self_executable(), "launch", "-n", std::to_string(n), "--", c.python, script,
                                "--model", c.model, "--per-rank-batch", std::to_string(c.per_rank_batch), "--steps",
                                std::to_string(c.steps), "--warmup", std::to_string(c.warmup), "--threads",
                                std::to_string(c.threads), "--out", result};
  if (pytorch_recipe(c) == "ddp") argv.push_back("--ddp");
  // No --wrap: gradsync's default units (one unit while the model is below kDefaultUnitParams), PyTorch's root.
  if (pytorch_recipe(c) == "fully_shard") argv.insert(argv.end(), {"--fully-shard", c.wrap.empty() ? "none" : c.wrap});
  run_job(c, argv, dir.file(fmt::format("pytorch-{}.out", run)), fmt::format("PyTorch ({})", c.python).c_str());
  std::ifstream in(result);
  auto j = nlohmann::json::parse(in);
  auto mine = j.at("step_seconds").get<std::vector<double>>();
  auto sent = j.at("sent").get<std::vector<double>>();
  double total = 0;
  for (double s : sent) total += s;
  stats.bytes_sent_per_step = sent.empty() ? -1 : total / static_cast<double>(sent.size());
  stats.peak_rss_bytes = std::max(stats.peak_rss_bytes, j.at("rss_peak").get<int64_t>());
  add_run(stats, mine);
}

// Run i's median of gradsync over run i's of PyTorch: neighbours in time, so the machine's drift mostly cancels.
std::vector<double> run_ratios(const StepStats& mine, const StepStats& theirs) {
  std::vector<double> out;
  for (size_t i = 0; i < std::min(mine.run_medians.size(), theirs.run_medians.size()); ++i) {
    out.push_back(mine.run_medians[i] / theirs.run_medians[i]);
  }
  return out;
}

// What a step costs beyond the compute floor, in seconds (medians): the price of a side's communication.
double over_floor(const StepStats& side, const StepStats& floor) {
  return median(side.step_seconds) - median(floor.step_seconds);
}

void print_table(const BenchConfig& c, const Measured& m) {
  fmt::print("gradsync bench: {} x{} ranks, {} per rank, {} thread(s), strategy {}, backend {}; {} runs x {} steps "
             "(+{} warm-up){}\n", c.model, ranks_of(c), c.per_rank_batch, c.threads, c.strategy, c.backend, c.repeats,
             c.steps, c.warmup, c.compare_pytorch ? fmt::format("; pytorch: {} on gloo", pytorch_recipe(c)) : "");
  const bool tokens = tokens_per_sample(c) > 1;
  fmt::print("  {:<10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>12}\n", "", "min ms", "median ms", "max ms",
             tokens ? "tokens/s" : "samples/s", "peak RSS MiB", "sent/step");
  auto row = [&](const char* name, const StepStats& s) {
    if (s.step_seconds.empty()) return;
    auto j = side_json(s, c);
    fmt::print("  {:<10} {:>10.2f} {:>10.2f} {:>10.2f} {:>12.0f} {:>12.1f} {:>12.0f}\n", name,
               1e3 * j["step_seconds"]["min"].get<double>(), 1e3 * j["step_seconds"]["median"].get<double>(),
               1e3 * j["step_seconds"]["max"].get<double>(),
               j[tokens ? "tokens_per_second" : "samples_per_second"].get<double>(),
               j["peak_memory_bytes_per_rank"].get<double>() / (1 << 20), j["bytes_sent_per_step"].get<double>());
  };
  row("gradsync", m.gradsync);
  row("pytorch", m.pytorch);
  row("floor", m.floor);
  row("plain-bn", m.plain_bn);
  row("traced", m.traced);
  if (!m.traced.step_seconds.empty()) {
    const auto& t = m.traced;
    fmt::print("  ratio traced/untraced (median step time): {:.3f}; traced, rank 0's medians: compute {:.2f} ms, "
               "communication {:.2f} ms, exposed {:.2f} ms, overlap {:.0f}%\n",
               median(t.step_seconds) / median(m.gradsync.step_seconds), 1e3 * median(t.compute),
               1e3 * median(t.communication), 1e3 * median(t.exposed), 100 * median(t.overlap));
  }
  if (!m.plain_bn.step_seconds.empty()) {
    fmt::print("  ratio --sync-bn/plain BatchNorm (median step time): {:.3f}\n",
               median(m.gradsync.step_seconds) / median(m.plain_bn.step_seconds));
  }
  if (!m.floor.step_seconds.empty()) {
    fmt::print("  over the floor (median): gradsync {:+.2f} ms", 1e3 * over_floor(m.gradsync, m.floor));
    if (!m.pytorch.step_seconds.empty()) fmt::print(", pytorch {:+.2f} ms", 1e3 * over_floor(m.pytorch, m.floor));
    fmt::print("\n");
  }
  if (m.pytorch.step_seconds.empty()) return;
  const auto pairs = run_ratios(m.gradsync, m.pytorch);
  const auto [lo, hi] = std::minmax_element(pairs.begin(), pairs.end());
  fmt::print("  ratio gradsync/pytorch (median step time): {:.3f} (run by run: {:.3f}-{:.3f})\n",
             median(m.gradsync.step_seconds) / median(m.pytorch.step_seconds), *lo, *hi);
}

nlohmann::json bench_json(const BenchConfig& c, const Measured& m) {
  nlohmann::json out{{"config", {{"model", c.model}, {"per_rank_batch", c.per_rank_batch},
                                 {"world_size", ranks_of(c)}, {"strategy", c.strategy}, {"wrap", c.wrap},
                                 {"backend", c.backend},
                                 {"threads", c.threads}, {"steps", c.steps}, {"warmup", c.warmup},
                                 {"repeats", c.repeats}, {"sync_bn", c.sync_bn}, {"trace", !c.trace.empty()}}},
                     {"gradsync", side_json(m.gradsync, c)}};
  if (c.compare_pytorch) {
    out["pytorch"] = side_json(m.pytorch, c);
    out["pytorch"]["backend"] = "gloo";
    out["pytorch"]["recipe"] = pytorch_recipe(c);
    out["ratio"] = median(m.gradsync.step_seconds) / median(m.pytorch.step_seconds);
    out["run_ratios"] = run_ratios(m.gradsync, m.pytorch);
  }
  if (c.sync_bn) {
    out["without_sync_bn"] = side_json(m.plain_bn, c);
    out["sync_bn_ratio"] = median(m.gradsync.step_seconds) / median(m.plain_bn.step_seconds);
  }
  if (!c.trace.empty()) {
    out["traced"] = side_json(m.traced, c);
    out["traced"]["breakdown"] = {{"compute_seconds", median(m.traced.compute)},
                                  {"communication_seconds", median(m.traced.communication)},
                                  {"exposed_seconds", median(m.traced.exposed)}, {"overlap", median(m.traced.overlap)}};
    out["trace_ratio"] = median(m.traced.step_seconds) / median(m.gradsync.step_seconds);
  }
  if (c.floor) {
    out["floor"] = side_json(m.floor, c);
    out["over_floor_seconds"] = {{"gradsync", over_floor(m.gradsync, m.floor)}};
    if (c.compare_pytorch) out["over_floor_seconds"]["pytorch"] = over_floor(m.pytorch, m.floor);
  }
  return out;
}

// After each run: its median step per side, and the time left at the runs' mean duration so far.
void print_run_progress(const BenchConfig& c, const Measured& m, int run, double elapsed) {
  std::string sides = fmt::format("gradsync {:.2f} ms", 1e3 * m.gradsync.run_medians.back());
  if (c.sync_bn) sides += fmt::format(", without --sync-bn {:.2f} ms", 1e3 * m.plain_bn.run_medians.back());
  if (!c.trace.empty()) sides += fmt::format(", traced {:.2f} ms", 1e3 * m.traced.run_medians.back());
  if (c.compare_pytorch) sides += fmt::format(", PyTorch {:.2f} ms", 1e3 * m.pytorch.run_medians.back());
  if (c.floor) sides += fmt::format(", floor {:.2f} ms", 1e3 * m.floor.run_medians.back());
  const double left = elapsed / (run + 1) * (c.repeats - run - 1);
  fmt::print(stderr, "[bench] run {}/{}: median step {}; {:.0f} s so far, about {:.0f} s left\n", run + 1, c.repeats,
             sides, elapsed, left);
}

}  // namespace

nlohmann::json side_json(const StepStats& s, const BenchConfig& c) {
  const double med = median(s.step_seconds);
  const auto [lo, hi] = std::minmax_element(s.step_seconds.begin(), s.step_seconds.end());
  return {{"step_seconds", {{"min", *lo}, {"median", med}, {"max", *hi}}},
          {"measured_steps", s.step_seconds.size()},
          {"run_medians", s.run_medians},
          {"samples_per_second", med > 0 ? static_cast<double>(c.per_rank_batch * ranks_of(c)) / med : 0.0},
          {"tokens_per_second", med > 0 ? static_cast<double>(c.per_rank_batch * ranks_of(c) * tokens_per_sample(c)) / med
                                        : 0.0},
          {"peak_memory_bytes_per_rank", s.peak_rss_bytes},
          {"bytes_sent_per_step", s.bytes_sent_per_step}};
}

int run_step_bench(const BenchConfig& c) {
  validate(c);
  TempDir dir("gradsync-bench-");
  Measured m;
  const auto start = Clock::now();
  for (int run = 0; run < c.repeats; ++run) {
    fmt::print(stderr, "[bench] run {}/{}: gradsync{}{}{}\n", run + 1, c.repeats, c.sync_bn ? ", without --sync-bn" : "",
               c.compare_pytorch ? ", PyTorch" : "", c.floor ? ", floor" : "");
    run_gradsync(c, dir, run, m.gradsync);
    if (c.sync_bn) run_gradsync(c, dir, run, m.plain_bn, "plain-bn");
    if (!c.trace.empty()) run_gradsync(c, dir, run, m.traced, "traced");
    if (c.compare_pytorch) run_pytorch(c, dir, run, m.pytorch);
    if (c.floor) run_floor(c, dir, run, m.floor);
    print_run_progress(c, m, run, std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::string plot_note = c.plot.empty() ? "" : plot_step_times(c.plot, m.gradsync, m.pytorch, c);
  if (!plot_note.empty()) fmt::print(stderr, "[bench] plot: {}\n", plot_note);
  if (c.json) {
    fmt::print("{}\n", bench_json(c, m).dump(2));
  } else {
    print_table(c, m);
  }
  return 0;
}

}  // namespace gradsync::cli
