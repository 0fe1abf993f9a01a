// `gradsync bench` and `gradsync bench allreduce`: flags (checked by CLI11's validators) -> bench.h.
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "bench/bench.h"
#include "launch/backend_flag.h"
#include "launch/launch.h"

namespace gradsync::cli {
namespace {

const std::vector<std::string> kStrategies{"local", "ddp", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "zero1"};

void add_allreduce_flags(CLI::App* cmd, AllreduceBenchConfig& c) {
  cmd->add_option("--bytes", c.sizes, "sizes per rank, e.g. 1M,16M (K/M/G: powers of 1024; default 1M,16M)")
      ->delimiter(',');
  cmd->add_option("--iterations", c.iterations, "timed allreduces per size (default 20)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", c.warmup, "untimed allreduces first (default 3)")->check(CLI::Range(0, 100000));
  cmd->add_option("--timeout", c.timeout_seconds, "seconds before a stalled collective fails (default 300)")
      ->check(CLI::Range(0.001, 86400.0));
}

void add_allreduce_command(CLI::App* bench, int& exit_code) {
  auto c = std::make_shared<AllreduceBenchConfig>();
  auto* cmd = bench->add_subcommand("allreduce", "gradsync's allreduce against the raw c10d Gloo / MPI_Allreduce "
                                                 "on the same bytes: time, algbw, busbw = algbw*2(N-1)/N");
  add_allreduce_flags(cmd, *c);
  cmd->add_option("--world-size", c->world_size, "ranks (default 2)")->check(CLI::Range(2, kMaxNproc));
  add_backend_flag(cmd, c->backend);
  cmd->add_flag("--json", c->json, "print one JSON document");
  cmd->callback([c, &exit_code] { exit_code = run_allreduce_bench(*c); });
}

// The rank side of `bench allreduce`, started by it through launch(); not for users.
void add_rank_command(CLI::App& root, int& exit_code) {
  auto c = std::make_shared<AllreduceBenchConfig>();
  auto out = std::make_shared<std::string>();
  auto* cmd = root.add_subcommand("bench-rank", "")->group("");  // hidden
  add_allreduce_flags(cmd, *c);
  cmd->add_option("--out", *out)->required();
  cmd->callback([c, out, &exit_code] { exit_code = run_allreduce_rank(*c, *out); });
}

}  // namespace

void add_bench_command(CLI::App& root, int& exit_code) {
  auto c = std::make_shared<BenchConfig>();
  auto* cmd = root.add_subcommand(
      "bench", "Time training steps (and memory, bytes sent) of a strategy, against PyTorch's DDP in the same run "
               "with --compare-pytorch; `bench allreduce` times the collective alone");
  cmd->add_option("--model", c->model, "mlp:IN-H...-OUT, mlp-bn:..., cnn:C1-C2-OUT, res:IN-H-B-OUT or gpt:V-T-D-L-H "
                  "(sequences of T random tokens, every position a target; tokens/s in the table) (default "
                  "mlp:1024-1024-1024-1024-1024-10)");
  cmd->add_option("--per-rank-batch", c->per_rank_batch, "samples per rank per step (default 64)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--world-size", c->world_size, "ranks (default 2; 1 for --strategy local)")
      ->check(CLI::Range(1, kMaxNproc));
  cmd->add_option("--strategy", c->strategy, "local, ddp (default), fsdp-full, fsdp-grad-op, fsdp-no-shard, zero1")
      ->check(CLI::IsMember(kStrategies));
  cmd->add_option("--wrap", c->wrap, "fsdp-*, zero1: units, as train's --wrap (default: train's)");
  add_backend_flag(cmd, c->backend);
  cmd->add_option("--threads", c->threads, "threads per rank on both sides (default 1)")->check(CLI::Range(1, 1024));
  cmd->add_option("--steps", c->steps, "measured steps per run (default 30)")->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", c->warmup, "unmeasured steps first (default 5)")->check(CLI::Range(0, 1000000));
  cmd->add_option("--repeats", c->repeats, "runs per side, interleaved (default 5)")->check(CLI::Range(1, 1000));
  cmd->add_flag("--compare-pytorch", c->compare_pytorch,
                "also run PyTorch on the same model, batch, threads and world size, interleaved: its DDP (Gloo), "
                "for fsdp-full its fully_shard on the same --wrap units (torch 2.x)");
  cmd->add_option("--python", c->python, "the Python whose torch --compare-pytorch runs (default: " GRADSYNC_PYTHON
                  ", the torch of the libtorch gradsync was built against)")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--sync-bn", c->sync_bn,
                "mlp-bn: gradsync trains with SyncBatchNorm, and the same job with plain BatchNorm runs interleaved "
                "(row plain-bn; PyTorch's side keeps plain BatchNorm, its SyncBatchNorm runs on CUDA only)");
  cmd->add_option("--trace", c->trace,
                  "also run gradsync's job with train --trace DIR/run-K, interleaved with the untraced one: what "
                  "tracing costs (row traced, trace_ratio) and the step's compute, communication, exposed time and "
                  "overlap");
  cmd->add_flag("--floor", c->floor,
                "also run as many --strategy local processes as ranks, all at once, each on one rank's batch: the "
                "step time if communication cost nothing, and each side's time over it");
  cmd->add_flag("--json", c->json, "print one JSON document instead of the table");
  cmd->add_option("--plot", c->plot, "write the step times as a PNG (gnuplot)");
  cmd->add_option("--timeout", c->timeout_seconds, "seconds a run may take (default 600)")
      ->check(CLI::Range(0.001, 86400.0));
  add_allreduce_command(cmd, exit_code);
  cmd->callback([c, cmd, &exit_code] {
    if (!cmd->get_subcommands().empty()) return;  // `bench allreduce` ran
    exit_code = run_step_bench(*c);
  });
  add_rank_command(root, exit_code);
}

}  // namespace gradsync::cli
