// `gradsync train` (see train.h). The loop mirrors a Python DataLoader over DistributedSampler exactly, so the
// same flags give the same parameters as the PyTorch reference (tests/reference/torch_train.py).
#include "train/train.h"

#include <unistd.h>

#include <chrono>
#include <fstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/data.h"
#include "gradsync/accumulate.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/stats.h"
#include "gradsync/sampler.h"
#include "gradsync/state_dict.h"
#include "launch/launch.h"
#include "data/models.h"
#include "train/schedule.h"
#include "train/sharded_training.h"
#include "train/train_step.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

bool under_launcher() {
  return process_env("RANK") || process_env("WORLD_SIZE") || process_env("OMPI_COMM_WORLD_RANK");
}

// Over the model's parameters, or this rank's shards of them (sharded strategies).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, const std::vector<torch::Tensor>& params) {
  if (c.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(c.lr.value_or(1e-3)).weight_decay(c.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      params,
      torch::optim::SGDOptions(c.lr.value_or(0.01)).momentum(c.momentum.value_or(0)).weight_decay(c.weight_decay));
}

class StepLog {
 public:
  StepLog(const std::string& path, bool enabled) {
    if (!enabled || path.empty()) return;
    file_.open(path);
    if (!file_) throw ConfigError(fmt::format("--log {}: cannot open for writing: {}", path, std::strerror(errno)));
  }
  void write(const StepRecord& r) {
    if (!file_.is_open()) return;
    nlohmann::json line{{"step", r.step}, {"epoch", r.epoch}, {"loss", r.loss}, {"samples", r.samples},
                        {"seconds", r.seconds}};
    if (r.memory_peak >= 0) line["memory_peak"] = r.memory_peak;
    if (r.sent_bytes >= 0) line["sent_bytes"] = r.sent_bytes;
    file_ << line.dump() << "\n" << std::flush;
  }

 private:
  std::ofstream file_;
};

// Progress on one line when a person is watching (stderr is a terminal, or the parent `train` saw one).
class Progress {
 public:
  Progress(bool enabled, int64_t total) : enabled_(enabled), total_(total) {}
  void update(const StepRecord& r) {
    if (enabled_) fmt::print(stderr, "\rstep {}/{}  epoch {}  loss {:.4f}   ", r.step + 1, total_, r.epoch, r.loss);
  }
  ~Progress() {
    if (enabled_) fmt::print(stderr, "\n");
  }

 private:
  bool enabled_;
  int64_t total_;
};

int64_t total_steps(const TrainConfig& c, int64_t steps_per_epoch) {
  if (c.steps) return *c.steps;
  return c.epochs.value_or(1) * steps_per_epoch;
}

}  // namespace

void validate(const TrainConfig& c, int world_size) {
  parse_model_spec(c.model);
  parse_loss_kind(c.loss);
  parse_reduction(c.reduction);
  if (c.strategy != "local" && c.strategy != "ddp" && !is_sharded_strategy(c.strategy)) {
    throw ConfigError(fmt::format("--strategy {} is not known; expected local, ddp, fsdp-full, fsdp-grad-op, "
                                  "fsdp-no-shard or zero1", c.strategy));
  }
  validate_sharding_flags(c);
  if (c.strategy == "local" && world_size > 1) {
    throw ConfigError(fmt::format("--strategy local runs one process, but the world size is {}; use --strategy "
                                  "ddp or drop --world-size", world_size));
  }
  if (c.optimizer != "sgd" && c.optimizer != "adam") {
    throw ConfigError(fmt::format("--optimizer {} is not known; expected sgd or adam", c.optimizer));
  }
  if (c.optimizer == "adam" && c.momentum) {
    throw ConfigError("--momentum applies to sgd only; adam's moments are betas (0.9, 0.999)");
  }
  if (c.lr && !(*c.lr > 0)) throw ConfigError(fmt::format("--lr {} is invalid; expected > 0", *c.lr));
  if (c.momentum && *c.momentum < 0) throw ConfigError(fmt::format("--momentum {} is invalid; expected >= 0", *c.momentum));
  if (c.weight_decay < 0) throw ConfigError(fmt::format("--weight-decay {} is invalid; expected >= 0", c.weight_decay));
  if (c.loss_reduction != "mean" && c.loss_reduction != "sum") {
    throw ConfigError(fmt::format("--loss-reduction {} is not known; expected mean or sum", c.loss_reduction));
  }
  if (c.global_batch < 1) throw ConfigError(fmt::format("--global-batch {} is invalid; expected >= 1", c.global_batch));
  if (c.accumulate < 1) throw ConfigError(fmt::format("--accumulate {} is invalid; expected >= 1", c.accumulate));
  if (c.steps && *c.steps < 0) throw ConfigError(fmt::format("--steps {} is invalid; expected >= 0", *c.steps));
  if (c.epochs && *c.epochs < 0) throw ConfigError(fmt::format("--epochs {} is invalid; expected >= 0", *c.epochs));
  const int64_t ranks_times_k = std::max(world_size, c.replay_ranks) * c.accumulate;
  if (c.global_batch % ranks_times_k != 0) {
    throw ConfigError(fmt::format(
        "--global-batch {} is not divisible by world size {} x accumulate {} = {}: each rank's micro-batch is "
        "B/(N*K) samples; choose B as a multiple of {}",
        c.global_batch, std::max(world_size, c.replay_ranks), c.accumulate, ranks_times_k, ranks_times_k));
  }
  if (c.reduction == "global-mean" && c.loss_reduction != "mean") {
    throw ConfigError("--reduction global-mean divides the summed per-sample losses by the step's sample count "
                      "itself; use it with --loss-reduction mean");
  }
  if (c.replay_ranks != 0 && (c.strategy != "local" || c.replay_ranks < 1)) {
    throw ConfigError(fmt::format("--replay-ranks {} is invalid; expected an integer >= 1 with --strategy local",
                                  c.replay_ranks));
  }
  if (c.verify_every < 0 || (c.verify_every > 0 && c.strategy == "local")) {
    throw ConfigError(fmt::format("--verify-every {} is invalid; expected >= 0, with a data-parallel strategy",
                                  c.verify_every));
  }
  if (c.timeout_seconds <= 0) throw ConfigError(fmt::format("--timeout {} is invalid; expected > 0", c.timeout_seconds));
}

