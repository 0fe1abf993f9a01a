// `gradsync train --trace DIR` (see trace_session.h).
#include "train/trace_session.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradsync/error.h"
#include "train/median.h"

namespace gradsync::cli {
namespace {

std::string host_name() {
  char buf[256] = {};
  return gethostname(buf, sizeof(buf) - 1) == 0 ? std::string(buf) : std::string("unknown-host");
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  if (!out) throw Error(fmt::format("--trace: cannot write {}: {}", path, std::strerror(errno)));
}

// Every process of a host reads one CLOCK_MONOTONIC, so only ranks on another host than rank 0 need an offset: the
// difference of the clocks read right after one barrier (its exit skew, tens of microseconds on a LAN, is the error).
TraceFileInfo align_clocks(World& world) {
  TraceFileInfo info;
  info.rank = world.rank();
  info.world_size = world.size();
  info.host = host_name();
  world.comm().barrier();
  const int64_t mine = Tracer::now_ns();
  const auto all = world.comm().allgather_strings(fmt::format("{} {}", mine, info.host));
  const auto space = all[0].find(' ');
  const int64_t zero = std::stoll(all[0].substr(0, space));
  info.clock_offset_ns = all[0].substr(space + 1) == info.host ? 0 : zero - mine;
  info.origin_ns = zero - info.clock_offset_ns;
  return info;
}

nlohmann::json traffic_json(const CommStats& t) {
  return {{"allgather", t.allgather}, {"reduce_scatter", t.reduce_scatter}, {"allreduce", t.allreduce},
          {"across_replicas", t.across_replicas}, {"total", t.total()}, {"calls", t.calls}};
}

// "rank 1: compute 12.3 ms, communication 4.5 ms (exposed 1.2 ms), overlap 73%" from a rank's otherData.steps.
std::string median_line(const nlohmann::json& rank) {
  std::vector<double> compute, comm, exposed, overlap, step;
  for (const auto& s : rank["steps"]) {
    compute.push_back(s["compute_seconds"]);
    comm.push_back(s["communication_seconds"]);
    exposed.push_back(s["exposed_seconds"]);
    overlap.push_back(s["overlap"]);
    step.push_back(s["step_seconds"]);
  }
  return fmt::format("rank {}: step {:.2f} ms = compute {:.2f} ms + exposed communication {:.2f} ms (+ the rest); "
                     "communication {:.2f} ms, {:.0f}% of it overlapped", rank["rank"].get<int>(), 1e3 * median(step),
                     1e3 * median(compute), 1e3 * median(exposed), 1e3 * median(comm), 100 * median(overlap));
}

}  // namespace

TraceSession::TraceSession(const std::string& dir, const std::shared_ptr<World>& world) : dir_(dir), world_(world) {
  if (dir_.empty() || !world_) return;
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  if (error || access(dir_.c_str(), W_OK | X_OK) != 0) {
    throw ConfigError(fmt::format("--trace {}: cannot create or write the directory: {}", dir_,
                                  error ? error.message() : std::strerror(errno)));
  }
  info_ = align_clocks(*world_);
  tracer_ = std::make_shared<Tracer>();
  world_->comm().set_tracer(tracer_);
}

void TraceSession::begin_step(int64_t step) {
  if (tracer_) tracer_->begin_step(step);
}

void TraceSession::end_step(StepRecord& record) {
  if (!tracer_) return;
  tracer_->end_step();
  record.breakdown = tracer_->breakdown(record.step);
}

void TraceSession::finish(const Engine& engine, bool quiet) {
  if (!tracer_) return;
  world_->comm().set_tracer(nullptr);  // what follows (the gather of the files) is not part of the run
  auto mine = nlohmann::json::parse(trace_json(tracer_->events(), info_));
  mine["otherData"]["traffic"] = traffic_json(engine.traffic());
  mine["otherData"]["engine"] = engine.name();
  const std::string text = mine.dump();
  write_file(fmt::format("{}/trace-rank-{}.json", dir_, info_.rank), text);
  // Every rank receives every file though only rank 0 writes the merge: Collectives has no gather to one rank,
  // and this runs once, after the last step, on files of a few MB at most.
  const auto all = world_->comm().allgather_strings(text);
  if (!world_->is_main()) return;
  const std::string merged_path = dir_ + "/trace.json";
  write_file(merged_path, merge_trace_json(all));
  if (quiet) return;
  fmt::print("gradsync train: trace of {} rank(s) in {} (Perfetto, chrome://tracing; gradsync trace plot)\n",
             all.size(), merged_path);
  fmt::print("gradsync train: median per step, from the trace:\n");
  for (const auto& text_of_rank : all) {
    fmt::print("  {}\n", median_line(nlohmann::json::parse(text_of_rank)["otherData"]));
  }
}

}  // namespace gradsync::cli
