// The `gradsync train` command line: every flag, its help, and the callback that runs the job (see train.h).
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "gradsync/fsdp.h"
#include "launch/backend_flag.h"
#include "launch/launch.h"
#include "train/engine_factory.h"
#include "train/train.h"

namespace gradsync::cli {
namespace {

// This process's arguments after the program name, verbatim: the ranks re-run the same command.
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  if (!args.empty()) args.erase(args.begin());
  return args;
}

// The optimizer and its parameter groups.
void add_optimizer_options(CLI::App* cmd, TrainConfig& c) {
  cmd->add_option("--optimizer", c.optimizer, "sgd or adam")->check(CLI::IsMember({"sgd", "adam"}));
  cmd->add_option("--lr", c.lr, "learning rate (default 0.01 for sgd, 1e-3 for adam)");
  cmd->add_option("--momentum", c.momentum, "sgd momentum (default 0)");
  cmd->add_option("--weight-decay", c.weight_decay, "L2 weight decay (default 0)");
  cmd->add_flag("--no-decay-1d", c.no_decay_1d,
                "no weight decay on parameters of one dimension (biases, norm weights): a second optimizer group");
  cmd->add_option("--freeze", c.freeze, "freeze the parameters whose names start with PREFIX (e.g. inp. or 0.): "
                  "no gradient, no communication")
      ->delimiter(',')
      ->type_name("PREFIX[,PREFIX...]");
}

// The engine's own flags: sharding (fsdp-*), DDP's communication hook, memory reporting.
void add_engine_options(CLI::App* cmd, TrainConfig& c) {
  cmd->add_option("--wrap", c.wrap,
                  fmt::format("fsdp-*, zero1: units: children (the elements of the outermost Sequentials, one unit "
                              "each), params:N (consecutive elements until N parameters; fsdp's default params:{}, "
                              "25 MiB of fp32 per unit, DDP's bucket size), list:A,B (modules by qualified name, e.g. "
                              "blocks.0) or type:T,U (every module of a type, e.g. Block); the rest form the root "
                              "unit. zero1 default: one flat parameter", kDefaultUnitParams));
  cmd->add_option("--param-dtype", c.param_dtype, "fsdp-*: compute dtype fp32, bf16, fp16 or fp64 (master stays fp32)");
  cmd->add_option("--reduce-dtype", c.reduce_dtype, "fsdp-*: gradient reduction dtype (default the param dtype)");
  cmd->add_option("--accumulate-grads", c.accumulate_grads,
                  "fsdp-* with --accumulate: full (no_sync, one reduce-scatter per step; default) or sharded "
                  "(reduce-scatter every micro-step, gradient memory stays 1/N)");
  cmd->add_option("--replicas", c.replicas,
                  "hsdp, hsdp-grad-op: R replica groups of N/R ranks, each sharding the model (rank = replica * N/R + "
                  "shard index); default: one per host. R = 1 is fsdp-full, R = N replicates like ddp")
      ->check(CLI::Range(1, kMaxNproc));
  cmd->add_flag("--shard-across-hosts", c.shard_across_hosts,
                "hsdp, hsdp-grad-op: allow a shard group to span hosts (its all-gathers then cross the network)");
  cmd->add_option("--comm-hook", c.comm_hook, "ddp: none (default), allreduce, fp16 or bf16 (PyTorch's hooks)")
      ->check(CLI::IsMember(comm_hook_names()));
  cmd->add_option("--bucket-cap-mb", c.bucket_cap_mb,
                  "ddp: MiB of gradients per bucket, as PyTorch's bucket_cap_mb (default 25)")
      ->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--first-bucket-mb", c.first_bucket_mb,
                  "ddp: MiB of the first bucket, which PyTorch keeps small so communication starts early (default 1)")
      ->check(CLI::Range(1e-6, 1e6));
  cmd->add_flag("--no-prefetch", c.no_prefetch,
                "fsdp-full: gather one unit at a time (lowest memory) instead of prefetching the next unit's all-gather");
  cmd->add_flag("--report-memory", c.report_memory,
                "memory (parameters, gradients, optimizer state) and bytes sent per rank in the log and summary "
                "(always on for sharded strategies)");
}