std::vector<StepRecord> train_rank(const TrainConfig& c, const std::shared_ptr<World>& world) {
  const int n = world ? world->size() : 1;
  const int rank = world ? world->rank() : 0;
  validate(c, n);
  torch::manual_seed(c.seed);
  auto model = make_model(c.model);
  if (!c.init_state.empty()) load_into(*model, load_state_dict(c.init_state));
  const auto spec = parse_model_spec(c.model);
  auto data = load_dataset(c.data, spec.input_size(), spec.output_size(), parse_loss_kind(c.loss), c.seed);

  const int64_t model_bytes = parameter_bytes(*model);
  std::unique_ptr<Ddp> ddp;
  std::unique_ptr<ShardedTraining> sharded;
  if (world && is_sharded_strategy(c.strategy)) {
    sharded = make_sharded_training(c, model, world);
  } else if (world) {
    DdpOptions options;
    options.reduction = parse_reduction(c.reduction);
    ddp = std::make_unique<Ddp>(model, world, options);
  }
  model->train();
  auto optimizer = make_optimizer(c, sharded ? sharded->parameters() : model->parameters());
  if (sharded) sharded->track(*optimizer);
  const bool report = sharded || c.report_memory;
  MemoryMeter meter;  // local and ddp: parameters, .grad, optimizer state after every step
  // The data schedule of `ranks` ranks: this job's, or the one a local run replays.
  const int ranks = world ? n : std::max(c.replay_ranks, 1);
  const int64_t b = c.global_batch / (ranks * c.accumulate);
  BatchSchedule schedule(data.size(), ranks, b, c.accumulate, c.shuffle, c.seed, !c.no_pad);
  const int64_t steps = total_steps(c, schedule.steps_per_epoch());
  StepContext ctx{c, data, model, ddp.get(), world, parse_reduction(c.reduction)};
  ctx.sharded = sharded.get();

  StepLog log(c.log, rank == 0);
  Progress progress(rank == 0 && !c.quiet && (isatty(STDERR_FILENO) || process_env("GRADSYNC_PROGRESS")), steps);
  std::vector<StepRecord> records;
  for (int64_t step = 0, epoch = 0; step < steps; ++epoch) {
    schedule.set_epoch(epoch);
    for (int64_t s = 0; s < schedule.steps_per_epoch() && step < steps; ++s, ++step) {
      const auto start = Clock::now();
      StepRecord record{step, epoch, 0, 0, 0};
      const int64_t written_before = report ? process_bytes_written() : 0;
      try {
        if (sharded) {
          run_sharded_step(ctx, schedule.step(rank, s), record);
        } else if (ddp) {
          run_ddp_step(ctx, schedule.step(rank, s), record);
        } else {
          std::vector<std::vector<torch::Tensor>> all;
          for (int r = 0; r < ranks; ++r) all.push_back(schedule.step(r, s));
          run_local_step(ctx, all, record);
        }
      } catch (const c10::Error& e) {
        // e.g. BatchNorm1d given a 1-sample micro-batch: say where, and what to change.
        throw ConfigError(fmt::format("rank {}: step {} (epoch {}), micro-batch size {}: {} (change --global-batch, "
                                      "--accumulate or --world-size so that no micro-batch is degenerate)",
                                      rank, step, epoch, b, e.what_without_backtrace()));
      }
      const bool verify = ddp && c.verify_every > 0 && step % c.verify_every == 0;
      if (verify) verify_gradient(ctx, schedule.step(rank, s), step);
      if (sharded) {
        sharded->step(*optimizer);
      } else {
        optimizer->step();
      }
      if (report && !sharded) meter.sample(module_memory(*model, optimizer.get()));
      if (sharded) {
        sharded->zero_grad();
      } else if (ddp) {
        ddp->zero_grad();
      } else {
        model->zero_grad(/*set_to_none=*/false);
      }
      if (verify) verify_replicas(ctx, step);
      record.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (report) {
        record.sent_bytes = process_bytes_written() - written_before;
        record.memory_peak = (sharded ? sharded->memory() : meter.stats()).peak_total();
      }
      log.write(record);
      progress.update(record);
      records.push_back(record);
    }
    if (schedule.steps_per_epoch() == 0) break;
  }
  if (sharded && !c.save_state.empty()) {
    auto full = sharded->full_state_dict();  // a collective: gathered onto rank 0
    if (rank == 0) save_state_dict(full, c.save_state);
  } else if (rank == 0 && !c.save_state.empty()) {
    save_state_dict(state_dict(*model), c.save_state);
  }
  if (report && !c.quiet) {
    if (sharded && rank == 0) fmt::print("gradsync train: {}\n", sharded->describe());
    print_resource_report(c.strategy, sharded ? sharded->memory() : meter.stats(), mean_sent_bytes(records),
                          model_bytes, world);
  }
  if (world && n > 1) world->comm().barrier();  // no rank exits while another still needs it
  return records;
}

