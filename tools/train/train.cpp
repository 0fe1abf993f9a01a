// `gradsync train` (see train.h). The loop mirrors a Python DataLoader over DistributedSampler exactly, so the
// same flags give the same parameters as the PyTorch reference (tests/reference/torch_train.py).
#include "train/train.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "data/data.h"
#include "data/models.h"
#include "gradsync/engine.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/state_dict.h"
#include "gradsync/stats.h"
#include "gradsync/sync_batch_norm.h"
#include "launch/backend_flag.h"
#include "launch/launch.h"
#include "launch/spawn.h"
#include "train/engine_factory.h"
#include "train/evaluate.h"
#include "train/flag.h"
#include "train/model_data.h"
#include "train/resource_report.h"
#include "train/schedule.h"
#include "train/progress.h"
#include "train/step_log.h"
#include "train/checkpointing.h"
#include "train/optimizer.h"
#include "train/trace_session.h"
#include "train/train_step.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

bool under_launcher() {
  return process_env("RANK") || process_env("WORLD_SIZE") || process_env("OMPI_COMM_WORLD_RANK");
}

constexpr double kMaxTimeoutSeconds = 86400.0 * 365;

// A number flag must be finite (inf and nan train to nan or break deadlines) and above its bound.
void check_finite_at_least(const char* flag, double value, double bound, bool strict) {
  if (!std::isfinite(value) || value < bound || (strict && value == bound)) {
    throw ConfigError(fmt::format("{} {} is invalid; expected a finite number {} {}", flag, value,
                                  strict ? ">" : ">=", bound));
  }
}

// An output file's directory must exist and be writable before training starts, not after it.
void check_output_directory(const char* flag, const std::string& path) {
  if (path.empty()) return;
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    throw ConfigError(fmt::format("{} {}: its directory '{}' is not writable: {}", flag, path, dir,
                                  std::strerror(errno)));
  }
}

int64_t total_steps(const TrainConfig& c, int64_t steps_per_epoch) {
  if (c.steps) return *c.steps;
  return c.epochs.value_or(1) * steps_per_epoch;
}

}  // namespace

void validate(const TrainConfig& c, int world_size, bool check_batch) {
  parse_flag("--model", c.model, parse_model_spec);
  parse_flag("--loss", c.loss, parse_loss_kind);
  parse_flag("--reduction", c.reduction, parse_reduction);
  check_model_data(c);
  validate_sharding_flags(c, world_size);
  if (c.strategy == Strategy::Local && world_size > 1) {
    throw ConfigError(fmt::format("--strategy local runs one process, but the world size is {}; use --strategy "
                                  "ddp or drop --world-size", world_size));
  }
  if (c.optimizer != "sgd" && c.optimizer != "adam") {
    throw ConfigError(fmt::format("--optimizer {} is not known; expected sgd or adam", c.optimizer));
  }
  if (c.optimizer == "adam" && c.momentum) {
    throw ConfigError("--momentum applies to sgd only; adam's moments are betas (0.9, 0.999)");
  }
  if (c.lr) check_finite_at_least("--lr", *c.lr, 0, /*strict=*/true);
  if (c.momentum) check_finite_at_least("--momentum", *c.momentum, 0, false);
  check_finite_at_least("--weight-decay", c.weight_decay, 0, false);
  if (c.loss_reduction != "mean" && c.loss_reduction != "sum") {
    throw ConfigError(fmt::format("--loss-reduction {} is not known; expected mean or sum", c.loss_reduction));
  }
  if (c.global_batch < 1) throw ConfigError(fmt::format("--global-batch {} is invalid; expected >= 1", c.global_batch));
  if (c.accumulate < 1) throw ConfigError(fmt::format("--accumulate {} is invalid; expected >= 1", c.accumulate));
  if (c.steps && *c.steps < 0) throw ConfigError(fmt::format("--steps {} is invalid; expected >= 0", *c.steps));
  if (c.epochs && *c.epochs < 0) throw ConfigError(fmt::format("--epochs {} is invalid; expected >= 0", *c.epochs));
  const int64_t ranks_times_k = std::max(world_size, c.replay_ranks) * c.accumulate;
  if (check_batch && c.global_batch % ranks_times_k != 0) {
    throw ConfigError(fmt::format(
        "--global-batch {} is not divisible by world size {} x accumulate {} = {}: each rank's micro-batch is "
        "B/(N*K) samples; choose B as a multiple of {}",
        c.global_batch, std::max(world_size, c.replay_ranks), c.accumulate, ranks_times_k, ranks_times_k));
  }
  if (c.reduction == "global-mean" && c.loss_reduction != "mean") {
    throw ConfigError("--reduction global-mean divides the summed per-sample losses by the step's sample count "
                      "itself; use it with --loss-reduction mean");
  }
  if (c.replay_ranks != 0 && (c.strategy != Strategy::Local || c.replay_ranks < 1)) {
    throw ConfigError(fmt::format("--replay-ranks {} is invalid; expected an integer >= 1 with --strategy local",
                                  c.replay_ranks));
  }
  check_sync_bn(c);
  if (c.verify_every < 0 || (c.verify_every > 0 && c.strategy == Strategy::Local)) {
    throw ConfigError(fmt::format("--verify-every {} is invalid; expected >= 0, with a data-parallel strategy",
                                  c.verify_every));
  }
  check_finite_at_least("--timeout", c.timeout_seconds, 0, true);
  if (c.timeout_seconds > kMaxTimeoutSeconds) {
    throw ConfigError(fmt::format("--timeout {} is invalid; expected at most {} seconds (a year)", c.timeout_seconds,
                                  kMaxTimeoutSeconds));
  }
  check_output_directory("--save-state", c.save_state);
  check_output_directory("--save-optim", c.save_optim);
  check_output_directory("--log", c.log);
  if (!c.trace_dir.empty() && c.strategy == Strategy::Local) {
    throw ConfigError("--trace records a data-parallel job's timeline; --strategy local has no ranks to trace");
  }
  validate_checkpoint_flags(c);
  eval_data_spec(c);  // --eval has a split to use
}

