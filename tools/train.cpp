// `gradsync train` (see train.h). The loop mirrors a Python DataLoader over DistributedSampler exactly, so the
// same flags give the same parameters as the PyTorch reference (tests/reference/torch_train.py).
#include "train.h"

#include <unistd.h>

#include <chrono>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "data.h"
#include "gradsync/accumulate.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/sampler.h"
#include "gradsync/state_dict.h"
#include "launch.h"
#include "models.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;
using Ddp = DistributedDataParallel<torch::nn::Sequential>;

bool under_launcher() {
  return process_env("RANK") || process_env("WORLD_SIZE") || process_env("OMPI_COMM_WORLD_RANK");
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, torch::nn::Sequential& model) {
  if (c.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(
        model->parameters(), torch::optim::AdamOptions(c.lr.value_or(1e-3)).weight_decay(c.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      model->parameters(),
      torch::optim::SGDOptions(c.lr.value_or(0.01)).momentum(c.momentum.value_or(0)).weight_decay(c.weight_decay));
}

torch::Tensor compute_loss(const TrainConfig& c, const torch::Tensor& output, const torch::Tensor& target) {
  namespace F = torch::nn::functional;
  const bool mean = c.loss_reduction == "mean";
  if (c.loss == "mse") {
    return mean ? F::mse_loss(output, target, F::MSELossFuncOptions(torch::kMean))
                : F::mse_loss(output, target, F::MSELossFuncOptions(torch::kSum));
  }
  return mean ? F::cross_entropy(output, target, F::CrossEntropyFuncOptions().reduction(torch::kMean))
              : F::cross_entropy(output, target, F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// One epoch's micro-batches on this rank: consecutive chunks of b sampler indices, the last one possibly short
// (a Python DataLoader(batch_size=b, drop_last=False) over the sampler).
std::vector<torch::Tensor> micro_batches(const DistributedSampler& sampler, int64_t b) {
  auto indices = sampler.indices();
  auto all = torch::tensor(indices, torch::kLong);
  std::vector<torch::Tensor> out;
  for (int64_t start = 0; start < all.numel(); start += b) {
    out.push_back(all.narrow(0, start, std::min(b, all.numel() - start)));
  }
  return out;
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

int64_t total_steps(const TrainConfig& c, int64_t micro_per_epoch) {
  const int64_t steps_per_epoch = (micro_per_epoch + c.accumulate - 1) / c.accumulate;
  if (c.steps) return *c.steps;
  return c.epochs.value_or(1) * steps_per_epoch;
}

// Mean over ranks of the step loss and total samples, in float64 (one 16-byte allreduce per step).
void reduce_record(const std::shared_ptr<World>& world, StepRecord& record) {
  if (!world || world->size() == 1) return;
  auto t = torch::tensor({record.loss, static_cast<double>(record.samples)}, torch::kDouble);
  world->comm().allreduce(t, Reduction::Sum);
  record.loss = t[0].item<double>() / world->size();
  record.samples = static_cast<int64_t>(std::llround(t[1].item<double>()));
}

}  // namespace

void validate(const TrainConfig& c, int world_size) {
  parse_model_spec(c.model);
  parse_loss_kind(c.loss);
  parse_reduction(c.reduction);
  if (c.strategy != "local" && c.strategy != "ddp") {
    throw ConfigError(fmt::format("--strategy {} is not known; expected local or ddp", c.strategy));
  }
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
  const int64_t ranks_times_k = world_size * c.accumulate;
  if (c.global_batch % ranks_times_k != 0) {
    throw ConfigError(fmt::format(
        "--global-batch {} is not divisible by world size {} x accumulate {} = {}: each rank's micro-batch is "
        "B/(N*K) samples; choose B as a multiple of {}",
        c.global_batch, world_size, c.accumulate, ranks_times_k, ranks_times_k));
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

  std::unique_ptr<Ddp> ddp;
  if (world) {
    DdpOptions options;
    options.reduction = parse_reduction(c.reduction);
    ddp = std::make_unique<Ddp>(model, world, options);
  }
  model->train();
  auto optimizer = make_optimizer(c, model);
  const int64_t b = c.global_batch / (n * c.accumulate);
  DistributedSampler sampler(data.size(), n, rank, c.shuffle, c.seed, /*drop_last=*/false);
  const int64_t micro_per_epoch = (sampler.num_samples() + b - 1) / b;
  const int64_t steps = total_steps(c, micro_per_epoch);

  StepLog log(c.log, rank == 0);
  Progress progress(rank == 0 && !c.quiet && (isatty(STDERR_FILENO) || process_env("GRADSYNC_PROGRESS")), steps);
  std::vector<StepRecord> records;
  for (int64_t step = 0, epoch = 0; step < steps; ++epoch) {
    sampler.set_epoch(epoch);
    auto batches = micro_batches(sampler, b);
    for (size_t done = 0; done < batches.size() && step < steps; ++step) {
      const auto start = Clock::now();
      const auto group = static_cast<int64_t>(std::min<size_t>(static_cast<size_t>(c.accumulate), batches.size() - done));
      StepRecord record{step, epoch, 0, 0, 0};
      auto micro_loss = [&](int64_t k) {
        const auto& idx = batches[done + static_cast<size_t>(k)];
        record.samples += idx.numel();
        auto output = ddp ? ddp->forward(data.inputs.index_select(0, idx)) : model->forward(data.inputs.index_select(0, idx));
        return compute_loss(c, output, data.targets.index_select(0, idx));
      };
      // accumulate() divides each micro-batch loss by the group size: .grad sums (see accumulate.h).
      try {
        record.loss = ddp ? accumulate(*ddp, group, micro_loss) : accumulate(group, micro_loss);
      } catch (const c10::Error& e) {
        // e.g. BatchNorm1d given a 1-sample micro-batch: say where, and what to change.
        throw ConfigError(fmt::format("rank {}: step {} (epoch {}), micro-batch size {}: {} (change --global-batch, "
                                      "--accumulate or --world-size so that no micro-batch is degenerate)",
                                      rank, step, epoch, b, e.what_without_backtrace()));
      }
      optimizer->step();
      if (ddp) {
        ddp->zero_grad();
      } else {
        model->zero_grad(/*set_to_none=*/false);
      }
      done += static_cast<size_t>(group);
      reduce_record(world, record);
      record.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      log.write(record);
      progress.update(record);
      records.push_back(record);
    }
    if (batches.empty()) break;
  }
  if (rank == 0 && !c.save_state.empty()) save_state_dict(state_dict(*model), c.save_state);
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
  cmd->add_option("--strategy", c.strategy, "local (one process, no communication) or ddp");
  cmd->add_option("--optimizer", c.optimizer, "sgd or adam");
  cmd->add_option("--lr", c.lr, "learning rate (default 0.01 for sgd, 1e-3 for adam)");
  cmd->add_option("--momentum", c.momentum, "sgd momentum (default 0)");
  cmd->add_option("--weight-decay", c.weight_decay, "L2 weight decay (default 0)");
  cmd->add_option("--loss", c.loss, "ce (cross-entropy) or mse");
  cmd->add_option("--loss-reduction", c.loss_reduction, "mean or sum over one micro-batch's samples");
  cmd->add_option("--reduction", c.reduction, "mean (PyTorch DDP) or sum of the ranks' gradients");
  auto* steps = cmd->add_option("--steps", c.steps, "optimizer steps in total (crossing epochs)");
  auto* epochs = cmd->add_option("--epochs", c.epochs, "whole epochs (default 1)");
  steps->excludes(epochs);
  cmd->add_option("--seed", c.seed, "seed of the model, the sampler and synthetic data (default 0)");
  cmd->add_flag("--shuffle,!--no-shuffle", c.shuffle, "shuffle every epoch (default) or not");
  cmd->add_option("--init-state", c.init_state, "initial state dict, from torch.save(dict(model.state_dict()), FILE)");
  cmd->add_option("--save-state", c.save_state, "write the final state dict (Python torch.load reads it)");
  cmd->add_option("--log", c.log, "JSON lines: step, epoch, loss, samples, seconds");
  cmd->add_option("--timeout", c.timeout_seconds, "seconds before a stalled collective fails (default 1800)");
  cmd->add_flag("--quiet", c.quiet, "no summary line");
  cmd->callback([config, &exit_code] { exit_code = run_train(*config, own_arguments()); });
}

}  // namespace gradsync::cli
