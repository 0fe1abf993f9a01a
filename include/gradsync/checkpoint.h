// defines: Checkpoints, a directory of checkpoints a training loop resumes from exactly where it stopped:
//
//   gradsync::Checkpoints checkpoints("ckpt", engine.comm(), /*keep=*/3);
//   int64_t step = 0;
//   if (auto latest = checkpoints.latest()) {         // the same one on every rank, or an error naming them
//     checkpoints.load(*latest, engine, optimizer);   // model, optimizer state, every rank's RNG state
//     step = latest->step;
//   }
//   for (; step < steps; ++step) {
//     ...train one step...
//     if ((step + 1) % 100 == 0) checkpoints.save(step + 1, engine, optimizer, {{"epoch", "3"}});
//   }
//
// One checkpoint is DIR/step-<12 digits>/ holding model.pt (the whole model's state dict: Python's
// torch.load(f, weights_only=True) reads it), optim.pt (the whole optimizer state keyed by parameter names, the
// layout of Engine::full_optim_state_dict), rng.pt (every rank's CPU generator state, "rank<r>"), layout.pt
// (Engine::layout_state: DDP's bucket order, restored when the same engine resumes) and, written
// last, manifest.json (step, world size, engine, each file's size and CRC-32, the caller's metadata). Every file
// is written through a temp file created exclusively in that directory, fsynced, renamed, and the directory
// fsynced; a checkpoint exists only once its manifest does, so a crash at any point leaves the previous
// checkpoints loadable and the torn one without a manifest (removed at the next start).
//
// Being whole (not one file per rank), a checkpoint loads under any engine and any world size: saved at 4 ranks
// under FSDP, resumed at 2 or 3, or under DDP. Rank 0 gathers and writes it; DIR must be reachable from every rank
// (every rank reads the one it resumes from).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"
#include "gradsync/engine.h"

namespace gradsync {

struct CheckpointInfo {
  int64_t step = 0;   // what the caller passed to save(): optimizer steps taken
  std::string path;   // DIR/step-000000000042
  int world_size = 0; // of the job that saved it
  std::string engine; // Engine::name() of the job that saved it
  std::map<std::string, std::string> meta;  // the caller's metadata (training position, configuration)
};

class Checkpoints {
 public:
  // `comm`: the job's ranks (Engine::comm(); null for one process). keep: complete checkpoints kept after each
  // save, the newest ones (0: all). Rank 0 creates DIR and removes what a killed writer left in it: temp files
  // and checkpoint directories without a manifest. Throws ConfigError when DIR cannot be made or written.
  Checkpoints(std::string dir, Collectives* comm, int keep = 0);

  // Collective: every rank calls it with the same step. Gathers the model and optimizer state to rank 0, which
  // writes the checkpoint (manifest last), then removes checkpoints beyond `keep`. Throws Error naming the file
  // and errno on every rank when rank 0 cannot write (the previous checkpoints stay as they were).
  CheckpointInfo save(int64_t step, Engine& engine, const torch::optim::Optimizer& optimizer,
                      const std::map<std::string, std::string>& meta = {});

  // Collective. The newest complete checkpoint: its manifest parses and every file it lists has its size and
  // CRC-32. A checkpoint that fails the check is skipped with a warning on stderr naming the file and both
  // checksums, and the one before it is used. Every rank must find the same one; otherwise every rank throws
  // ConfigError naming the ranks and the checkpoints they found. nullopt when DIR holds none.
  std::optional<CheckpointInfo> latest();

  // Loads the model (Engine::load_state_dict: strict; rank 0 reads it), the optimizer state
  // (Engine::load_full_optim_state_dict), the engine's layout state (the same engine only) and this rank's
  // generator state (rank r < the saving world size; other ranks keep theirs). A file that changed since latest() checked it is a ConfigError naming it.
  void load(const CheckpointInfo& checkpoint, Engine& engine, torch::optim::Optimizer& optimizer);

  // The complete checkpoints in DIR (manifest present and parseable; files not read), oldest first.
  std::vector<CheckpointInfo> list() const;

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  Collectives* comm_;
  int keep_;
};

}  // namespace gradsync
