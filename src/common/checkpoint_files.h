// defines: the on-disk layer of a checkpoint directory (include/gradsync/checkpoint.h): names, the manifest and
// its checksums, the scan for complete checkpoints, and the removal of torn ones and of those beyond `keep`.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace gradsync {

struct ManifestEntry {
  std::string name;  // a file in the checkpoint's directory ("model.pt")
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct Manifest {
  int64_t step = 0;
  int world_size = 0;
  std::string engine;
  std::vector<ManifestEntry> files;
  std::map<std::string, std::string> meta;
};

inline constexpr const char* kManifestName = "manifest.json";
// The files a checkpoint holds besides its manifest (include/gradsync/checkpoint.h says what each one is).
inline constexpr const char* kModelFile = "model.pt";
inline constexpr const char* kOptimFile = "optim.pt";
inline constexpr const char* kRngFile = "rng.pt";
inline constexpr const char* kLayoutFile = "layout.pt";

// "step-000000000042": fixed width, so names sort as steps do.
std::string checkpoint_dir_name(int64_t step);

// zlib's CRC-32 of the bytes, the checksum zip files use.
uint32_t crc32_of(const std::vector<char>& bytes);
ManifestEntry entry_for(const std::string& name, const std::vector<char>& bytes);

std::vector<char> encode_manifest(const Manifest& manifest);
// ConfigError naming the path and what is wrong (unreadable, not JSON, a field missing or of the wrong type).
Manifest read_manifest(const std::string& path);

// The whole file; ConfigError naming the path and errno.
std::vector<char> read_file_bytes(const std::string& path);
// "" when `bytes` is what the manifest lists for `entry`, otherwise "<path>: N bytes, CRC-32 x; the manifest
// lists M bytes, CRC-32 y".
std::string checksum_problem(const std::string& path, const ManifestEntry& entry, const std::vector<char>& bytes);

// The step-<digits> directories of `dir` with a manifest, by step, oldest first (manifests not parsed).
std::vector<std::pair<int64_t, std::string>> manifested_checkpoints(const std::string& dir);

// What a killed writer leaves in the checkpoint directories of `dir`: temp files of its files
// (<name>.tmp.<pid>.<random>, their writer gone), and checkpoint directories without a manifest (only the files a
// checkpoint holds are removed; anything else keeps its directory). Returns what was removed.
std::vector<std::string> remove_torn_checkpoints(const std::string& dir);

// Renames a checkpoint directory that failed its checks to DIR/damaged-step-N (or damaged-step-N.K when that
// exists); returns the new path, or the old one when the rename failed.
std::string set_aside(const std::string& path);

// Removes a checkpoint directory: its manifest first (from then on it is not a checkpoint), then the rest.
void remove_checkpoint(const std::string& path);

}  // namespace gradsync