namespace {

// What one rank trains with: the model, its data, the engine over it, the optimizer over the engine's parameters.
struct Run {
  Model model;
  Dataset data;
  Dataset test;  // --eval's split; empty without --eval
  std::unique_ptr<Engine> engine;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t model_bytes = 0;  // Psi in bytes, measured before an engine re-types parameters (--param-dtype)
};

Run set_up(const TrainConfig& c, const std::shared_ptr<World>& world) {
  torch::manual_seed(c.seed);
  Run run{make_model(c.model), {}, {}, nullptr, nullptr, 0};
  if (!c.init_state.empty()) load_into(*run.model, load_state_dict(c.init_state));
  to_dtype(*run.model, parse_dtype(c.dtype));  // after --init-state: a float32 file starts a float64 run
  run.data = load_data(c, c.data, c.seed);
  if (const auto split = eval_data_spec(c); !split.empty()) run.test = load_data(c, split, c.seed + 1);
  run.model_bytes = parameter_bytes(*run.model);
  freeze_parameters(c, run.model);
  if (c.sync_bn) convert_sync_batchnorm(*run.model, world);  // before the engine, which may re-type parameters
  run.engine = make_engine(c, run.model, world);
  run.model->train();
  run.optimizer = make_optimizer(c, *run.engine, run.model);
  run.engine->track_optimizer(run.optimizer.get());
  return run;
}

// Memory and bytes sent in the log and the summary: always for the sharded strategies, on request otherwise.
bool reports_resources(const TrainConfig& c) { return is_sharded(c.strategy) || c.report_memory; }

// A torch error in a step, said with where; a micro-batch too small (BatchNorm given 1 sample) says what to change.
[[noreturn]] void step_failed(const c10::Error& e, int rank, const StepRecord& r, int64_t micro_batch) {
  const std::string what = e.what_without_backtrace();
  const char* hint = " (change --global-batch, --accumulate or --world-size so that no micro-batch is degenerate)";
  throw ConfigError(fmt::format("rank {}: step {} (epoch {}), micro-batch size {}: {}{}", rank, r.step, r.epoch,
                                micro_batch, what, what.find("more than 1 value per channel") == what.npos ? "" : hint));
}

// --eval at the end of an epoch: on stdout (rank 0) and in the epoch's last log line.
void report_accuracy(const TrainConfig& c, Run& run, int64_t epoch, StepRecord& last, StepLog& log, Progress& progress,
                     const std::shared_ptr<World>& world) {
  const auto accuracy = evaluate(c, *run.engine, run.test, world);
  progress.finish();  // the evaluation's line starts on a line of its own
  last.test_accuracy = accuracy.percent();
  if (run.test.tokens()) last.test_loss = accuracy.nats_per_token();
  if ((!world || world->is_main()) && !c.quiet) {
    if (run.test.tokens()) {
      fmt::print("gradsync train: epoch {}: eval: loss {:.4f} nats per token, {:.4f} bits per byte ({} tokens, "
                 "next byte {:.2f}% correct)\n", epoch, accuracy.nats_per_token(), accuracy.bits_per_byte(),
                 accuracy.total, accuracy.percent());
    } else {
      fmt::print("gradsync train: epoch {}: test accuracy {:.2f}% ({}/{})\n", epoch, accuracy.percent(),
                 accuracy.correct, accuracy.total);
    }
  }
  log.write_accuracy(epoch, last.step, accuracy.percent(), last.test_loss);
}

void finish(const TrainConfig& c, Run& run, const std::vector<StepRecord>& records,
            const std::shared_ptr<World>& world, TraceSession& trace) {
  trace.finish(*run.engine, c.quiet);  // first: the state dicts gathered below are not part of the run
  const int rank = world ? world->rank() : 0;
  const ResourceReport report{to_string(c.strategy), run.engine->memory(), mean_sent_bytes(records), run.model_bytes,
                              run.engine->traffic(), static_cast<int64_t>(records.size()), replicas_of(c, world)};
  if (!c.save_state.empty()) {
    auto full = run.engine->state_dict(/*rank0_only=*/true);  // a collective for sharded engines
    if (rank == 0) save_state_dict(full, c.save_state);
  }
  if (!c.save_optim.empty()) {
    auto optim = run.engine->full_optim_state_dict(*run.optimizer, /*rank0_only=*/true);  // collective when sharded
    if (rank == 0) save_torch_file(optim, c.save_optim);
  }
  print_sample(c, *run.engine, world);  // a collective for sharded engines
  if (reports_resources(c) && !c.quiet) {
    if (is_sharded(c.strategy) && rank == 0) fmt::print("gradsync train: {}\n", describe_engine(c, *run.engine));
    print_resource_report(report, world);
  }
  if (world && world->size() > 1) world->comm().barrier();  // no rank exits while another still needs it
}

}  // namespace

