// Sharded checkpoints (see sharded_checkpoint.h).
#include "shard/sharded_checkpoint.h"

#include <fmt/format.h>

#include "common/atomic_file.h"
#include "common/torch_file.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"
#include "shard/optimizer_state.h"

namespace gradsync {
namespace {

constexpr const char* kFormat = "gradsync-sharded/1";

c10::impl::GenericDict new_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

c10::impl::GenericDict optimizer_entry(const torch::optim::Optimizer& optimizer, const torch::Tensor& shard) {
  auto dict = new_dict();
  auto state = get_param_state(optimizer, shard);
  if (state.step) dict.insert("step", *state.step);
  for (const auto& [name, tensor] : state.tensors) dict.insert(name, tensor.detach().clone());
  return dict;
}

ParamState parse_optimizer_entry(const c10::impl::GenericDict& dict) {
  ParamState state;
  for (const auto& item : dict) {
    const auto key = item.key().toStringRef();
    if (key == "step") {
      state.step = item.value().toInt();
    } else {
      state.tensors.emplace_back(key, item.value().toTensor());
    }
  }
  return state;
}

int64_t get_int(const c10::impl::GenericDict& dict, const std::string& key, const std::string& path) {
  auto it = dict.find(key);
  if (it == dict.end() || !it->value().isInt()) throw ConfigError(fmt::format("{}: no integer '{}'", path, key));
  return it->value().toInt();
}

c10::impl::GenericDict get_dict(const c10::impl::GenericDict& dict, const std::string& key, const std::string& path) {
  auto it = dict.find(key);
  if (it == dict.end() || !it->value().isGenericDict()) throw ConfigError(fmt::format("{}: no dict '{}'", path, key));
  return it->value().toGenericDict();
}

void load_slot(const c10::impl::GenericDict& units, const ShardSlot& slot, const std::string& path,
               torch::optim::Optimizer* optimizer) {
  auto it = units.find(slot.unit);
  if (it == units.end()) throw ConfigError(fmt::format("{}: no unit '{}'", path, slot.unit));
  const auto unit = it->value().toGenericDict();
  const int64_t numel = get_int(unit, "numel", path), padded = get_int(unit, "padded_numel", path),
                offset = get_int(unit, "shard_offset", path);
  if (numel != slot.numel || padded != slot.padded_numel || offset != slot.shard_offset) {
    throw ConfigError(fmt::format("{}: unit '{}' was saved with {} elements padded to {}, shard at {}; this model has "
                                  "{} padded to {}, shard at {}", path, slot.unit, numel, padded, offset, slot.numel,
                                  slot.padded_numel, slot.shard_offset));
  }
  auto shard = unit.at("shard").toTensor();
  if (!shard.sizes().equals(slot.shard.sizes())) {
    throw ConfigError(fmt::format("{}: unit '{}' shard has {} elements, expected {}", path, slot.unit, shard.numel(),
                                  slot.shard.numel()));
  }
  {
    torch::NoGradGuard no_grad;
    slot.shard.detach().copy_(shard);
  }
  if (optimizer) set_param_state(*optimizer, slot.shard, parse_optimizer_entry(get_dict(unit, "optimizer", path)));
}

}  // namespace

std::string shard_file(const std::string& dir, int rank, int world) {
  return fmt::format("{}/shard-{}-of-{}.pt", dir, rank, world);
}

void save_shards(const std::string& dir, const std::string& kind, int rank, int world,
                 const std::vector<ShardSlot>& slots, const torch::optim::Optimizer* optimizer) {
  auto root = new_dict();
  root.insert("format", std::string(kFormat));
  root.insert("kind", kind);
  root.insert("rank", static_cast<int64_t>(rank));
  root.insert("world_size", static_cast<int64_t>(world));
  auto units = new_dict();
  for (const auto& slot : slots) {
    auto unit = new_dict();
    unit.insert("numel", slot.numel);
    unit.insert("padded_numel", slot.padded_numel);
    unit.insert("shard_offset", slot.shard_offset);
    unit.insert("shard", slot.shard.detach().clone());
    unit.insert("optimizer", optimizer ? optimizer_entry(*optimizer, slot.shard) : new_dict());
    units.insert(slot.unit, unit);
  }
  root.insert("units", units);
  make_directories(dir);
  write_file_atomically(shard_file(dir, rank, world), encode_torch_file(root));
}

void load_shards(const std::string& dir, int rank, int world, const std::vector<ShardSlot>& slots,
                 torch::optim::Optimizer* optimizer) {
  const auto path = shard_file(dir, rank, world);
  const auto value = read_torch_file(path, "sharded checkpoint",
                                     "a sharded checkpoint loads only with the world size it was saved with; use a "
                                     "full state dict to change it");
  if (!value.isGenericDict()) throw ConfigError(fmt::format("{}: not a gradsync sharded checkpoint", path));
  const auto root = value.toGenericDict();
  auto format = root.find("format");
  if (format == root.end() || !format->value().isString() || format->value().toStringRef() != kFormat) {
    throw ConfigError(fmt::format("{}: not a {} file", path, kFormat));
  }
  if (get_int(root, "world_size", path) != world || get_int(root, "rank", path) != rank) {
    throw ConfigError(fmt::format("{}: written by rank {} of {}, read by rank {} of {}", path,
                                  get_int(root, "rank", path), get_int(root, "world_size", path), rank, world));
  }
  const auto units = get_dict(root, "units", path);
  if (units.size() != slots.size()) {
    throw ConfigError(fmt::format("{}: {} units saved, the model has {}", path, units.size(), slots.size()));
  }
  for (const auto& slot : slots) load_slot(units, slot, path, optimizer);
}

}  // namespace gradsync
