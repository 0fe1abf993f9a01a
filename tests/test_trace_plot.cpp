// `gradsync trace plot`: the trace-event JSON of `gradsync train --trace` read into lanes (by rank, then thread, named
// from the metadata events) and spans in milliseconds, a file that is no trace refused by what is wrong with it, and
// the PNG the command writes (gnuplot; skipped where it is not installed), by default next to the trace.
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "gradsync/error.h"
#include "launch/spawn.h"
#include "support/error_of.h"
#include "support/subprocess.h"
#include "trace/trace.h"

namespace t = gradsync::test;
namespace cli = gradsync::cli;

namespace {

// Two ranks of two threads each, as trace_json() writes them: spans first (rank 1's before rank 0's here, so the
// lanes' order is the table's own), then the names; one event of another phase ("i") to be ignored.
const char* const kTrace = R"({"traceEvents": [
  {"ph": "X", "name": "forward", "cat": "compute", "ts": 1500.0, "dur": 250.5, "pid": 1, "tid": 0, "args": {}},
  {"ph": "X", "name": "allreduce bucket 0", "cat": "collective", "ts": 2000, "dur": 1000, "pid": 1, "tid": 1,
   "args": {"label": "bucket 0", "bytes": 4096}},
  {"ph": "X", "name": "step 0", "cat": "phase", "ts": 0, "dur": 4000, "pid": 0, "tid": 0, "args": {"step": 0}},
  {"ph": "X", "name": "backward", "cat": "compute", "ts": 1000, "dur": 1500, "pid": 0, "tid": 0, "args": {}},
  {"ph": "X", "name": "wait bucket 0", "cat": "wait", "ts": 2500, "dur": 500, "pid": 0, "tid": 0, "args": {}},
  {"ph": "X", "name": "allreduce bucket 0", "cat": "collective", "ts": 2100, "dur": 800, "pid": 0, "tid": 1,
   "args": {"label": "bucket 0"}},
  {"ph": "i", "name": "marker", "ts": 10, "pid": 0, "tid": 0, "s": "t"},
  {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank 1"}},
  {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "compute"}},
  {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "comm world"}},
  {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
  {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "compute"}},
  {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "comm world"}}],
 "displayTimeUnit": "ms", "otherData": {"ranks": []}})";

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

bool has_gnuplot() { return cli::find_executable("gnuplot", cli::current_environment()).has_value(); }

std::string first_bytes(const std::string& path, size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes(n, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(n));
  bytes.resize(static_cast<size_t>(in.gcount()));
  return bytes;
}

const std::string kPngSignature("\x89PNG\r\n\x1a\n", 8);

t::CommandOptions quick() {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

}  // namespace

TEST(TracePlot, LanesAreOrderedByRankThenThreadAndNamedFromTheMetadata) {
  const auto table = cli::read_trace_table(kTrace);
  ASSERT_EQ(table.lanes.size(), 4u);
  const char* const names[] = {"rank 0 compute", "rank 0 comm world", "rank 1 compute", "rank 1 comm world"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(table.lanes[i].pid, i / 2) << i;
    EXPECT_EQ(table.lanes[i].tid, i % 2) << i;
    EXPECT_EQ(table.lanes[i].name, names[i]) << i;
  }
  ASSERT_EQ(table.spans.size(), 6u);  // the "i" event is no span
  const auto& forward = table.spans[0];  // the file's order
  EXPECT_EQ(forward.lane, 2);
  EXPECT_EQ(forward.name, "forward");
  EXPECT_EQ(forward.category, "compute");
  EXPECT_DOUBLE_EQ(forward.begin_ms, 1.5);  // microseconds in the file
  EXPECT_DOUBLE_EQ(forward.end_ms, 1.7505);
  EXPECT_EQ(table.spans[1].lane, 3);
  EXPECT_DOUBLE_EQ(table.spans[1].end_ms, 3.0);
  EXPECT_EQ(table.spans[2].category, "phase");
  EXPECT_EQ(table.spans[2].lane, 0);
  EXPECT_EQ(table.spans[5].lane, 1);

  // Without metadata: "rank R tid T"; a bare array of events is read as Chrome reads it.
  const auto bare = cli::read_trace_table(R"([{"ph": "X", "name": "a", "ts": 1, "dur": 2, "pid": 3, "tid": 7}])");
  ASSERT_EQ(bare.lanes.size(), 1u);
  EXPECT_EQ(bare.lanes[0].name, "rank 3 tid 7");
  EXPECT_EQ(bare.spans.at(0).category, "other");  // no "cat"
}