namespace {

std::string self_executable() {
  char buf[4096];
  ssize_t len = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (len <= 0) throw Error("cannot resolve /proc/self/exe to start the ranks");
  return std::string(buf, static_cast<size_t>(len));
}

// This process's arguments after the program name, verbatim: the ranks re-run the same command.
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  if (!args.empty()) args.erase(args.begin());
  return args;
}

void print_summary(const TrainConfig& c, const std::vector<StepRecord>& records, int world_size) {
  if (c.quiet) return;
  if (records.empty()) {
    fmt::print("gradsync train: 0 steps\n");
    return;
  }
  const auto& last = records.back();
  fmt::print("gradsync train: {} steps, {} epoch(s), world size {}, {} reduction; final loss {:.6f}{}\n",
             records.size(), last.epoch + 1, world_size, c.strategy == "local" ? "no" : c.reduction, last.loss,
             c.save_state.empty() ? "" : fmt::format("; state saved to {}", c.save_state));
}

}  // namespace

int run_train(const TrainConfig& c, const std::vector<std::string>& argv) {
  // (argv: this program's arguments, used to start the ranks)
  if (c.strategy == "local") {
    validate(c, std::max(c.world_size, 1));
    auto records = train_rank(c, nullptr);
    print_summary(c, records, 1);
    return 0;
  }
  if (under_launcher()) {
    const auto env = read_launch_env();
    if (c.world_size != 0 && c.world_size != env.world_size) {
      throw ConfigError(fmt::format("--world-size {} disagrees with the launcher's WORLD_SIZE={}", c.world_size,
                                    env.world_size));
    }
    validate(c, env.world_size);
    auto world = init({std::chrono::milliseconds(static_cast<int64_t>(c.timeout_seconds * 1000)), env});
    auto records = train_rank(c, world);
    if (world->is_main()) print_summary(c, records, world->size());
    return 0;
  }
  const int n = std::max(c.world_size, 1);
  validate(c, n);  // fail here, once, before any rank starts
  if (n == 1) {
    auto world = init({std::chrono::milliseconds(static_cast<int64_t>(c.timeout_seconds * 1000)), std::nullopt});
    auto records = train_rank(c, world);
    print_summary(c, records, 1);
    return 0;
  }
  LaunchOptions launch_options;
  launch_options.nproc = n;
  launch_options.prefix_output = false;  // only rank 0 prints; errors carry their rank in the message
  launch_options.command = {self_executable()};
  launch_options.command.insert(launch_options.command.end(), argv.begin(), argv.end());
  if (isatty(STDERR_FILENO)) launch_options.extra_env.emplace_back("GRADSYNC_PROGRESS", "1");
  return launch(launch_options);
}

