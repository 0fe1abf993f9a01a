// The timeline of `gradsync train --trace DIR` (gradsync/trace.h, tools/train/trace_session.h): the breakdown's
// interval arithmetic on spans whose answer is known; then real runs of mlp and gpt under ddp, fsdp-full and hsdp
// whose files must be valid trace-event JSON with nested lanes, the same collectives with the same bytes on every
// rank, adding up to the engine's own traffic count and the predicted volume; and controls that cannot overlap
// (one DDP bucket; one FSDP unit without prefetch), whose overlap must be lower than the default's.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gradsync/trace.h"
#include "support/subprocess.h"
#include "train/median.h"

namespace t = gradsync::test;
using gradsync::TraceEvent;
using gradsync::cli::median;
using nlohmann::json;

namespace {

t::CommandOptions traced_run() {
  return t::job_options(std::chrono::seconds(180), {"GRADSYNC_PROGRESS"});
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

TraceEvent span(TraceEvent::Kind kind, int64_t begin, int64_t end, std::string group = "world") {
  TraceEvent e;
  e.kind = kind;
  e.name = kind == TraceEvent::Kind::Collective ? "allreduce" : "span";
  e.begin_ns = begin;
  e.end_ns = end;
  e.group = std::move(group);
  return e;
}

}  // namespace

// Compute [0,100) with a wait [60,80) inside; collectives [50,90) and [85,120) (union [50,120) = 70); the step
// [0,130). Compute 100 - 20 = 80, exposed 20, hidden 70 - |[50,120) ∩ [60,80)| = 50: overlap 50/70.
TEST(TraceBreakdown, UnionsAndIntersectionsOfKnownSpans) {
  using K = TraceEvent::Kind;
  const std::vector<TraceEvent> events{span(K::Compute, 0, 100), span(K::Compute, 10, 40),  // nested: counted once
                                       span(K::Wait, 60, 80), span(K::Collective, 50, 90),
                                       span(K::Collective, 85, 120), span(K::Phase, 100, 130)};
  const auto b = gradsync::breakdown_of(events, 0, 130);
  EXPECT_DOUBLE_EQ(b.step_seconds, 130e-9);
  EXPECT_DOUBLE_EQ(b.compute_seconds, 80e-9);
  EXPECT_DOUBLE_EQ(b.communication_seconds, 70e-9);
  EXPECT_DOUBLE_EQ(b.exposed_seconds, 20e-9);
  EXPECT_DOUBLE_EQ(b.overlap, 50.0 / 70.0);
  // Clipped to the step: only [0, 55) of it.
  const auto clipped = gradsync::breakdown_of(events, 0, 55);
  EXPECT_DOUBLE_EQ(clipped.communication_seconds, 5e-9);
  EXPECT_DOUBLE_EQ(clipped.overlap, 1.0);
  EXPECT_DOUBLE_EQ(gradsync::breakdown_of({}, 0, 10).overlap, 0.0) << "no communication: nothing overlapped";
}

// Two collectives of one group in flight at once cannot share a lane whose spans must nest.
TEST(TraceJson, OverlappingCollectivesOfAGroupTakeASecondLane) {
  using K = TraceEvent::Kind;
  gradsync::TraceFileInfo info;
  info.rank = 3;
  info.origin_ns = 1000;
  const auto text = gradsync::trace_json({span(K::Collective, 1000, 3000), span(K::Collective, 2000, 4000),
                                          span(K::Collective, 5000, 6000), span(K::Collective, 1500, 2500, "shard")},
                                         info);
  const auto trace = json::parse(text);
  std::map<double, int> tid_at;  // ts (us) -> tid
  std::map<int, std::string> lane_names;
  for (const auto& e : trace["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "X") tid_at[e["ts"].get<double>()] = e["tid"].get<int>();
    if (e["ph"] == "M" && e["name"] == "thread_name") lane_names[e["tid"]] = e["args"]["name"];
  }
  EXPECT_EQ(tid_at.at(0.0), tid_at.at(4.0)) << "the third follows the first in its lane";
  EXPECT_NE(tid_at.at(0.0), tid_at.at(1.0)) << "the second overlaps the first";
  EXPECT_EQ(lane_names.at(tid_at.at(0.0)), "comm world");
  EXPECT_EQ(lane_names.at(tid_at.at(1.0)), "comm world 2");
  EXPECT_EQ(lane_names.at(tid_at.at(0.5)), "comm shard");
  EXPECT_EQ(lane_names.at(0), "compute");
}

namespace {

struct TracedRun {
  std::string dir;
  std::vector<json> ranks;  // trace-rank-R.json
  json merged;
  std::vector<json> log;
};

TracedRun run_traced(const std::string& tag, const std::vector<std::string>& flags, int ranks, int steps) {
  TracedRun run{t::make_temp_dir("gradsync-trace-" + tag + "-"), {}, {}, {}};
  std::vector<std::string> argv{GRADSYNC_BIN, "train", "--world-size", std::to_string(ranks), "--steps",
                                std::to_string(steps), "--trace", run.dir + "/trace", "--log", run.dir + "/log"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto r = t::run(argv, traced_run());
  EXPECT_TRUE(r.ok()) << r.describe();
  if (!r.ok()) return run;
  EXPECT_NE(r.out.find("median per step, from the trace"), std::string::npos) << r.out;
  for (int rank = 0; rank < ranks; ++rank) {
    run.ranks.push_back(read_json(run.dir + "/trace/trace-rank-" + std::to_string(rank) + ".json"));
  }
  run.merged = read_json(run.dir + "/trace/trace.json");
  std::ifstream in(run.dir + "/log");
  for (std::string line; std::getline(in, line);) run.log.push_back(json::parse(line));
  return run;
}

// Every complete event of a lane (pid, tid) lies inside the one open before it or after it: a stack.
void expect_valid_and_nested(const json& trace, int pid) {
  ASSERT_TRUE(trace.contains("traceEvents") && trace["traceEvents"].is_array());
  std::map<int, std::vector<std::pair<double, double>>> lanes;
  for (const auto& e : trace["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name")) << e.dump();
    if (e["ph"] != "X") continue;
    ASSERT_EQ(e["pid"], pid) << e.dump();
    ASSERT_GE(e["dur"].get<double>(), 0) << e.dump();
    lanes[e["tid"].get<int>()].emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
  }
  ASSERT_FALSE(lanes.empty());
  const double slack = 0.01;  // us: ts and dur are each rounded from nanoseconds
  for (auto& [tid, spans] : lanes) {
    std::stable_sort(spans.begin(), spans.end(), [](auto a, auto b) {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    std::vector<double> open;  // ends of the enclosing spans
    for (const auto& [begin, end] : spans) {
      while (!open.empty() && open.back() <= begin + slack) open.pop_back();
      if (!open.empty()) {
        ASSERT_LE(end, open.back() + slack) << "pid " << pid << " tid " << tid << " at " << begin;
      }
      open.push_back(end);
    }
  }
}

// A rank's bucket and unit collectives in the order its groups issued them: (group, sequence) -> what and bytes.
std::vector<std::tuple<std::string, std::string, std::string, int64_t>> gradient_collectives(const json& trace,
                                                                                            int64_t* sent) {
  std::vector<std::tuple<std::string, int64_t, std::string, std::string, int64_t>> found;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "collective") continue;
    const auto& a = e["args"];
    const std::string label = a.value("label", "");
    if (label.rfind("bucket ", 0) != 0 && label.rfind("unit ", 0) != 0) continue;
    found.emplace_back(a["group"], a["sequence"], label, e["name"], a["bytes"]);
    *sent += a["sent"].get<int64_t>();
  }
  std::sort(found.begin(), found.end());
  std::vector<std::tuple<std::string, std::string, std::string, int64_t>> out;
  for (const auto& [group, seq, label, name, bytes] : found) out.emplace_back(group, label, name, bytes);
  return out;
}

void check_run(const TracedRun& run, int ranks, int steps) {
  ASSERT_EQ(static_cast<int>(run.ranks.size()), ranks);
  std::vector<std::tuple<std::string, std::string, std::string, int64_t>> first;
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_valid_and_nested(run.ranks[static_cast<size_t>(r)], r);
    int64_t sent = 0;
    const auto mine = gradient_collectives(run.ranks[static_cast<size_t>(r)], &sent);
    EXPECT_FALSE(mine.empty());
    if (r == 0) first = mine;
    EXPECT_EQ(mine, first) << "every rank issues the same bucket and unit collectives with the same bytes";
    const auto& other = run.ranks[static_cast<size_t>(r)]["otherData"];
    EXPECT_EQ(sent, other["traffic"]["total"].get<int64_t>()) << "the trace's bytes are the engine's traffic";
    EXPECT_EQ(static_cast<int>(other["steps"].size()), steps);
  }
  // The merged file: every rank's lanes, each lane still nested.
  for (int r = 0; r < ranks; ++r) {
    json one{{"traceEvents", json::array()}};
    for (const auto& e : run.merged["traceEvents"]) {
      if (e["pid"] == r) one["traceEvents"].push_back(e);
    }
    expect_valid_and_nested(one, r);
  }
  ASSERT_EQ(static_cast<int>(run.log.size()), steps);
  for (const auto& line : run.log) {
    for (const char* key : {"compute_seconds", "communication_seconds", "exposed_seconds", "overlap"}) {
      EXPECT_TRUE(line.contains(key)) << line.dump();
    }
  }
}

}  // namespace

// mlp:12-20-16-4 holds 12*20+20 + 20*16+16 + 16*4+4 = 664 float32 parameters: DDP's buckets are 2656 bytes a
// step, of which each of N ranks sends 2(N-1)/N.
TEST(Trace, MlpUnderDdpIsValidNestedAndAddsUpToThePredictedVolume) {
  const int steps = 4;
  auto run = run_traced("mlp-ddp", {"--model", "mlp:12-20-16-4", "--data", "synthetic:96", "--global-batch", "24",
                                    "--bucket-cap-mb", "0.002", "--first-bucket-mb", "0.001"}, 3, steps);
  check_run(run, 3, steps);
  if (run.ranks.empty()) return;
  int64_t sent = 0, bytes = 0, buckets = 0;
  for (const auto& [group, label, name, b] : gradient_collectives(run.ranks[0], &sent)) bytes += b, ++buckets;
  EXPECT_EQ(bytes, steps * 664 * 4);
  EXPECT_GT(buckets, steps) << "small caps: several buckets a step";
  EXPECT_NEAR(static_cast<double>(sent), steps * 2.0 * 2 / 3 * 664 * 4, static_cast<double>(buckets))
      << "per-bucket integer rounding at most";
}

struct TraceCase {
  const char* tag;
  std::vector<std::string> flags;
  int ranks;
};

// ctest names a case by its tag, not by its bytes.
void PrintTo(const TraceCase& c, std::ostream* os) { *os << c.tag; }

class TraceStrategies : public ::testing::TestWithParam<TraceCase> {};

TEST_P(TraceStrategies, EveryFileIsValidNestedAndTheSameOnEveryRank) {
  check_run(run_traced(GetParam().tag, GetParam().flags, GetParam().ranks, 3), GetParam().ranks, 3);
}

const std::vector<std::string> kMlp{"--model", "mlp:12-20-16-4", "--data", "synthetic:96", "--global-batch", "24"};
const std::vector<std::string> kGpt{"--model", "gpt:256-16-16-2-2", "--data", "fortunes", "--global-batch", "8",
                                    "--optimizer", "adam"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

INSTANTIATE_TEST_SUITE_P(
    , TraceStrategies,
    ::testing::Values(TraceCase{"mlp_fsdp_full", with(kMlp, {"--strategy", "fsdp-full", "--wrap", "children"}), 2},
                      TraceCase{"mlp_hsdp", with(kMlp, {"--strategy", "hsdp", "--replicas", "2", "--wrap",
                                                        "children"}), 4},
                      TraceCase{"gpt_ddp", with(kGpt, {"--bucket-cap-mb", "0.05", "--first-bucket-mb", "0.02"}), 2},
                      TraceCase{"gpt_fsdp_full", with(kGpt, {"--strategy", "fsdp-full", "--wrap", "type:Block"}), 2},
                      TraceCase{"gpt_hsdp", with(kGpt, {"--strategy", "hsdp", "--replicas", "2", "--wrap",
                                                        "type:Block"}), 4}),
    [](const auto& info) { return std::string(info.param.tag); });

namespace {

// Rank 0's median overlap and the median of (compute + exposed) / step over the run's steps.
std::pair<double, double> overlap_and_coverage(const TracedRun& run) {
  std::vector<double> overlap, coverage;
  for (const auto& s : run.ranks.at(0)["otherData"]["steps"]) {
    overlap.push_back(s["overlap"]);
    coverage.push_back((s["compute_seconds"].get<double>() + s["exposed_seconds"].get<double>()) /
                       s["step_seconds"].get<double>());
  }
  return {median(overlap), median(coverage)};
}

const std::vector<std::string> kWide{"--model", "mlp:256-512-512-512-512-10", "--data", "synthetic:512",
                                     "--global-batch", "64"};

}  // namespace

// Many buckets start their all-reduce while backward still computes; one bucket holding every gradient starts when
// backward is done and is waited for at once.
TEST(TraceOverlap, OneDdpBucketOverlapsLessThanSmallBuckets) {
  auto many = run_traced("ddp-many", with(kWide, {"--bucket-cap-mb", "0.5", "--first-bucket-mb", "0.5"}), 2, 12);
  auto one = run_traced("ddp-one", with(kWide, {"--bucket-cap-mb", "1000", "--first-bucket-mb", "1000"}), 2, 12);
  ASSERT_FALSE(many.ranks.empty() || one.ranks.empty());
  const auto [many_overlap, many_coverage] = overlap_and_coverage(many);
  const auto [one_overlap, one_coverage] = overlap_and_coverage(one);
  std::cout << "overlap: many buckets " << many_overlap << ", one " << one_overlap << "; compute + exposed / step "
            << many_coverage << ", " << one_coverage << "\n";
  EXPECT_GT(many_overlap, one_overlap) << "many buckets " << many_overlap << ", one " << one_overlap;
  for (const double c : {many_coverage, one_coverage}) EXPECT_NEAR(c, 1.0, 0.1) << "compute + exposed vs step";
}

// FSDP prefetches the next unit's all-gather under the current unit's compute; one unit without prefetch has
// nothing to compute while its collectives run.
TEST(TraceOverlap, OneFsdpUnitWithoutPrefetchOverlapsLessThanPrefetchedUnits) {
  auto units = run_traced("fsdp-units", with(kWide, {"--strategy", "fsdp-full", "--wrap", "children"}), 2, 12);
  auto one = run_traced("fsdp-one", with(kWide, {"--strategy", "fsdp-full", "--no-prefetch", "--wrap",
                                                 "params:1000000000"}), 2, 12);
  ASSERT_FALSE(units.ranks.empty() || one.ranks.empty());
  const auto [units_overlap, units_coverage] = overlap_and_coverage(units);
  const auto [one_overlap, one_coverage] = overlap_and_coverage(one);
  std::cout << "overlap: prefetched units " << units_overlap << ", one unit " << one_overlap
            << "; compute + exposed / step " << units_coverage << ", " << one_coverage << "\n";
  EXPECT_GT(units_overlap, one_overlap) << "prefetched units " << units_overlap << ", one unit " << one_overlap;
  for (const double c : {units_coverage, one_coverage}) EXPECT_NEAR(c, 1.0, 0.1) << "compute + exposed vs step";
}

TEST(TraceFlags, LocalHasNothingToTraceAndAnUnwritableDirectoryIsNamed) {
  auto local = t::run({GRADSYNC_BIN, "train", "--model", "mlp:4-4", "--data", "synthetic:8", "--global-batch", "4",
                       "--strategy", "local", "--trace", "/tmp/x"}, traced_run());
  EXPECT_FALSE(local.ok());
  EXPECT_NE(local.err.find("--trace records a data-parallel job's timeline"), std::string::npos) << local.err;
  auto unwritable = t::run({GRADSYNC_BIN, "train", "--model", "mlp:4-4", "--data", "synthetic:8", "--global-batch",
                            "4", "--world-size", "2", "--trace", "/proc/gradsync-trace"}, traced_run());
  EXPECT_FALSE(unwritable.ok());
  EXPECT_NE(unwritable.err.find("--trace /proc/gradsync-trace: cannot create or write the directory"),
            std::string::npos) << unwritable.err;
}
