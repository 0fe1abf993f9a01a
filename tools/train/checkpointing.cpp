// `gradsync train --checkpoint-dir` (see checkpointing.h).
#include "train/checkpointing.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"

namespace gradsync::cli {
namespace {

std::string flag_value(const std::optional<double>& v, double fallback) { return fmt::format("{}", v.value_or(fallback)); }

int64_t meta_int(const CheckpointInfo& info, const std::string& key) {
  const auto it = info.meta.find(key);
  if (it == info.meta.end()) {
    throw ConfigError(fmt::format("--resume: checkpoint {} has no '{}': it was not saved by gradsync train", info.path,
                                  key));
  }
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    throw ConfigError(fmt::format("--resume: checkpoint {}: '{}' is '{}', not an integer", info.path, key, it->second));
  }
}

void check_fingerprint(const CheckpointInfo& info, const TrainConfig& config) {
  std::vector<std::string> differ;
  for (const auto& [flag, here] : configuration_fingerprint(config)) {
    const auto it = info.meta.find("flag " + flag);
    // --sync-bn came after the first checkpoints: one that does not record it was trained without.
    const std::string missing = flag == "--sync-bn" ? "false" : "(not recorded)";
    const std::string there = it == info.meta.end() ? missing : it->second;
    if (there != here) differ.push_back(fmt::format("{} was '{}', is '{}'", flag, there, here));
  }
  if (!differ.empty()) {
    throw ConfigError(fmt::format("--resume: checkpoint {} belongs to another configuration: {}; resume with the "
                                  "flags it was saved with, or start a new --checkpoint-dir",
                                  info.path, fmt::join(differ, "; ")));
  }
}

}  // namespace

// --checkpoint-dir is an existing writable directory or one that can be made; the other flags need it.
void validate_checkpoint_flags(const TrainConfig& c) {
  if (c.checkpoint_dir.empty()) {
    const char* needs = c.resume ? "--resume" : c.max_restarts > 0 ? "--max-restarts" : c.checkpoint_every > 0 ?
        "--checkpoint-every" : c.keep_checkpoints > 0 ? "--keep" : nullptr;
    if (needs) throw ConfigError(fmt::format("{} needs --checkpoint-dir DIR (where checkpoints are)", needs));
    return;
  }
  // Rank 0 makes the missing part (mkdir -p): the nearest existing ancestor must be a writable directory.
  std::string existing = c.checkpoint_dir;
  struct stat st {};
  while (::stat(existing.c_str(), &st) != 0) {
    while (existing.size() > 1 && existing.back() == '/') existing.pop_back();
    const auto slash = existing.rfind('/');
    existing = slash == std::string::npos ? "." : slash == 0 ? "/" : existing.substr(0, slash);
  }
  if (!S_ISDIR(st.st_mode)) {
    throw ConfigError(fmt::format("--checkpoint-dir {}: '{}' exists and is not a directory", c.checkpoint_dir,
                                  existing));
  }
  if (access(existing.c_str(), W_OK | X_OK) != 0) {
    throw ConfigError(fmt::format("--checkpoint-dir {}: '{}' is not writable: {}", c.checkpoint_dir, existing,
                                  std::strerror(errno)));
  }
}

std::map<std::string, std::string> configuration_fingerprint(const TrainConfig& c) {
  const bool adam = c.optimizer == "adam";
  return {{"--model", c.model},
          {"--data", c.data},
          {"--global-batch", std::to_string(c.global_batch)},
          {"--optimizer", c.optimizer},
          {"--lr", flag_value(c.lr, adam ? 1e-3 : 0.01)},
          {"--momentum", flag_value(c.momentum, 0)},
          {"--weight-decay", fmt::format("{}", c.weight_decay)},
          {"--no-decay-1d", c.no_decay_1d ? "true" : "false"},
          {"--freeze", fmt::format("{}", fmt::join(c.freeze, ","))},
          {"--loss", c.loss},
          {"--loss-reduction", c.loss_reduction},
          {"--reduction", c.reduction},
          {"--seed", std::to_string(c.seed)},
          {"--shuffle", c.shuffle ? "true" : "false"},
          {"--no-pad", c.no_pad ? "true" : "false"},
          {"--sync-bn", c.sync_bn ? "true" : "false"}};
}

int64_t accumulate_after_resize(int64_t accumulate, int ranks, int new_ranks, int64_t global_batch) {
  if (global_batch % new_ranks != 0) return 0;
  const int64_t per_rank = global_batch / new_ranks, at_least = (accumulate * ranks + new_ranks - 1) / new_ranks;
  for (int64_t k = std::max<int64_t>(at_least, 1); k <= per_rank; ++k) {
    if (per_rank % k == 0) return k;
  }
  return per_rank;  // a micro-batch of one sample
}

TrainCheckpoints::TrainCheckpoints(const TrainConfig& config, Collectives* comm)
    : config_(config), accumulate_(config.accumulate), ranks_(comm ? comm->size() : 1),
      origin_accumulate_(accumulate_), origin_ranks_(ranks_),
      world_size_(comm ? comm->size() : 1),
      rank_(comm ? comm->rank() : 0) {
  if (config.checkpoint_dir.empty()) return;
  checkpoints_.emplace(config.checkpoint_dir, comm, config.keep_checkpoints);
  // A fresh run in a directory of an earlier one would mix two histories (and --resume would pick the other's).
  std::string problem;
  if (const auto earlier = checkpoints_->list(); !config.resume && !earlier.empty()) {
    problem = fmt::format("--checkpoint-dir {} already holds checkpoints of an earlier run (up to step {}); add "
                          "--resume to continue it, or give an empty directory", config.checkpoint_dir,
                          earlier.back().step);
  }
  const auto problems = comm ? comm->allgather_strings(problem) : std::vector<std::string>{problem};
  for (const auto& p : problems) {
    if (!p.empty()) throw ConfigError(p);
  }
}