// The files a run reads and writes besides its data and checkpoints.
void add_file_options(CLI::App* cmd, TrainConfig& c) {
  cmd->add_option("--init-state", c.init_state, "initial state dict, from torch.save(model.state_dict(), FILE) or a gradsync --save-state file");
  cmd->add_option("--save-state", c.save_state, "write the final state dict (Python torch.load reads it)");
  cmd->add_option("--save-optim", c.save_optim, "write the final optimizer state, whole, keyed by parameter names "
                  "(PyTorch's FSDP.full_optim_state_dict layout; Python torch.load reads it)");
  cmd->add_option("--log", c.log, "JSON lines: step, epoch, loss, samples, seconds, world_size, accumulate");
  cmd->add_flag("--log-samples", c.log_samples,
                "with --log: every step's dataset indices over all ranks (sample_ids; padding duplicates included)")
      ->needs("--log");
}

// Checkpoints, resuming and restarts (train/checkpointing.h, docs/semantics.md Note [Resuming]).
void add_checkpoint_options(CLI::App* cmd, TrainConfig& c) {
  cmd->add_option("--checkpoint-dir", c.checkpoint_dir,
                  "save checkpoints in DIR/step-<N>/ (model, optimizer state, data position, RNG states; manifest "
                  "last): every --checkpoint-every steps and after the last step");
  cmd->add_option("--checkpoint-every", c.checkpoint_every, "steps between checkpoints (default: every epoch's end)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  cmd->add_option("--keep", c.keep_checkpoints, "keep only the newest K checkpoints (default 0: all)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--resume", c.resume,
                "continue from the newest complete checkpoint in --checkpoint-dir (bit for bit), or start at "
                "step 0 when it holds none");
  cmd->add_option("--max-restarts", c.max_restarts,
                  "after a rank fails, restart every rank from the newest checkpoint, at most R times (default 0)")
      ->check(CLI::Range(0, kMaxRestarts));
}

// The model, its data and loss, and what --eval and --sample report of it.
void add_model_options(CLI::App* cmd, TrainConfig& c) {
  cmd->add_option("--model", c.model, "mlp:IN-H...-OUT, mlp-bn:IN-H...-OUT (BatchNorm1d per hidden layer), "
                  "cnn:C1-C2-OUT (two Conv2d+ReLU+MaxPool2d, then Linear, on 28x28 images), res:IN-H-B-OUT "
                  "(Linear, B residual blocks h + fc(relu(norm(h))), Linear) or gpt:V-T-D-L-H (a transformer: "
                  "vocabulary V, context T, width D, L blocks, H heads; output layer tied to the embedding)")
      ->required();
  cmd->add_option("--data", c.data, "fashion-mnist, synthetic:N, or a file from torch.save({'inputs': X, 'targets': "
                  "Y}); gpt: fortunes, text:PATH (documents separated by lines holding only %; bytes as tokens, "
                  "every 10th document held out for --eval) or a file of int64 [S, L] inputs and targets (-100: "
                  "not trained on)")
      ->required();
  cmd->add_option("--dtype", c.dtype, "fp32 (default) or fp64: the whole model after --init-state, float data and "
                  "the loss")
      ->check(CLI::IsMember({"fp32", "fp64"}));
  cmd->add_option("--loss", c.loss, "ce (cross-entropy) or mse")->check(CLI::IsMember({"ce", "mse"}));
  cmd->add_option("--loss-reduction", c.loss_reduction, "mean or sum over one micro-batch's samples (token data: "
                  "over its valid tokens; a micro-batch without one is an error under mean)")
      ->check(CLI::IsMember({"mean", "sum"}));
  cmd->add_flag("--eval", c.eval, "after every epoch and at the end: accuracy on the test split (fashion-mnist:test; "
                "gpt on text: the held-out documents, with the loss in nats per token and bits per byte)");
  cmd->add_option("--eval-data", c.eval_data, "the split --eval uses (a data spec; implies --eval)");
  cmd->add_option("--sample", c.sample, "gpt on text: print N bytes the trained model generates (fixed seed)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
}

}  // namespace

