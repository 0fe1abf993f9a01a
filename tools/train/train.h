// defines: the `gradsync train` job: its configuration (the CLI contract), the per-rank training loop, and the
// orchestration that starts local ranks itself when no launcher did.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/runtime.h"
#include "train/strategy.h"

namespace CLI {
class App;
}

namespace gradsync::cli {

struct TrainConfig {
  std::string model;
  std::string data;
  int64_t global_batch = 0;       // samples per optimizer step over all ranks and micro-steps
  int64_t accumulate = 1;         // micro-batches per optimizer step (K)
  int world_size = 0;             // 0: not given (1, or the launcher's WORLD_SIZE)
  std::string comm_hook = "none";  // ddp: none | allreduce | fp16 | bf16 (gradsync/comm_hook.h)
  bool no_prefetch = false;       // fsdp-full: one unit gathered at a time (FsdpOptions::prefetch = false)
  std::string backend;            // --backend gloo|mpi; "": the launcher's (GRADSYNC_BACKEND, mpi under mpirun)
  Strategy strategy = Strategy::Ddp;
  std::string optimizer = "sgd";  // sgd | adam
  std::optional<double> lr;       // default: 0.01 for sgd (torch.optim requires one), 1e-3 for adam
  std::optional<double> momentum;
  double weight_decay = 0;
  bool no_decay_1d = false;        // parameters of one dimension (biases, norm weights): a group without decay
  std::vector<std::string> freeze;  // state-dict name prefixes whose parameters are frozen (requires_grad false)
  std::string loss = "ce";              // ce | mse
  std::string loss_reduction = "mean";  // mean | sum: how one micro-batch's loss combines its samples
  std::string reduction = "mean";       // mean | sum | global-mean: how ranks' gradients combine (PyTorch: mean)
  std::optional<int64_t> steps;
  std::optional<int64_t> epochs;
  uint64_t seed = 0;
  bool shuffle = true;
  bool no_pad = false;            // every sample once per epoch; ranks may hold uneven counts
  int replay_ranks = 0;           // local only: train on exactly the global batches of this many ranks
  int64_t verify_every = 0;       // every S steps, recompute the gradient in one process and compare
  std::string inject_fault;       // tests only: "grad@STEP" or "diverge@STEP"
  std::string init_state;
  std::string save_state;
  std::string save_optim;         // the optimizer's state, whole, keyed by parameter names (rank 0 writes)
  std::string log;
  // Checkpoints (train/checkpointing.h): DIR, every S steps (0: at every epoch's end), the newest K kept (0: all).
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int keep_checkpoints = 0;
  bool resume = false;            // continue from the newest complete checkpoint in checkpoint_dir, if any
  int max_restarts = 0;           // restart the whole group after a failure, resuming (train/checkpointing.h)
  double timeout_seconds = 1800;  // process-group timeout (PyTorch's default: 30 min)
  bool quiet = false;
  bool eval = false;              // --eval: test-split accuracy after every epoch (train/evaluate.h)
  std::string eval_data;          // --eval-data SPEC: the split to evaluate on (implies --eval)
  // Sharded strategies (see engine_factory.h, docs/sharding.md).
  std::string wrap;                       // fsdp-*, zero1: children | params:N | list:A,B | type:T,U (fsdp default params:6553600)
  std::string param_dtype;                // fsdp-*: compute dtype, default the model's (fp32)
  std::string reduce_dtype;               // fsdp-*: gradient reduction dtype, default the param dtype
  std::string accumulate_grads = "full";  // fsdp-*: full (no_sync) | sharded (reduce-scatter every micro-step)
  bool report_memory = false;             // memory and bytes sent in log and summary (always on when sharded)
};

struct StepRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  double loss = 0;      // mean over the global batch (sum over the step's micro-batches of loss/K', mean over ranks)
  int64_t samples = 0;  // samples consumed in the step over all ranks (padding duplicates included)
  double seconds = 0;
  int64_t memory_peak = -1;  // bytes of parameters + gradients + optimizer state at this rank's peak so far
  int64_t sent_bytes = -1;   // bytes this rank sent in the step (see bytes_sent in train.cpp); -1: not reported
  int64_t rss_peak = -1;     // this process's peak resident memory so far (VmHWM); -1: not reported
  double test_accuracy = -1; // --eval: percent correct on the test split after this step's epoch; -1: none
};

// Throws ConfigError naming the flag, its value and what is allowed. `world_size` is the job's actual size.
void validate(const TrainConfig& config, int world_size);

// One rank's training loop, written once against the engine interface (world is null for --strategy local).
// Returns the step records (every rank has the same losses). Rank 0 writes --log and --save-state.
std::vector<StepRecord> train_rank(const TrainConfig& config, const std::shared_ptr<World>& world);

// The whole command: validates, then trains locally, as one rank under a launcher, or starts --world-size
// local ranks itself (re-running this program with `argv` under the launcher). Returns the exit status.
int run_train(const TrainConfig& config, const std::vector<std::string>& argv);

// `gradsync train`: adds the subcommand to `root`; its callback stores the exit status in `exit_code`.
void add_train_command(CLI::App& root, int& exit_code);

}  // namespace gradsync::cli