const std::optional<CheckpointInfo>& TrainCheckpoints::latest() {
  if (!latest_) latest_ = checkpoints_ && config_.resume ? checkpoints_->latest() : std::nullopt;
  return *latest_;
}

int64_t TrainCheckpoints::accumulate_for(int world_size) {
  ranks_ = world_size;
  const auto& last = latest();
  // Saved before K was recorded, or not by a run of this command line: --accumulate as given, a new start.
  if (!last || !last->meta.count("accumulate") || meta_int(*last, "flag --accumulate") != config_.accumulate) {
    origin_accumulate_ = config_.accumulate;
    origin_ranks_ = world_size;
    return accumulate_ = config_.accumulate;
  }
  // The schedule's ranks: the world's, or those a local run replays (--replay-ranks).
  const auto ranks = last->meta.count("ranks") ? meta_int(*last, "ranks") : last->world_size;
  const bool has_origin = last->meta.count("origin accumulate") && last->meta.count("origin ranks");
  origin_accumulate_ = has_origin ? meta_int(*last, "origin accumulate") : meta_int(*last, "accumulate");
  origin_ranks_ = has_origin ? meta_int(*last, "origin ranks") : ranks;
  const int64_t resized = accumulate_after_resize(origin_accumulate_, static_cast<int>(origin_ranks_), world_size,
                                                  config_.global_batch);
  return accumulate_ = resized > 0 ? resized : config_.accumulate;  // 0: validate() names the batch that cannot split
}

Position TrainCheckpoints::resume(Engine& engine, torch::optim::Optimizer& optimizer) {
  if (!checkpoints_ || !config_.resume) return {};
  const auto& found = latest();
  if (!found) {
    if (rank_ == 0 && !config_.quiet) {
      fmt::print("gradsync train: --resume: no checkpoint in {} yet; starting at step 0\n", checkpoints_->dir());
    }
    return {};
  }
  check_fingerprint(*found, config_);
  const Position at{meta_int(*found, "step"), meta_int(*found, "epoch"), meta_int(*found, "step_in_epoch")};
  checkpoints_->load(*found, engine, optimizer);
  if (rank_ == 0 && !config_.quiet) say_resuming(*found, at);
  return at;
}

// One line. At another world size, or after an elastic launcher re-formed the job, it says what changed: the
// nodes, the world, the step resumed from and K; the global batch, and so what each step's mean is over, stays.
void TrainCheckpoints::say_resuming(const CheckpointInfo& latest, const Position& at) const {
  const char* change = std::getenv("GRADSYNC_ELASTIC_CHANGE");
  const bool elastic = change != nullptr && *change != '\0';
  if (!elastic && latest.world_size == world_size_) {
    fmt::print("gradsync train: resuming from {} (step {}, epoch {}, step {} of the epoch; saved by {} rank(s) "
               "under {})\n", latest.path, at.step, at.epoch, at.step_in_epoch, latest.world_size, latest.engine);
    return;
  }
  const auto k = latest.meta.find("accumulate");
  fmt::print("gradsync train: {}{} ranks (were {}) resume from step {} (epoch {}, step {} of the epoch; {}) with "
             "--accumulate {} (was {}): every step is still the mean over the global batch of {}\n",
             elastic ? fmt::format("elastic restart ({}): ", change) : "", world_size_, latest.world_size, at.step,
             at.epoch, at.step_in_epoch, latest.path, accumulate_, k != latest.meta.end() ? k->second : "not recorded",
             config_.global_batch);
}

void TrainCheckpoints::after_step(const Position& next, int64_t total_steps, Engine& engine,
                                  const torch::optim::Optimizer& optimizer) {
  if (!checkpoints_) return;
  const int64_t every = config_.checkpoint_every;
  const bool due = next.step == total_steps || (every > 0 ? next.step % every == 0 : next.step_in_epoch == 0);
  if (!due) return;
  auto meta = std::map<std::string, std::string>{{"step", std::to_string(next.step)},
                                                 {"epoch", std::to_string(next.epoch)},
                                                 {"step_in_epoch", std::to_string(next.step_in_epoch)},
                                                 {"accumulate", std::to_string(accumulate_)},
                                                 {"ranks", std::to_string(ranks_)},
                                                 {"origin accumulate", std::to_string(origin_accumulate_)},
                                                 {"origin ranks", std::to_string(origin_ranks_)},
                                                 {"flag --accumulate", std::to_string(config_.accumulate)}};
  for (const auto& [flag, value] : configuration_fingerprint(config_)) meta["flag " + flag] = value;
  TraceSpan span(engine.tracer(), "checkpoint", TraceEvent::Kind::Phase, "step " + std::to_string(next.step));
  checkpoints_->save(next.step, engine, optimizer, meta);
}

}  // namespace gradsync::cli
