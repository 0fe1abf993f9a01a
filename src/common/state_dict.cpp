// State dicts with Python's keys and Python-readable files (see state_dict.h).
#include "gradsync/state_dict.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

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

[[noreturn]] void fail_errno(const std::string& what, const std::string& path) {
  throw Error(fmt::format("{} '{}' failed: {} (errno {})", what, path, std::strerror(errno), errno));
}

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno("writing", path);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void fsync_directory_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: the rename itself already happened
  ::fsync(fd);
  ::close(fd);
}

void write_atomically(const std::vector<char>& bytes, const std::string& path) {
  const std::string temp = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail_errno("creating", temp);
  try {
    write_all(fd, bytes.data(), bytes.size(), temp);
    if (::fsync(fd) != 0) fail_errno("fsync of", temp);
  } catch (...) {
    ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    ::unlink(temp.c_str());
    fail_errno("renaming into", path);
  }
  fsync_directory_of(path);
}

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
  write_atomically(torch::pickle_save(dict), path);
}

StateDict load_state_dict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("cannot open state file '{}': {}", path, std::strerror(errno)));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!zip_structure_ok(bytes)) {
    throw ConfigError(fmt::format("state file '{}' is truncated or not a torch.save zip file ({} bytes; save it "
                                  "with torch.save(dict(model.state_dict()), path))", path, bytes.size()));
  }
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("state file '{}' is not a torch.save file of a dict of tensors (save it with "
                                  "torch.save(dict(model.state_dict()), path)): {}", path, e.what()));
  }
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

void load_into(torch::nn::Module& module, const StateDict& state) {
  auto target = state_dict(module);
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  std::vector<std::string> missing, mismatched, unexpected;
  for (const auto& [name, tensor] : target) {
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
    } else if (it->second.sizes() != tensor.sizes()) {
      mismatched.push_back(fmt::format("{} (file {}, model {})", name, shape_of(it->second), shape_of(tensor)));
    }
  }
  std::map<std::string, bool> known;
  for (const auto& item : target) known[item.first] = true;
  for (const auto& item : state) {
    if (!known.count(item.first)) unexpected.push_back(item.first);
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::string msg = "state dict does not match the model:";
    if (!missing.empty()) msg += fmt::format(" missing keys: {};", fmt::join(missing, ", "));
    if (!unexpected.empty()) msg += fmt::format(" unexpected keys: {};", fmt::join(unexpected, ", "));
    if (!mismatched.empty()) msg += fmt::format(" wrong shapes: {};", fmt::join(mismatched, ", "));
    throw ConfigError(msg);
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : target) tensor.copy_(given.at(name).to(tensor.scalar_type()));
}

}  // namespace gradsync
