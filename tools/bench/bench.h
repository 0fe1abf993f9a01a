// defines: `gradsync bench`, speed and memory measured against PyTorch in the same run.
//   bench_step.cpp        training steps: gradsync `train` jobs, python3-torch jobs and the compute floor (local
//                         processes at once), interleaved (BenchConfig)
//   pytorch_ddp.cpp       the python3-torch program those jobs run (PyTorch's DDP recipe, timed the same way)
//   bench_allreduce.cpp   `bench allreduce`: gradsync's allreduce next to the raw c10d Gloo / MPI_Allreduce
//   bench_plot.cpp        --plot: a gnuplot PNG of the step times
//   bench_command.cpp     the CLI
// Speed targets live here, never in tests as timed assertions.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/median.h"

namespace CLI {
class App;
}

namespace gradsync::cli {

struct BenchConfig {
  std::string model = "mlp:1024-1024-1024-1024-1024-10";
  int64_t per_rank_batch = 64;
  int world_size = 2;
  std::string strategy = "ddp";
  std::string wrap;            // fsdp-*, zero1: train's --wrap ("" = train's default units)
  std::string backend = "gloo";
  int threads = 1;             // OMP_NUM_THREADS / torch.set_num_threads per rank, on both sides
  int64_t steps = 30;          // measured steps per run
  int64_t warmup = 5;          // steps before them, not measured
  int repeats = 5;             // runs per side, interleaved: gradsync, PyTorch, gradsync, ...
  bool compare_pytorch = false;
  std::string python = GRADSYNC_PYTHON;  // the PyTorch compared with: the torch of gradsync's own libtorch line
  bool floor = false;          // also run world_size `--strategy local` processes at once: the compute floor
  bool sync_bn = false;        // gradsync trains with --sync-bn, and the same job without it runs interleaved
  std::string trace;           // DIR: gradsync's job runs with --trace DIR/run-K too, interleaved with the untraced
  bool json = false;
  std::string plot;            // PNG path, "" = none
  double timeout_seconds = 600;
};

// What one side measured, pooled over its runs: rank 0's step times (every rank waits for the others each step),
// or for the floor every process's.
struct StepStats {
  std::vector<double> step_seconds;   // measured steps of every run, in order
  std::vector<double> run_medians;    // one per run
  int64_t peak_rss_bytes = -1;        // rank 0's peak resident memory (VmHWM; the floor: any process's), max over runs
  double bytes_sent_per_step = -1;    // rank 0, mean over measured steps
  // Traced jobs: rank 0's per-step figures from the log (trace.h's StepBreakdown), measured steps of every run.
  std::vector<double> compute, communication, exposed, overlap;
};

// Validates (ConfigError naming the flag), runs the interleaved jobs, prints a table or JSON; returns the exit code.
int run_step_bench(const BenchConfig& config);

// The JSON `bench --json` prints: {"config", "gradsync": {...}, "pytorch": {...}, "ratio", "run_ratios"}, and with
// --floor "floor": {...} and "over_floor_seconds": {"gradsync", "pytorch"} (median step minus the floor's median), and
// with --sync-bn "without_sync_bn": {...} and "sync_bn_ratio" (gradsync's median over that side's), with --trace
// "traced": {..., "breakdown": {"compute_seconds", "communication_seconds", "exposed_seconds", "overlap"} (medians)}
// and "trace_ratio" (the traced median step over the untraced one's).
nlohmann::json side_json(const StepStats& stats, const BenchConfig& config);

// Writes `png` from the step times of both sides (pytorch may be empty). Returns "" or why it could not.
std::string plot_step_times(const std::string& png, const StepStats& gradsync, const StepStats& pytorch,
                            const BenchConfig& config);

// The python3-torch program behind --compare-pytorch (its text; written to a temp file and run).
const char* pytorch_ddp_program();

struct AllreduceBenchConfig {
  std::vector<std::string> sizes{"1M", "16M"};  // bytes per rank, K/M/G suffixes (powers of 1024)
  std::string backend = "gloo";
  int world_size = 2;
  int iterations = 20;
  int warmup = 3;
  bool json = false;
  double timeout_seconds = 300;
};
int run_allreduce_bench(const AllreduceBenchConfig& config);
// The rank side of `bench allreduce` (hidden `gradsync bench-rank`): writes its JSON lines to `out`.
int run_allreduce_rank(const AllreduceBenchConfig& config, const std::string& out);
int64_t parse_byte_size(const std::string& text);  // "16M" -> 16777216; ConfigError otherwise

void add_bench_command(CLI::App& root, int& exit_code);

}  // namespace gradsync::cli
