// Checkpoints (see include/gradsync/checkpoint.h): what is saved, who writes and reads it, and how every rank
// agrees on the one to resume from. The files and the manifest are common/checkpoint_files.h.
#include "gradsync/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/atomic_file.h"
#include "common/checkpoint_files.h"
#include "common/consistency.h"
#include "common/torch_file.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"

namespace gradsync {
namespace {

int rank_of(const Collectives* comm) { return comm ? comm->rank() : 0; }
int size_of(const Collectives* comm) { return comm ? comm->size() : 1; }

// fn() on this rank; with other ranks, a failure on any of them becomes the same ConfigError on all (no rank
// waits in a later collective for one that failed).
template <typename Fn>
void together(Collectives* comm, const std::string& who, Fn&& fn) {
  if (comm) {
    fail_together_on_throw(*comm, who, fn);
  } else {
    fn();
  }
}

c10::IValue dict_of(const StateDict& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, tensor] : state) dict.insert(name, tensor);
  return dict;
}

// Every rank's CPU generator state ("rank<r>"): dropout masks and anything else drawn from it continue exactly.
StateDict gather_generator_states(Collectives* comm) {
  auto generator = at::detail::getDefaultCPUGenerator();
  torch::Tensor mine;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    mine = generator.get_state();
  }
  const std::string bytes(reinterpret_cast<const char*>(mine.data_ptr<uint8_t>()), mine.numel());
  const auto all = comm ? comm->allgather_strings(bytes) : std::vector<std::string>{bytes};
  StateDict out;
  for (size_t r = 0; r < all.size(); ++r) {
    auto state = torch::empty({static_cast<int64_t>(all[r].size())}, torch::kUInt8);
    std::memcpy(state.data_ptr<uint8_t>(), all[r].data(), all[r].size());
    out.emplace_back(fmt::format("rank{}", r), state);
  }
  return out;
}

void restore_generator_state(const StateDict& states, int rank) {
  for (const auto& [name, state] : states) {
    if (name != fmt::format("rank{}", rank)) continue;
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
}

using NamedBytes = std::vector<std::pair<std::string, std::vector<char>>>;

// Rank 0's part of save(): the files, then the manifest that makes them a checkpoint.
void write_checkpoint(const CheckpointInfo& info, const NamedBytes& files) {
  make_directories(info.path);
  fsync_directory(info.path.substr(0, info.path.find_last_of('/')));
  const std::string manifest_path = info.path + "/" + kManifestName;
  if (::unlink(manifest_path.c_str()) == 0) fsync_directory(info.path);  // a step saved again: torn until done
  Manifest manifest{info.step, info.world_size, info.engine, {}, info.meta};
  for (const auto& [name, bytes] : files) {
    write_file_atomically(info.path + "/" + name, bytes);
    manifest.files.push_back(entry_for(name, bytes));
  }
  write_file_atomically(manifest_path, encode_manifest(manifest));
}

CheckpointInfo info_of(const Manifest& m, const std::string& path) {
  return {m.step, path, m.world_size, m.engine, m.meta};
}

// "" when every file the manifest lists is there with its size and checksum.
std::string verify(const std::string& path, const Manifest& manifest) {
  for (const auto& entry : manifest.files) {
    const std::string file = path + "/" + entry.name;
    std::vector<char> bytes;
    try {
      bytes = read_file_bytes(file);
    } catch (const ConfigError& e) {
      return e.what();
    }
    if (auto problem = checksum_problem(file, entry, bytes); !problem.empty()) return problem;
  }
  return "";
}

struct Found {
  std::optional<CheckpointInfo> info;
  std::string tag = "none";  // what ranks compare: the directory and its manifest's checksum
};

// The newest checkpoint whose files all check out. Rank 0 (`main`) says why it skips one and moves it aside
// (DIR/damaged-step-N): kept for inspection, out of every later scan and of --keep's count.
Found newest_verified(const std::string& dir, bool main) {
  const auto candidates = manifested_checkpoints(dir);
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    const std::string manifest_path = it->second + "/" + kManifestName;
    std::string problem;
    try {
      const auto manifest = read_manifest(manifest_path);
      problem = verify(it->second, manifest);
      if (problem.empty()) {
        const auto crc = crc32_of(read_file_bytes(manifest_path));
        return {info_of(manifest, it->second), fmt::format("{} (manifest CRC-32 {:08x})", it->second, crc)};
      }
    } catch (const ConfigError& e) {
      problem = e.what();
    }
    if (!main) continue;
    fmt::print(stderr, "gradsync: checkpoint {} is damaged, using an older one (moved to {}): {}\n", it->second,
               set_aside(it->second), problem);
  }
  return {};
}

void check_same_checkpoint(Collectives& comm, const std::string& dir, const std::string& tag) {
  const auto tags = comm.allgather_strings(tag);
  std::vector<std::string> lines;
  bool differ = false;
  for (size_t r = 0; r < tags.size(); ++r) {
    differ = differ || tags[r] != tags[0];
    lines.push_back(fmt::format("rank {}: {}", r, tags[r]));
  }
  if (differ) {
    throw ConfigError(fmt::format("ranks disagree on the checkpoint to resume from in '{}': {}; every rank must "
                                  "see the same directory (a shared file system)", dir, fmt::join(lines, ", ")));
  }
}