TEST(TracePlot, TextThatIsNoTraceIsRefusedByWhatIsWrong) {
  auto error = [](const std::string& text) {
    return t::error_of<gradsync::ConfigError>([&] { cli::read_trace_table(text); });
  };
  EXPECT_NE(error("step 0: 12 ms").find("not JSON"), std::string::npos);
  EXPECT_NE(error(R"({"events": []})").find("no \"traceEvents\" array"), std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": {"ph": "X"}})").find("no \"traceEvents\" array"), std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": [3]})").find("traceEvents[0] is number"), std::string::npos);
  const std::string no_dur = error(
      R"({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
                          {"ph": "X", "name": "allreduce", "ts": 5, "pid": 0, "tid": 1}]})");
  EXPECT_NE(no_dur.find("traceEvents[1] (\"allreduce\")"), std::string::npos) << no_dur;
  EXPECT_NE(no_dur.find("without a numeric \"dur\""), std::string::npos) << no_dur;
  EXPECT_NE(error(R"({"traceEvents": [{"ph": "X", "name": "f", "dur": 5, "pid": 0, "tid": 0}]})")
                .find("without a numeric \"ts\""), std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": [{"ph": "X", "name": "f", "ts": 1, "dur": 5, "pid": "0", "tid": 0}]})")
                .find("without an integer \"pid\""), std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": [{"ph": "X", "name": "f", "ts": 1, "dur": 5, "pid": 0}]})")
                .find("without an integer \"tid\""), std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": [{"ph": "X", "name": "f", "ts": 1, "dur": -5, "pid": 0, "tid": 0}]})")
                .find("negative \"dur\""), std::string::npos);

  // The command says the same, prefixed with its name, and fails; nothing is written.
  cli::TempDir dir("gradsync-trace-plot-test-");
  write_file(dir.file("bad.json"), R"({"events": []})");
  auto r = t::run({GRADSYNC_BIN, "trace", "plot", dir.file("bad.json"), "-o", dir.file("bad.png")}, quick());
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_EQ(r.err.rfind("gradsync trace plot: " + dir.file("bad.json") + ": no \"traceEvents\" array", 0), 0u)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir.file("bad.png")));
}

TEST(TracePlot, WritesAPng) {
  if (!has_gnuplot()) GTEST_SKIP() << "gnuplot is not installed";
  cli::TempDir dir("gradsync-trace-plot-test-");
  write_file(dir.file("trace.json"), kTrace);
  const std::string png = dir.file("timeline.png");
  auto r = t::run({GRADSYNC_BIN, "trace", "plot", dir.file("trace.json"), "-o", png}, quick());
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("gradsync trace plot: wrote " + png + " (4 lanes, 6 spans)"), std::string::npos) << r.out;
  EXPECT_EQ(first_bytes(png, 8), kPngSignature);
  EXPECT_FALSE(std::filesystem::exists(dir.file("trace.png")));  // -o given: nothing next to the trace
}

TEST(TracePlot, WithoutOutputThePngGoesNextToTheTrace) {
  EXPECT_EQ(cli::trace_png_path("run/trace.json"), "run/trace.png");
  EXPECT_EQ(cli::trace_png_path("run/trace-rank-1.json"), "run/trace-rank-1.png");
  EXPECT_EQ(cli::trace_png_path("trace"), "trace.png");
  EXPECT_EQ(cli::trace_png_path("odd.png"), "odd.png.png");  // never the input itself
  if (!has_gnuplot()) GTEST_SKIP() << "gnuplot is not installed";
  cli::TempDir dir("gradsync-trace-plot-test-");
  write_file(dir.file("trace-rank-0.json"), kTrace);
  auto r = t::run({GRADSYNC_BIN, "trace", "plot", dir.file("trace-rank-0.json")}, quick());
  ASSERT_TRUE(r.ok()) << r.describe();
  const std::string png = dir.file("trace-rank-0.png");
  EXPECT_NE(r.out.find("wrote " + png + " (4 lanes, 6 spans)"), std::string::npos) << r.out;
  EXPECT_EQ(first_bytes(png, 8), kPngSignature);
}
