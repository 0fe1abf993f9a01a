// The on-disk layer of checkpoints (see checkpoint_files.h and include/gradsync/checkpoint.h).
#include "common/checkpoint_files.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "gradsync/error.h"

namespace gradsync {
namespace {

constexpr const char* kFormat = "gradsync-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kPrefix = "step-";

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// The step of a "step-<12 digits>" name (what checkpoint_dir_name() makes), or -1.
int64_t step_of(const std::string& name) {
  if (name.rfind(kPrefix, 0) != 0) return -1;
  const std::string digits = name.substr(std::strlen(kPrefix));
  if (digits.size() != 12 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

// The files a checkpoint directory holds, and their temp files while they are written.
bool is_checkpoint_file(const std::string& name) {
  for (const char* known : {kModelFile, kOptimFile, kRngFile, kLayoutFile, kManifestName}) {
    if (name == known || name.rfind(std::string(known) + ".tmp.", 0) == 0) return true;
  }
  return false;
}

std::vector<std::string> entries_of(const std::string& directory) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(directory.c_str());
  if (!dir) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

// Only the files gradsync writes there; anything else is left alone (and so is the directory then).
void remove_files_then_directory(const std::string& path) {
  for (const auto& name : entries_of(path)) {
    if (is_checkpoint_file(name) && !is_directory(path + "/" + name)) ::unlink((path + "/" + name).c_str());
  }
  ::rmdir(path.c_str());
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return fmt::format("{}{:012d}", kPrefix, step); }

uint32_t crc32_of(const std::vector<char>& bytes) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  for (size_t done = 0; done < bytes.size();) {  // zlib takes uInt lengths
    const auto n = static_cast<uInt>(std::min<size_t>(bytes.size() - done, 1u << 30));
    crc = ::crc32(crc, data + done, n);
    done += n;
  }
  return static_cast<uint32_t>(crc);
}

ManifestEntry entry_for(const std::string& name, const std::vector<char>& bytes) {
  return {name, bytes.size(), crc32_of(bytes)};
}

std::vector<char> encode_manifest(const Manifest& m) {
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32", f.crc32}});
  const nlohmann::json doc{{"format", kFormat}, {"version", kVersion}, {"step", m.step},
                           {"world_size", m.world_size}, {"engine", m.engine}, {"files", files},
                           {"meta", m.meta}};
  const std::string text = doc.dump(2) + "\n";
  return {text.begin(), text.end()};
}

Manifest read_manifest(const std::string& path) {
  const auto bytes = read_file_bytes(path);
  try {
    const auto doc = nlohmann::json::parse(bytes.begin(), bytes.end());
    if (doc.at("format").get<std::string>() != kFormat || doc.at("version").get<int>() != kVersion) {
      throw ConfigError(fmt::format("checkpoint manifest '{}' is not a {} version {} manifest", path, kFormat,
                                    kVersion));
    }
    Manifest m;
    m.step = doc.at("step").get<int64_t>();
    m.world_size = doc.at("world_size").get<int>();
    m.engine = doc.at("engine").get<std::string>();
    m.meta = doc.at("meta").get<std::map<std::string, std::string>>();
    for (const auto& f : doc.at("files")) {
      m.files.push_back({f.at("name").get<std::string>(), f.at("bytes").get<uint64_t>(),
                         f.at("crc32").get<uint32_t>()});
    }
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(fmt::format("checkpoint manifest '{}' is malformed: {}", path, e.what()));
  }
}

std::vector<char> read_file_bytes(const std::string& path) {
  if (is_directory(path)) throw ConfigError(fmt::format("cannot read '{}': it is a directory", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("cannot read '{}': {}", path, std::strerror(errno)));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string checksum_problem(const std::string& path, const ManifestEntry& entry, const std::vector<char>& bytes) {
  const auto crc = crc32_of(bytes);
  if (bytes.size() == entry.bytes && crc == entry.crc32) return "";
  return fmt::format("{}: {} bytes, CRC-32 {:08x}; the manifest lists {} bytes, CRC-32 {:08x}", path, bytes.size(),
                     crc, entry.bytes, entry.crc32);
}

std::vector<std::pair<int64_t, std::string>> manifested_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const auto& name : entries_of(dir)) {
    const int64_t step = step_of(name);
    const std::string path = dir + "/" + name;
    if (step >= 0 && is_directory(path) && exists(path + "/" + kManifestName)) out.emplace_back(step, path);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> remove_torn_checkpoints(const std::string& dir) {
  std::vector<std::string> removed;
  for (const auto& name : entries_of(dir)) {
    const std::string path = dir + "/" + name;
    if (step_of(name) < 0 || !is_directory(path)) continue;
    remove_stale_temp_files_in(path);
    if (exists(path + "/" + kManifestName)) continue;
    remove_files_then_directory(path);
    removed.push_back(path);
  }
  if (!removed.empty()) fsync_directory(dir);
  return removed;
}

std::string set_aside(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const std::string base = path.substr(0, slash + 1) + "damaged-" + path.substr(slash + 1);
  std::string target = base;
  for (int k = 1; exists(target) && k < 1000; ++k) target = fmt::format("{}.{}", base, k);
  if (::rename(path.c_str(), target.c_str()) != 0) return path;
  fsync_directory(path.substr(0, slash));
  return target;
}

void remove_checkpoint(const std::string& path) {
  if (::unlink((path + "/" + kManifestName).c_str()) == 0) fsync_directory(path);
  remove_files_then_directory(path);
  fsync_directory(path.substr(0, path.find_last_of('/')));
}

}  // namespace gradsync