void add_train_command(CLI::App& root, int& exit_code) {
  auto config = std::make_shared<TrainConfig>();
  auto* cmd = root.add_subcommand("train", "Train a model locally or data-parallel (the PyTorch DDP recipe, in C++)");
  auto& c = *config;
  cmd->add_option("--model", c.model, "mlp:IN-H...-OUT or mlp-bn:IN-H...-OUT (Linear, BatchNorm1d, ReLU per hidden layer)")
      ->required();
  cmd->add_option("--data", c.data, "fashion-mnist, synthetic:N, or a file from torch.save({'inputs': X, 'targets': Y})")
      ->required();
  cmd->add_option("--global-batch", c.global_batch, "samples per optimizer step over all ranks and micro-steps")
      ->required();
  cmd->add_option("--accumulate", c.accumulate, "micro-batches per step; each rank's micro-batch is B/(N*K)");
  cmd->add_option("--world-size", c.world_size, "ranks; without a launcher, train starts them itself");
  cmd->add_option("--strategy", c.strategy,
                  "local (one process, no communication), ddp, fsdp-full (ZeRO-3), fsdp-grad-op (ZeRO-2), "
                  "fsdp-no-shard or zero1 (see docs/sharding.md)");
  cmd->add_option("--optimizer", c.optimizer, "sgd or adam");
  cmd->add_option("--lr", c.lr, "learning rate (default 0.01 for sgd, 1e-3 for adam)");
  cmd->add_option("--momentum", c.momentum, "sgd momentum (default 0)");
  cmd->add_option("--weight-decay", c.weight_decay, "L2 weight decay (default 0)");
  cmd->add_option("--loss", c.loss, "ce (cross-entropy) or mse");
  cmd->add_option("--loss-reduction", c.loss_reduction, "mean or sum over one micro-batch's samples");
  cmd->add_option("--reduction", c.reduction,
                  "mean (PyTorch DDP: 1/N of the sum), sum, or global-mean (1/T of the sum of per-sample gradients, "
                  "T = samples in the step over all ranks and micro-batches)");
  auto* steps = cmd->add_option("--steps", c.steps, "optimizer steps in total (crossing epochs)");
  auto* epochs = cmd->add_option("--epochs", c.epochs, "whole epochs (default 1)");
  steps->excludes(epochs);
  cmd->add_option("--seed", c.seed, "seed of the model, the sampler and synthetic data (default 0)");
  cmd->add_flag("--shuffle,!--no-shuffle", c.shuffle, "shuffle every epoch (default) or not");
  cmd->add_flag("--no-pad", c.no_pad, "every sample exactly once per epoch (ranks may get uneven counts, even 0)");
  cmd->add_option("--replay-ranks", c.replay_ranks,
                  "with --strategy local: train one process on exactly the global batches of N ranks (a reference)");
  cmd->add_option("--verify-every", c.verify_every,
                  "every S steps: recompute the step's gradient in one process on rank 0 and compare; check that all "
                  "ranks hold identical parameters (off by default; costs one extra forward/backward of the global "
                  "batch on rank 0)");
  cmd->add_option("--inject-fault", c.inject_fault, "tests only: grad@STEP or diverge@STEP")->group("");
  cmd->add_option("--init-state", c.init_state, "initial state dict, from torch.save(dict(model.state_dict()), FILE)");
  cmd->add_option("--save-state", c.save_state, "write the final state dict (Python torch.load reads it)");
  cmd->add_option("--log", c.log, "JSON lines: step, epoch, loss, samples, seconds");
  cmd->add_option("--timeout", c.timeout_seconds, "seconds before a stalled collective fails (default 1800)");
  cmd->add_flag("--quiet", c.quiet, "no summary line");
  cmd->add_option("--wrap", c.wrap, "fsdp-*: units: children (default), params:N (consecutive children until N "
                  "parameters) or list:A,B (named children; the rest form the root unit)");
  cmd->add_option("--param-dtype", c.param_dtype, "fsdp-*: compute dtype fp32, bf16, fp16 or fp64 (master stays fp32)");
  cmd->add_option("--reduce-dtype", c.reduce_dtype, "fsdp-*: gradient reduction dtype (default the param dtype)");
  cmd->add_option("--accumulate-grads", c.accumulate_grads,
                  "fsdp-* with --accumulate: full (no_sync, one reduce-scatter per step; default) or sharded "
                  "(reduce-scatter every micro-step, gradient memory stays 1/N)");
  cmd->add_flag("--report-memory", c.report_memory,
                "memory (parameters, gradients, optimizer state) and bytes sent per rank in the log and summary "
                "(always on for sharded strategies)");
  cmd->callback([config, &exit_code] { exit_code = run_train(*config, own_arguments()); });
}

}  // namespace gradsync::cli
