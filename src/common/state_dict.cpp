// State dicts with Python's keys and Python-readable files (see state_dict.h).
#include "gradsync/state_dict.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/atomic_file.h"
#include "common/torch_file.h"
#include "gradsync/error.h"

namespace gradsync {
namespace {

constexpr const char* kStateFileHint = "save it with torch.save(model.state_dict(), path)";

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

}  // namespace

StateDict state_dict(const torch::nn::Module& module) {
  StateDict out;
  collect(module, "", out);
  return out;
}

void save_state_dict(const StateDict& state, const std::string& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, tensor] : state) dict.insert(name, tensor);
  write_file_atomically(path, encode_torch_file(dict));
}

void save_torch_file(const c10::IValue& value, const std::string& path) {
  write_file_atomically(path, encode_torch_file(value));
}

c10::IValue unpickle_torch_zip(const std::vector<char>& bytes) { return decode_torch_file(bytes); }

c10::IValue read_torch_file(const std::string& path, const std::string& kind, const std::string& hint) {
  const std::string advice = hint.empty() ? "" : "; " + hint;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw ConfigError(fmt::format("cannot open {} '{}': it is a directory{}", kind, path, advice));
  }
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

StateDict to_state_dict(const c10::IValue& value, const std::string& what) {
  if (!value.isGenericDict()) {
    throw ConfigError(fmt::format("{} holds a {}, expected a dict of tensors (save it with "
                                  "torch.save(model.state_dict(), path))", what, value.tagKind()));
  }
  StateDict out;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor()) {
      throw ConfigError(fmt::format("{}: every entry must map a string to a tensor", what));
    }
    out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

StateDict load_state_dict(const std::string& path) {
  return to_state_dict(read_torch_file(path, "state file", kStateFileHint), fmt::format("state file '{}'", path));
}

size_t consume_prefix_in_state_dict_if_present(StateDict& state, const std::string& prefix) {
  size_t changed = 0;
  for (auto& item : state) {
    if (!prefix.empty() && item.first.rfind(prefix, 0) == 0) {
      item.first.erase(0, prefix.size());
      ++changed;
    }
  }
  return changed;
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
