// The --log file of `gradsync train` (see step_log.h).
#include "train/step_log.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradsync/error.h"

namespace gradsync::cli {
namespace {

// The lines of a --log file whose "step" is below `step` (an unparseable line ends the kept part).
std::string lines_before(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!record.is_object() || !record.contains("step") || !record["step"].is_number_integer()) break;
    if (record["step"].get<int64_t>() >= step) break;
    kept += line + "\n";
  }
  return kept;
}

}  // namespace

// On resume the kept lines go to a temp file renamed over the log: a crash right now leaves the old log or the
// new one, never an empty one. Then the log is appended to.
StepLog::StepLog(const std::string& path, bool enabled, int64_t resumed_at) : path_(path) {
  if (!enabled || path.empty()) return;
  const std::string temp = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream out(temp, std::ios::trunc);
    out << (resumed_at > 0 ? lines_before(path, resumed_at) : std::string());
    out.flush();
    if (!out || std::rename(temp.c_str(), path.c_str()) != 0) {
      const int error = errno;
      std::remove(temp.c_str());
      throw ConfigError(fmt::format("--log {}: cannot write it: {}", path, std::strerror(error)));
    }
  }
  file_.open(path, std::ios::app);
  if (!file_) throw ConfigError(fmt::format("--log {}: cannot open for writing: {}", path, std::strerror(errno)));
}

void StepLog::check() {
  if (!file_) throw Error(fmt::format("--log {}: writing failed: {}", path_, std::strerror(errno)));
}

void StepLog::write(const StepRecord& r) {
  if (!file_.is_open()) return;
  nlohmann::json line{{"step", r.step}, {"epoch", r.epoch}, {"loss", r.loss}, {"samples", r.samples},
                      {"seconds", r.seconds}, {"world_size", r.world_size}, {"accumulate", r.accumulate}};
  if (!r.sample_ids.empty()) line["sample_ids"] = r.sample_ids;
  if (r.memory_peak >= 0) line["memory_peak"] = r.memory_peak;
  if (r.rss_peak >= 0) line["rss_peak"] = r.rss_peak;
  if (r.sent_bytes >= 0) line["sent_bytes"] = r.sent_bytes;
  if (const auto& b = r.breakdown) {  // --trace: rank 0's figures (each rank's are in its trace file)
    line["compute_seconds"] = b->compute_seconds;
    line["communication_seconds"] = b->communication_seconds;
    line["exposed_seconds"] = b->exposed_seconds;
    line["overlap"] = b->overlap;
  }
  file_ << line.dump() << "\n" << std::flush;
  check();
}

void StepLog::write_accuracy(int64_t epoch, int64_t step, double percent, double test_loss) {
  if (!file_.is_open()) return;
  nlohmann::json line{{"epoch", epoch}, {"step", step}, {"test_accuracy", percent}};
  if (test_loss >= 0) line["test_loss"] = test_loss;
  file_ << line.dump() << "\n" << std::flush;
  check();
}

}  // namespace gradsync::cli
