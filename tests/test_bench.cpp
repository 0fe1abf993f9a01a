// `gradsync bench`: the JSON a user scripts against (both sides measured in one run, the ratio of their medians),
// `bench allreduce` on both backends, and flags refused with their name before anything runs. Speeds are not
// asserted here (this machine's times drift); docs/performance.md holds the measurements.
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "support/subprocess.h"

namespace t = gradsync::test;

namespace {

t::CommandOptions within(int seconds) {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(seconds);
  o.unset_env = t::launcher_variables({"GRADSYNC_BACKEND"});
  return o;
}

nlohmann::json json_of(const t::ProcessResult& r) { return nlohmann::json::parse(r.out.substr(r.out.find('{'))); }

void expect_side(const nlohmann::json& side, int64_t samples_per_step, const char* who, size_t runs = 2) {
  const auto& s = side.at("step_seconds");
  const double lo = s.at("min"), med = s.at("median"), hi = s.at("max");
  EXPECT_GT(lo, 0) << who;
  EXPECT_LE(lo, med) << who;
  EXPECT_LE(med, hi) << who;
  EXPECT_NEAR(side.at("samples_per_second").get<double>(), samples_per_step / med, 1e-6 * samples_per_step / med);
  EXPECT_GT(side.at("peak_memory_bytes_per_rank").get<int64_t>(), 1 << 20) << who;  // a whole process, > 1 MiB
  EXPECT_EQ(side.at("run_medians").size(), runs) << who;
}

}  // namespace

TEST(Bench, ComparesWithPyTorchInOneRunAndReportsTheRatioOfMedians) {
  for (const char* backend : {"gloo", "mpi"}) {
    auto r = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:32-64-10", "--per-rank-batch", "8", "--world-size", "2",
                     "--strategy", "ddp", "--backend", backend, "--steps", "4", "--warmup", "1", "--repeats", "2",
                     "--compare-pytorch", "--json"},
                    within(180));
    ASSERT_TRUE(r.ok()) << r.describe();
    auto j = json_of(r);
    EXPECT_EQ(j["config"]["backend"], backend);
    EXPECT_EQ(j["pytorch"]["recipe"], "ddp");
    expect_side(j.at("gradsync"), 16, "gradsync");
    expect_side(j.at("pytorch"), 16, "pytorch");
    const double ratio = j.at("ratio");
    EXPECT_DOUBLE_EQ(ratio, j["gradsync"]["step_seconds"]["median"].get<double>() /
                                j["pytorch"]["step_seconds"]["median"].get<double>());
    ASSERT_EQ(j.at("run_ratios").size(), 2u);
    for (size_t i = 0; i < 2; ++i) {  // pair i: gradsync's run i over PyTorch's run i
      EXPECT_DOUBLE_EQ(j.at("run_ratios").at(i).get<double>(), j["gradsync"]["run_medians"][i].get<double>() /
                                                                   j["pytorch"]["run_medians"][i].get<double>());
    }
    // Progress after each run: that run's medians, as in the JSON (printed to 0.01 ms).
    for (int i = 0; i < 2; ++i) {
      const auto line = fmt::format("[bench] run {}/2: median step gradsync {:.2f} ms, PyTorch {:.2f} ms;", i + 1,
                                    1e3 * j["gradsync"]["run_medians"][i].get<double>(),
                                    1e3 * j["pytorch"]["run_medians"][i].get<double>());
      EXPECT_NE(r.err.find(line), std::string::npos) << line << " not in:\n" << r.err;
    }
    // Both DDPs allreduce every gradient once: (32*64+64+64*10+10) floats. Gloo's bytes are socket writes.
    const double gradient_bytes = 4.0 * (32 * 64 + 64 + 64 * 10 + 10);
    EXPECT_GE(j["gradsync"]["bytes_sent_per_step"].get<double>(), gradient_bytes * 0.99) << backend;
    EXPECT_GE(j["pytorch"]["bytes_sent_per_step"].get<double>(), gradient_bytes * 0.99);
  }
}

