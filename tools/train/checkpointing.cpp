// `gradsync train --checkpoint-dir` (see checkpointing.h).
#include "train/checkpointing.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

TrainCheckpoints::TrainCheckpoints(const TrainConfig& config, Collectives* comm)
    : config_(config), rank_(comm ? comm->rank() : 0) {
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

Position TrainCheckpoints::resume(Engine& engine, torch::optim::Optimizer& optimizer) {
  if (!checkpoints_ || !config_.resume) return {};
  const auto latest = checkpoints_->latest();
  const bool say = rank_ == 0 && !config_.quiet;
  if (!latest) {
    if (say) fmt::print("gradsync train: --resume: no checkpoint in {} yet; starting at step 0\n", checkpoints_->dir());
    return {};
  }
  check_fingerprint(*latest, config_);
  const Position at{meta_int(*latest, "step"), meta_int(*latest, "epoch"), meta_int(*latest, "step_in_epoch")};
  checkpoints_->load(*latest, engine, optimizer);
  if (say) {
    fmt::print("gradsync train: resuming from {} (step {}, epoch {}, step {} of the epoch; saved by {} rank(s) "
               "under {})\n", latest->path, at.step, at.epoch, at.step_in_epoch, latest->world_size, latest->engine);
  }
  return at;
}

void TrainCheckpoints::after_step(const Position& next, int64_t total_steps, Engine& engine,
                                  const torch::optim::Optimizer& optimizer) {
  if (!checkpoints_) return;
  const int64_t every = config_.checkpoint_every;
  const bool due = next.step == total_steps || (every > 0 ? next.step % every == 0 : next.step_in_epoch == 0);
  if (!due) return;
  auto meta = std::map<std::string, std::string>{{"step", std::to_string(next.step)},
                                                 {"epoch", std::to_string(next.epoch)},
                                                 {"step_in_epoch", std::to_string(next.step_in_epoch)}};
  for (const auto& [flag, value] : configuration_fingerprint(config_)) meta["flag " + flag] = value;
  TraceSpan span(engine.tracer(), "checkpoint", TraceEvent::Kind::Phase, "step " + std::to_string(next.step));
  checkpoints_->save(next.step, engine, optimizer, meta);
}

}  // namespace gradsync::cli