void add_train_command(CLI::App& root, int& exit_code) {
  auto config = std::make_shared<TrainConfig>();
  auto* cmd = root.add_subcommand("train", "Train a model locally or data-parallel (the PyTorch DDP recipe, in C++)");
  auto& c = *config;
  add_model_options(cmd, c);
  cmd->add_option("--global-batch", c.global_batch, "samples per optimizer step over all ranks and micro-steps")
      ->required();
  cmd->add_option("--accumulate", c.accumulate, "micro-batches per step; each rank's micro-batch is B/(N*K)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--world-size", c.world_size, "ranks, 1..1024; without a launcher, train starts them itself")
      ->check(CLI::Range(1, kMaxNproc));
  add_backend_flag(cmd, c.backend);
  cmd->add_option("--strategy", c.strategy,
                  "local (one process, no communication), ddp, fsdp-full (ZeRO-3), fsdp-grad-op (ZeRO-2), "
                  "fsdp-no-shard, hsdp or hsdp-grad-op (hybrid: shard inside a host, replicate across hosts; see "
                  "--replicas) or zero1 (see docs/sharding.md)")
      ->transform(CLI::CheckedTransformer(strategy_names(), CLI::ignore_case).description(""));
  add_optimizer_options(cmd, c);
  cmd->add_option("--reduction", c.reduction,
                  "mean (PyTorch DDP: 1/N of the sum), sum, or global-mean (1/T of the sum of per-sample gradients, "
                  "T = samples, or valid tokens, in the step over all ranks and micro-batches)")
      ->check(CLI::IsMember({"mean", "sum", "global-mean"}));
  auto* steps = cmd->add_option("--steps", c.steps, "optimizer steps in total (crossing epochs)")
                    ->check(CLI::Range(int64_t{0}, int64_t{1} << 50));
  auto* epochs = cmd->add_option("--epochs", c.epochs, "whole epochs (default 1)")
                     ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  steps->excludes(epochs);
  cmd->add_option("--seed", c.seed, "seed of the model, the sampler and synthetic data (default 0)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 63));
  cmd->add_flag("--shuffle,!--no-shuffle", c.shuffle, "shuffle every epoch (default) or not");
  cmd->add_flag("--sync-bn", c.sync_bn,
                "BatchNorm statistics over every rank's micro-batch, weighted by count (SyncBatchNorm; "
                "docs/semantics.md); without it each rank normalises with its own");
  cmd->add_flag("--no-pad", c.no_pad, "every sample exactly once per epoch (ranks may get uneven counts, even 0)");
  cmd->add_option("--replay-ranks", c.replay_ranks,
                  "with --strategy local: train one process on exactly the global batches of N ranks (a reference)");
  cmd->add_option("--verify-every", c.verify_every,
                  "every S steps: recompute the step's gradient in one process on rank 0 and compare; ddp, "
                  "fsdp-no-shard: check that all ranks hold identical parameters (off by default; costs one extra "
                  "forward/backward of the global batch on rank 0)");
  cmd->add_option("--inject-fault", c.inject_fault,
                  "tests only: grad@STEP, diverge@STEP, crash@STEP (the last rank SIGKILLs itself before STEP in a "
                  "first attempt) or crash-always@STEP")
      ->group("");
  add_file_options(cmd, c);
  cmd->add_option("--timeout", c.timeout_seconds, "seconds before a stalled collective fails (default 1800)")
      ->check(CLI::Range(0.001, 86400.0 * 365));
  cmd->add_flag("--quiet", c.quiet, "no progress and no summary line");
  cmd->add_option("--trace", c.trace_dir,
                  "write a timeline: DIR/trace-rank-R.json per rank and DIR/trace.json with every rank (Chrome "
                  "trace-event JSON for Perfetto or chrome://tracing), and each step's compute, communication and "
                  "exposed communication in --log and the summary");
  cmd->add_option("--log-every", c.log_every,
                  "progress on stderr when it is not a terminal: a line every N steps and after the last (default: "
                  "about twenty lines in the run); on a terminal one line rewritten after every step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  add_engine_options(cmd, c);
  add_checkpoint_options(cmd, c);
  cmd->callback([config, &exit_code] { exit_code = run_train(*config, own_arguments()); });
}

}  // namespace gradsync::cli