// --floor: as many `--strategy local` processes as ranks, at once, pooled as one more side; what each side takes
// over it is the difference of the medians.
TEST(Bench, FloorIsALocalProcessPerRankAndEachSideIsMeasuredOverIt) {
  auto r = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:32-64-10", "--per-rank-batch", "8", "--world-size", "2",
                   "--strategy", "ddp", "--backend", "mpi", "--steps", "4", "--warmup", "1", "--repeats", "1",
                   "--compare-pytorch", "--floor", "--json"},
                  within(180));
  ASSERT_TRUE(r.ok()) << r.describe();
  auto j = json_of(r);
  expect_side(j.at("floor"), 16, "floor", 1);
  // Every process's measured steps are pooled: 2 processes x 4 steps (each also ran 1 step after them, unmeasured).
  EXPECT_EQ(j["floor"]["measured_steps"].get<int64_t>(), 2 * 4);
  EXPECT_EQ(j["gradsync"]["measured_steps"].get<int64_t>(), 4);
  EXPECT_EQ(j["pytorch"]["measured_steps"].get<int64_t>(), 4);
  EXPECT_EQ(j["floor"]["bytes_sent_per_step"].get<double>(), 0.0);  // local processes exchange nothing
  EXPECT_GT(j["gradsync"]["bytes_sent_per_step"].get<double>(), 0.0);
  const double floor = j["floor"]["step_seconds"]["median"];
  for (const char* side : {"gradsync", "pytorch"}) {
    EXPECT_DOUBLE_EQ(j["over_floor_seconds"][side].get<double>(), j[side]["step_seconds"]["median"].get<double>() -
                                                                     floor) << side;
  }
  auto text = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:32-64-10", "--per-rank-batch", "8", "--strategy", "ddp",
                      "--steps", "2", "--warmup", "1", "--repeats", "1", "--floor"},
                     within(120));
  ASSERT_TRUE(text.ok()) << text.describe();
  EXPECT_NE(text.out.find("\n  floor "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("over the floor (median): gradsync "), std::string::npos) << text.out;
}

// --wrap reaches train (a zero1 run in units of its Linear layers), and the JSON records it; the floor's local
// processes, which have no units, run without it.
TEST(Bench, WrapIsPassedToTrainAndRecorded) {
  auto r = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:16-32-4", "--per-rank-batch", "4", "--strategy", "zero1",
                   "--wrap", "type:Linear", "--steps", "2", "--warmup", "1", "--repeats", "1", "--floor", "--json"},
                  within(120));
  ASSERT_TRUE(r.ok()) << r.describe();
  auto j = json_of(r);
  EXPECT_EQ(j["config"]["wrap"], "type:Linear");
  EXPECT_GT(j["gradsync"]["step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["floor"]["step_seconds"]["median"].get<double>(), 0.0);
  // A well-formed spec naming no module of the model: only train, planning the units, can refuse it.
  auto missing = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:16-32-4", "--per-rank-batch", "4", "--strategy",
                         "zero1", "--wrap", "list:nosuch", "--steps", "2", "--warmup", "0", "--repeats", "1"},
                        within(120));
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("the gradsync run failed"), std::string::npos) << missing.describe();
  EXPECT_NE(missing.err.find("nosuch"), std::string::npos) << missing.describe();
}