namespace {

// One rank's loop state: what every step needs besides its position.
struct Loop {
  const TrainConfig& c;
  Run& run;
  const std::shared_ptr<World>& world;
  const BatchSchedule& schedule;
  StepContext ctx;
  StepFn step_fn;
  int64_t micro_batch;
  bool report;
  TraceSession& trace;
  // Gloo's bytes are the socket writes this process made; MPI's shared memory makes none, so there the count is
  // the engine's own (each collective's ring bytes, CommStats).
  int64_t bytes_sent() const {
    const bool counted = world && world->backend() == Backend::Mpi;
    return counted ? run.engine->traffic().total() : process_bytes_written();
  }
};

StepRecord run_step(const Loop& loop, int64_t step, int64_t epoch, int64_t s) {
  const int rank = loop.world ? loop.world->rank() : 0;
  StepRecord record{step, epoch, 0, 0, 0};
  const int64_t written_before = loop.report ? loop.bytes_sent() : 0;
  const auto start = Clock::now();
  loop.trace.begin_step(step);
  inject_crash(loop.ctx, step);
  record.world_size = loop.schedule.world_size();
  record.accumulate = loop.c.accumulate;
  if (loop.c.log_samples) record.sample_ids = step_sample_ids(loop.ctx, loop.schedule, s);
  RecordTotals totals;
  try {
    totals = loop.step_fn(loop.ctx, loop.schedule, s, record);
  } catch (const c10::Error& e) {
    step_failed(e, rank, record, loop.micro_batch);
  } catch (const ConfigError& e) {  // a micro-batch the loss refuses (no valid token under a token mean)
    throw ConfigError(fmt::format("rank {}: step {} (epoch {}): {}", rank, record.step, record.epoch, e.what()));
  }
  const bool verify = loop.c.verify_every > 0 && step % loop.c.verify_every == 0;
  if (verify) verify_gradient(loop.ctx, loop.schedule.step(rank, s), step);
  {
    TraceSpan span(loop.trace.tracer(), "optimizer");
    loop.run.optimizer->step();  // the loss allreduce is still in flight
    loop.run.engine->zero_grad();
  }
  totals.finish(record);
  loop.trace.end_step(record);
  if (verify && holds_replicas(loop.c.strategy)) verify_replicas(loop.ctx, step);
  record.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (loop.report) {
    record.sent_bytes = loop.bytes_sent() - written_before;
    record.memory_peak = loop.run.engine->memory().peak_total();
    record.rss_peak = process_peak_resident_bytes();
  }
  return record;
}

}  // namespace