// One file of a checkpoint, checked against the manifest, then read weights-only.
c10::IValue read_checked(const std::string& path, const Manifest& manifest, const std::string& name) {
  const std::string file = path + "/" + name;
  for (const auto& entry : manifest.files) {
    if (entry.name != name) continue;
    const auto bytes = read_file_bytes(file);
    if (auto problem = checksum_problem(file, entry, bytes); !problem.empty()) throw ConfigError(problem);
    try {
      return decode_torch_file(bytes);
    } catch (const std::exception& e) {
      throw ConfigError(fmt::format("checkpoint file '{}' is not readable: {}", file, e.what()));
    }
  }
  throw ConfigError(fmt::format("checkpoint {} lists no {} in its manifest", path, name));
}

}  // namespace

Checkpoints::Checkpoints(std::string dir, Collectives* comm, int keep)
    : dir_(std::move(dir)), comm_(comm), keep_(keep) {
  if (dir_.empty()) throw ConfigError("checkpoint directory: an empty path; give a directory");
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  if (keep_ < 0) throw ConfigError(fmt::format("checkpoints to keep: {} is invalid; expected >= 0 (0: all)", keep_));
  together(comm_, "checkpoint directory", [&] {
    if (rank_of(comm_) != 0) return;
    make_directories(dir_);
    if (::access(dir_.c_str(), W_OK | X_OK) != 0) {
      throw ConfigError(fmt::format("checkpoint directory '{}' is not writable: {}", dir_, std::strerror(errno)));
    }
    for (const auto& removed : remove_torn_checkpoints(dir_)) {
      fmt::print(stderr, "gradsync: removed {}, left by a writer that did not finish\n", removed);
    }
  });
}

CheckpointInfo Checkpoints::save(int64_t step, Engine& engine, const torch::optim::Optimizer& optimizer,
                                 const std::map<std::string, std::string>& meta) {
  if (step < 0) throw ConfigError(fmt::format("checkpoint step {} is invalid; expected >= 0", step));
  StateDict model;
  c10::IValue optim;
  // Collectives for the sharded engines; for the others rank 0 alone assembles them: a failure there (an optimizer
  // over foreign tensors) must reach the other ranks before they wait in the next collective.
  together(comm_, "gathering the checkpoint's model and optimizer state", [&] {
    model = engine.state_dict(/*rank0_only=*/true);
    optim = engine.full_optim_state_dict(optimizer, /*rank0_only=*/true);
  });
  const auto generators = gather_generator_states(comm_);                       // collective
  const auto layout = engine.layout_state();
  CheckpointInfo info{step, dir_ + "/" + checkpoint_dir_name(step), size_of(comm_), engine.name(), meta};
  together(comm_, fmt::format("saving checkpoint {}", info.path), [&] {
    if (rank_of(comm_) != 0) return;
    write_checkpoint(info, {{kModelFile, encode_torch_file(dict_of(model))},
                            {kOptimFile, encode_torch_file(optim)},
                            {kRngFile, encode_torch_file(dict_of(generators))},
                            {kLayoutFile, encode_torch_file(dict_of(layout))}});
    // The newest `keep` up to this one stay; later steps (a caller saving an earlier step) are not counted.
    auto complete = manifested_checkpoints(dir_);
    complete.erase(std::remove_if(complete.begin(), complete.end(), [&](const auto& c) { return c.first > step; }),
                   complete.end());
    for (size_t i = 0; keep_ > 0 && i + keep_ < complete.size(); ++i) remove_checkpoint(complete[i].second);
  });
  return info;
}

std::optional<CheckpointInfo> Checkpoints::latest() {
  Found found;
  together(comm_, fmt::format("finding the latest checkpoint in '{}'", dir_),
           [&] { found = newest_verified(dir_, rank_of(comm_) == 0); });
  if (comm_) check_same_checkpoint(*comm_, dir_, found.tag);
  return found.info;
}

void Checkpoints::load(const CheckpointInfo& checkpoint, Engine& engine, torch::optim::Optimizer& optimizer) {
  StateDict model, generators, layout;
  c10::IValue optim;
  together(comm_, fmt::format("loading checkpoint {}", checkpoint.path), [&] {
    const auto manifest = read_manifest(checkpoint.path + "/" + kManifestName);
    if (rank_of(comm_) == 0) {  // Engine::load_state_dict takes rank 0's
      model = to_state_dict(read_checked(checkpoint.path, manifest, kModelFile),
                            checkpoint.path + "/" + kModelFile);
    }
    optim = read_checked(checkpoint.path, manifest, kOptimFile);
    generators = to_state_dict(read_checked(checkpoint.path, manifest, kRngFile),
                               checkpoint.path + "/" + kRngFile);
    if (checkpoint.engine == engine.name()) {  // another engine has another layout: its own is as good
      layout = to_state_dict(read_checked(checkpoint.path, manifest, kLayoutFile),
                             checkpoint.path + "/" + kLayoutFile);
    }
  });
  engine.load_state_dict(model);  // collective; strict: nothing is modified unless every key matches
  engine.load_layout_state(layout);
  engine.load_full_optim_state_dict(optimizer, optim);
  restore_generator_state(generators, rank_of(comm_));
}

std::vector<CheckpointInfo> Checkpoints::list() const {
  std::vector<CheckpointInfo> out;
  for (const auto& [step, path] : manifested_checkpoints(dir_)) {
    try {
      out.push_back(info_of(read_manifest(path + "/" + kManifestName), path));
    } catch (const ConfigError&) {  // not complete: latest() says why
    }
  }
  return out;
}

}  // namespace gradsync