// --trace: the traced job runs beside the untraced one, each run's trace kept, its breakdown in the JSON.
TEST(Bench, TraceRunsTracedAndUntracedJobsInterleaved) {
  const auto dir = t::make_temp_dir("gradsync-bench-trace-");
  auto r = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:16-32-4", "--per-rank-batch", "4", "--steps", "3",
                   "--warmup", "1", "--repeats", "2", "--trace", dir, "--json"},
                  within(120));
  ASSERT_TRUE(r.ok()) << r.describe();
  auto j = json_of(r);
  expect_side(j.at("traced"), 8, "traced");
  const auto& b = j["traced"].at("breakdown");
  EXPECT_GT(b.at("compute_seconds").get<double>(), 0.0);
  EXPECT_GT(b.at("communication_seconds").get<double>(), 0.0);
  EXPECT_GE(b.at("overlap").get<double>(), 0.0);
  EXPECT_LE(b.at("overlap").get<double>(), 1.0);
  EXPECT_NEAR(j.at("trace_ratio").get<double>(),
              j["traced"]["step_seconds"]["median"].get<double>() / j["gradsync"]["step_seconds"]["median"].get<double>(),
              1e-9);
  for (int run = 0; run < 2; ++run) {
    EXPECT_TRUE(std::ifstream(fmt::format("{}/run-{}/trace.json", dir, run)).good()) << run;
  }
}

TEST(Bench, EveryStrategyRunsAndAPlotIsWritten) {
  const std::string dir = t::make_temp_dir("gradsync-bench-test");
  for (const char* strategy : {"local", "fsdp-full", "zero1"}) {
    const std::string png = dir + "/" + strategy + ".png";
    auto r = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:16-32-4", "--per-rank-batch", "4", "--strategy",
                     strategy, "--steps", "3", "--warmup", "1", "--repeats", "1", "--plot", png},
                    within(120));
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("gradsync bench: mlp:16-32-4"), std::string::npos) << r.out;
    EXPECT_EQ(std::system(("test -s " + png).c_str()), 0) << png;
  }
}

// The convolutional and the residual (non-Sequential) models, on both sides: PyTorch builds the same modules, and
// against fsdp-full runs its fully_shard on the same units. A torch 1.x reference has no fully_shard: there the
// models meet PyTorch's DDP, and fsdp-full's comparison must stop with an error that says why.
TEST(Bench, CnnAndResRunOnBothSidesAndFsdpFullMeetsFullyShard) {
  const bool has_fully_shard = TORCH_VERSION_MAJOR >= 2;
  for (const char* model : {"cnn:2-3-10", "res:32-16-2-4"}) {
    std::vector<std::string> argv{GRADSYNC_BIN, "bench", "--model", model, "--per-rank-batch", "4", "--world-size",
                                  "2", "--steps", "2", "--warmup", "1", "--repeats", "2", "--compare-pytorch", "--json"};
    if (has_fully_shard) argv.insert(argv.end(), {"--strategy", "fsdp-full", "--wrap", "children"});
    auto r = t::run(argv, within(120));
    ASSERT_TRUE(r.ok()) << r.describe();
    auto j = json_of(r);
    EXPECT_EQ(j["config"]["model"], model);
    EXPECT_EQ(j["pytorch"]["recipe"], has_fully_shard ? "fully_shard" : "ddp");
    expect_side(j.at("gradsync"), 8, "gradsync");
    expect_side(j.at("pytorch"), 8, "pytorch");
    EXPECT_GT(j["pytorch"]["bytes_sent_per_step"].get<double>(), 0.0) << "PyTorch's side moved nothing";
  }
  if (!has_fully_shard) {
    auto r = t::run({GRADSYNC_BIN, "bench", "--model", "mlp:8-8-4", "--per-rank-batch", "4", "--world-size", "2",
                     "--strategy", "fsdp-full", "--steps", "1", "--warmup", "0", "--repeats", "1", "--compare-pytorch"},
                    within(120));
    EXPECT_NE(r.exit_code, 0) << r.describe();
    EXPECT_NE(r.err.find("fully_shard on CPU needs torch 2.x"), std::string::npos) << r.describe();
  }
}