std::vector<StepRecord> train_rank(const TrainConfig& given, const std::shared_ptr<World>& world) {
  const int rank = world ? world->rank() : 0;
  // The data schedule of `ranks` ranks: this job's, or the one a local run replays.
  const int ranks = world ? world->size() : std::max(given.replay_ranks, 1), processes = world ? world->size() : 1;
  validate(given, processes, /*check_batch=*/!given.resume);  // K may change with the world size (accumulate_for)
  TrainCheckpoints checkpoints(given, world ? &world->comm() : nullptr);
  TrainConfig c = given;
  c.accumulate = checkpoints.accumulate_for(ranks);
  validate(c, processes);
  TraceSession trace(c.trace_dir, world);  // before the engine: its groups report to the tracer
  auto run = set_up(c, world);
  const int64_t b = c.global_batch / (ranks * c.accumulate);
  BatchSchedule schedule(run.data.size(), ranks, b, c.accumulate, c.shuffle, c.seed, !c.no_pad);
  // Steps per epoch are ceil(n / B) at any world size (padding never adds a step), so a checkpoint's step within its
  // epoch exists in this run too.
  const Position start = checkpoints.resume(*run.engine, *run.optimizer);
  const int64_t steps = total_steps(c, schedule.steps_per_epoch());
  if (start.step > steps) {
    throw ConfigError(fmt::format("--resume: the checkpoint is at step {}, past the {} step(s) this run trains; "
                                  "give --steps or --epochs beyond it", start.step, steps));
  }
  const Loop loop{c, run, world, schedule, {c, run.data, run.model, run.engine.get(), world, parse_reduction(c.reduction)},
                  choose_step(c, rank), b, reports_resources(c), trace};
  StepLog log(c.log, rank == 0, start.step);
  Progress progress({!c.quiet, progress_on_terminal(), c.log_every, steps, run.data.tokens()}, world);
  std::vector<StepRecord> records;
  for (int64_t step = start.step, epoch = start.epoch; step < steps; ++epoch) {
    schedule.set_epoch(epoch);
    const int64_t first = epoch == start.epoch ? start.step_in_epoch : 0, per_epoch = schedule.steps_per_epoch();
    int64_t s = first;
    for (; s < per_epoch && step < steps; ++s, ++step) {
      records.push_back(run_step(loop, step, epoch, s));
      log.write(records.back());
      progress.update(records.back());
      const bool ends_loop = s + 1 == per_epoch || step + 1 == steps;  // saved after the epoch's evaluation
      if (!ends_loop) checkpoints.after_step({step + 1, epoch, s + 1}, steps, *run.engine, *run.optimizer);
    }
    if (per_epoch == 0) break;
    if (s == first) continue;
    if (run.test.size() > 0) report_accuracy(c, run, epoch, records.back(), log, progress, world);
    const Position next = s == per_epoch ? Position{step, epoch + 1, 0} : Position{step, epoch, s};
    checkpoints.after_step(next, steps, *run.engine, *run.optimizer);
  }
  progress.finish();
  finish(c, run, records, world, trace);
  return records;
}

namespace {

// --backend, when given, overrides the launcher's (GRADSYNC_BACKEND, or mpi under mpirun).
InitOptions init_options(const TrainConfig& c, std::optional<LaunchEnv> env) {
  InitOptions options;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_seconds * 1000));
  options.env = std::move(env);
  if (!c.backend.empty()) options.backend = backend_of(c.backend);
  return options;
}

