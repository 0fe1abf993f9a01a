// State dicts with Python's keys and Python-readable files (see state_dict.h).
#include "gradsync/state_dict.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/atomic_file.h"
#include "gradsync/error.h"

namespace gradsync {
namespace {

constexpr const char* kStateFileHint = "save it with torch.save(dict(model.state_dict()), path)";

void collect(const torch::nn::Module& module, const std::string& prefix, StateDict& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& child : module.named_children()) collect(*child.value(), prefix + child.key() + ".", out);
}

std::string shape_of(const torch::Tensor& t) { return fmt::format("[{}]", fmt::join(t.sizes(), ", ")); }

uint64_t little_endian(const std::vector<char>& b, size_t at, size_t width) {
  uint64_t v = 0;
  for (size_t i = 0; i < width; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  return v;
}

// libtorch 1.13's pickle_load reads a truncated zip past the end of its buffer (and may then "load" it). Check the
// zip's end records and central-directory bounds first, so a torn or foreign file is refused before parsing.
bool zip_structure_ok(const std::vector<char>& b) {
  constexpr size_t kEocd = 22;
  if (b.size() < kEocd) return false;
  const size_t lowest = b.size() >= kEocd + 65535 ? b.size() - kEocd - 65535 : 0;
  for (size_t p = b.size() - kEocd + 1; p-- > lowest;) {
    if (little_endian(b, p, 4) != 0x06054b50) continue;
    if (p + kEocd + little_endian(b, p + 20, 2) != b.size()) return false;  // the record must end the file
    uint64_t cd_size = little_endian(b, p + 12, 4), cd_offset = little_endian(b, p + 16, 4);
    size_t cd_end_limit = p;
    if (p >= 20 && little_endian(b, p - 20, 4) == 0x07064b50) {  // zip64: the real figures are elsewhere
      const uint64_t z = little_endian(b, p - 20 + 8, 8);
      if (z + 56 > p - 20 || little_endian(b, static_cast<size_t>(z), 4) != 0x06064b50) return false;
      cd_size = little_endian(b, static_cast<size_t>(z) + 40, 8);
      cd_offset = little_endian(b, static_cast<size_t>(z) + 48, 8);
      cd_end_limit = static_cast<size_t>(z);
    }
    return cd_offset <= cd_end_limit && cd_size <= cd_end_limit - cd_offset;
  }
  return false;
}

}  // namespace

StateDict state_dict(const torch::nn::Module& module) {
  StateDict out;
  collect(module, "", out);
  return out;
}

void save_state_dict(const StateDict& state, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : state) dict.insert(name, tensor.detach().contiguous());
  write_file_atomically(path, torch::pickle_save(dict));
}

c10::IValue unpickle_torch_zip(const std::vector<char>& bytes) {
  if (!zip_structure_ok(bytes)) {
    throw ConfigError(fmt::format("truncated or not a torch.save zip file ({} bytes)", bytes.size()));
  }
  return torch::pickle_load(bytes);
}

c10::IValue read_torch_file(const std::string& path, const std::string& kind, const std::string& hint) {
  const std::string advice = hint.empty() ? "" : "; " + hint;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("cannot open {} '{}': {}{}", kind, path, std::strerror(errno), advice));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return unpickle_torch_zip(bytes);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{} '{}' is {}{}", kind, path, e.what(), advice));
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("{} '{}' is not a readable torch.save file{}: {}", kind, path, advice, e.what()));
  }
}

StateDict load_state_dict(const std::string& path) {
  const auto value = read_torch_file(path, "state file", kStateFileHint);
  if (!value.isGenericDict()) {
    throw ConfigError(fmt::format("state file '{}' holds a {}, expected a dict of tensors (save it with "
                                  "torch.save(dict(model.state_dict()), path))", path, value.tagKind()));
  }
  StateDict out;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor()) {
      throw ConfigError(fmt::format("state file '{}': every entry must map a string to a tensor", path));
    }
    out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

std::string state_dict_mismatch(const StateDict& given, const StateDict& expected, const std::string& given_label) {
  std::map<std::string, torch::Tensor> by_name(given.begin(), given.end());
  std::set<std::string> known;
  std::vector<std::string> missing, mismatched, unexpected;
  for (const auto& [name, tensor] : expected) {
    known.insert(name);
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      missing.push_back(name);
    } else if (!it->second.sizes().equals(tensor.sizes())) {
      mismatched.push_back(
          fmt::format("{} ({} {}, model {})", name, given_label, shape_of(it->second), shape_of(tensor)));
    }
  }
  for (const auto& item : given) {
    if (!known.count(item.first)) unexpected.push_back(item.first);
  }
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back(fmt::format("missing keys: {}", fmt::join(missing, ", ")));
  if (!unexpected.empty()) parts.push_back(fmt::format("unexpected keys: {}", fmt::join(unexpected, ", ")));
  if (!mismatched.empty()) parts.push_back(fmt::format("wrong shapes: {}", fmt::join(mismatched, ", ")));
  return fmt::format("{}", fmt::join(parts, "; "));
}

void load_into(torch::nn::Module& module, const StateDict& state) {
  auto target = state_dict(module);
  const auto problem = state_dict_mismatch(state, target, "file");
  if (!problem.empty()) throw ConfigError("state dict does not match the model: " + problem);
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : target) tensor.copy_(given.at(name).to(tensor.scalar_type()));
}

}  // namespace gradsync