TEST(Bench, AllreduceReportsBusBandwidthNextToTheRawEngine) {
  for (const char* backend : {"gloo", "mpi"}) {
    auto r = t::run({GRADSYNC_BIN, "bench", "allreduce", "--bytes", "4K,256K", "--world-size", "2", "--backend",
                     backend, "--iterations", "5", "--warmup", "1", "--json"},
                    within(120));
    ASSERT_TRUE(r.ok()) << r.describe();
    auto j = json_of(r);
    ASSERT_EQ(j["sizes"].size(), 2u);
    EXPECT_EQ(j["sizes"][0]["bytes"], 4096);
    EXPECT_EQ(j["sizes"][1]["bytes"], 262144);
    for (const auto& row : j["sizes"]) {
      const double algbw = row["algbw_gbps"], busbw = row["busbw_gbps"];
      EXPECT_DOUBLE_EQ(busbw, algbw * 2.0 * (2 - 1) / 2);  // nccl-tests' busbw for allreduce
      EXPECT_GT(row["raw_seconds"].get<double>(), 0);
      EXPECT_DOUBLE_EQ(row["bucket_busbw_gbps"].get<double>(),
                       row["bytes"].get<double>() / row["bucket_seconds"].get<double>() / 1e9 * 2.0 * (2 - 1) / 2);
    }
  }
}

TEST(Bench, BadFlagsAreNamedBeforeAnythingRuns) {
  auto bytes = t::run({GRADSYNC_BIN, "bench", "allreduce", "--bytes", "3"}, within(30));
  EXPECT_NE(bytes.exit_code, 0);
  EXPECT_NE(bytes.err.find("--bytes: '3' is not a size from 4 bytes to 2G"), std::string::npos) << bytes.describe();
  auto strategy = t::run({GRADSYNC_BIN, "bench", "--strategy", "fsdp"}, within(30));
  EXPECT_NE(strategy.exit_code, 0);
  EXPECT_NE(strategy.err.find("--strategy"), std::string::npos) << strategy.describe();
  auto backend = t::run({GRADSYNC_BIN, "bench", "--backend", "nccl"}, within(30));
  EXPECT_NE(backend.exit_code, 0);
  EXPECT_NE(backend.err.find("--backend"), std::string::npos) << backend.describe();
  auto wrap = t::run({GRADSYNC_BIN, "bench", "--strategy", "fsdp-full", "--wrap", "every:Linear"}, within(30));
  EXPECT_NE(wrap.exit_code, 0);
  EXPECT_NE(wrap.err.find("--wrap"), std::string::npos) << wrap.describe();
  EXPECT_EQ(wrap.err.find("[bench] run"), std::string::npos) << "refused only after a run started: " << wrap.describe();
  // fully_shard has no units grouped by size: against it params:N is refused, naming what it takes.
  auto grouped = t::run({GRADSYNC_BIN, "bench", "--strategy", "fsdp-full", "--wrap", "params:1000",
                         "--compare-pytorch"}, within(30));
  EXPECT_NE(grouped.exit_code, 0);
  EXPECT_NE(grouped.err.find("--wrap params:1000: PyTorch's fully_shard"), std::string::npos) << grouped.describe();
  EXPECT_EQ(grouped.err.find("[bench] run"), std::string::npos) << grouped.describe();
  auto floor = t::run({GRADSYNC_BIN, "bench", "--strategy", "local", "--floor"}, within(30));
  EXPECT_NE(floor.exit_code, 0);
  EXPECT_NE(floor.err.find("--floor runs a local process per rank"), std::string::npos) << floor.describe();
  EXPECT_EQ(floor.err.find("[bench] run"), std::string::npos) << "refused only after a run started: "
                                                               << floor.describe();
  auto ddp_wrap = t::run({GRADSYNC_BIN, "bench", "--strategy", "ddp", "--wrap", "children"}, within(30));
  EXPECT_NE(ddp_wrap.err.find("--wrap applies to --strategy fsdp-full"), std::string::npos) << ddp_wrap.describe();
}