void print_summary(const TrainConfig& c, const std::vector<StepRecord>& records, int world_size) {
  if (c.quiet) return;
  if (records.empty()) {
    fmt::print("gradsync train: 0 steps\n");
    return;
  }
  const auto& last = records.back();
  fmt::print("gradsync train: {} steps, {} epoch(s), world size {}, {} reduction; final loss {:.6f}{}{}\n",
             last.step + 1, last.epoch + 1, world_size, c.strategy == Strategy::Local ? "no" : c.reduction, last.loss,
             last.test_loss >= 0 ? fmt::format("; eval loss {:.4f} nats per token, {:.4f} bits per byte",
                                               last.test_loss, last.test_loss / std::log(2.0))
             : last.test_accuracy >= 0 ? fmt::format("; test accuracy {:.2f}%", last.test_accuracy) : "",
             c.save_state.empty() ? "" : fmt::format("; state saved to {}", c.save_state));
}

// The launcher's options for `n` ranks that re-run this command under it.
LaunchOptions rank_launch_options(const TrainConfig& c, const std::vector<std::string>& argv, int n) {
  LaunchOptions launch_options;
  launch_options.nproc = n;
  launch_options.backend = backend_of(c.backend);
  launch_options.prefix_output = false;  // only rank 0 prints; errors carry their rank in the message
  launch_options.command = {self_executable()};
  launch_options.command.insert(launch_options.command.end(), argv.begin(), argv.end());
  if (progress_on_terminal()) launch_options.extra_env.emplace_back("GRADSYNC_PROGRESS", "1");
  return launch_options;
}

// --max-restarts: the ranks (one for --strategy local) run under the launcher, which restarts the group after a
// failure; every attempt resumes from the newest checkpoint.
int supervise_restarts(const TrainConfig& c, std::vector<std::string> argv) {
  const int n = c.strategy == Strategy::Local ? 1 : std::max(c.world_size, 1);
  validate(c, n);
  if (!c.resume) argv.push_back("--resume");
  auto options = rank_launch_options(c, argv, n);
  options.max_restarts = c.max_restarts;
  return launch(options);
}

}  // namespace

namespace {

// One rank of a launched job. Its error is printed while its World still lives: destroying the World closes the
// connections, the other ranks then fail too (a rank writing to a closed socket dies of SIGPIPE), and the launcher
// may stop this rank before main() could print why the job failed.
int run_rank(const TrainConfig& c, std::shared_ptr<World> world) {
  try {
    auto records = train_rank(c, world);
    if (world->is_main()) print_summary(c, records, world->size());
    return 0;
  } catch (const std::exception& e) {
    print_error(e);
    // On MPI, exiting normally would run MPI_Finalize, which waits for every other rank, and they may be inside a
    // collective that waits for this one until the timeout. A rank that leaves without finalising is what makes
    // mpirun stop the whole job at once.
    if (world->backend() == Backend::Mpi) {
      std::fflush(nullptr);
      std::_Exit(1);
    }
    // An elastic launcher restarts a failed round; this failure would come back (a world the batch cannot split).
    const bool elastic = std::getenv("GRADSYNC_ELASTIC_ROUND") != nullptr;
    if (elastic && dynamic_cast<const ConfigError*>(&e) != nullptr) return kExitConfigError;
  }
  return 1;
}

}  // namespace

int run_train(const TrainConfig& c, const std::vector<std::string>& argv) {
  // (argv: this program's arguments, used to start the ranks)
  if (c.max_restarts > 0 && !under_launcher()) return supervise_restarts(c, argv);
  if (c.strategy == Strategy::Local) {
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
    validate(c, env.world_size, /*check_batch=*/!c.resume);  // train_rank() checks the batch with the resumed K
    return run_rank(c, init(init_options(c, env)));
  }
  const int n = std::max(c.world_size, 1);
  validate(c, n);  // fail here, once, before any rank starts
  if (n == 1) {
    auto world = init(init_options(c, std::nullopt));
    auto records = train_rank(c, world);
    print_summary(c, records, 1);
    return 0;
  }
  return launch(rank_launch_options(c, argv, n));
}

}  // namespace gradsync::cli
