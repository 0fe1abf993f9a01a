// The progress rank 0 of `gradsync train` reports while it trains: plain lines at the stated cadence when stderr
// is not a terminal, each figure checked against the --log of the same run; on a pseudo-terminal one line rewritten
// in place, followed by the summary.
#include <cmath>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/subprocess.h"
#include "train/progress.h"

namespace t = gradsync::test;

namespace {

const std::string kPython = GRADSYNC_PYTHON;

t::CommandOptions quick() {
  return t::job_options(std::chrono::seconds(120), {"GRADSYNC_PROGRESS"});
}

std::vector<nlohmann::json> read_log(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

struct Line {
  int64_t step, total, epoch;
  double loss, rate;
  std::string unit;
  std::vector<double> peaks_mib;
};

// The progress lines in `text` (plain ones start with "gradsync train: step", terminal ones with "\rstep").
std::vector<Line> progress_lines(const std::string& text, const std::string& lead) {
  const std::regex line(lead + R"(step (\d+)/(\d+)  epoch (\d+)  loss ([0-9.]+)  (\d+) (samples|tokens)/s  )"
                        R"(step [0-9.]+ ms  ETA [0-9hms]+  peak RSS ([0-9|]+) MiB)");
  std::vector<Line> found;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    Line l{std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3]), std::stod(m[4]), std::stod(m[5]), m[6], {}};
    std::string peaks = m[7];
    for (size_t at = 0; at <= peaks.size();) {
      const auto bar = std::min(peaks.find('|', at), peaks.size());
      l.peaks_mib.push_back(std::stod(peaks.substr(at, bar - at)));
      at = bar + 1;
    }
    found.push_back(l);
  }
  return found;
}

// Each line's loss is the logged step's, its rate the logged samples (or tokens) over the logged seconds so far.
void expect_matches_log(const std::vector<Line>& lines, const std::vector<nlohmann::json>& log, int ranks) {
  for (const auto& l : lines) {
    ASSERT_LE(l.step, static_cast<int64_t>(log.size()));
    const auto& record = log[static_cast<size_t>(l.step - 1)];
    EXPECT_EQ(record.at("step").get<int64_t>(), l.step - 1);
    EXPECT_EQ(record.at("epoch").get<int64_t>(), l.epoch);
    EXPECT_NEAR(record.at("loss").get<double>(), l.loss, 5e-5) << "step " << l.step;
    double items = 0, seconds = 0;
    for (int64_t i = 0; i < l.step; ++i) {
      items += log[static_cast<size_t>(i)].at("samples").get<double>();
      seconds += log[static_cast<size_t>(i)].at("seconds").get<double>();
    }
    EXPECT_NEAR(l.rate, items / seconds, 0.5 + 1e-6 * items / seconds) << "step " << l.step;
    ASSERT_EQ(l.peaks_mib.size(), static_cast<size_t>(ranks)) << "one peak per rank";
    for (const double p : l.peaks_mib) EXPECT_GT(p, 1.0) << "a process holding libtorch uses more than 1 MiB";
  }
}

std::vector<int64_t> steps_of(const std::vector<Line>& lines) {
  std::vector<int64_t> steps;
  for (const auto& l : lines) steps.push_back(l.step);
  return steps;
}

}  // namespace

TEST(Progress, TheDefaultCadenceGivesAboutTwentyLinesARun) {
  EXPECT_EQ(gradsync::cli::progress_cadence(0, 600), 30);
  EXPECT_EQ(gradsync::cli::progress_cadence(0, 601), 31);  // 20 lines, the last one after step 601
  EXPECT_EQ(gradsync::cli::progress_cadence(0, 7), 1);
  EXPECT_EQ(gradsync::cli::progress_cadence(0, 0), 1);
  EXPECT_EQ(gradsync::cli::progress_cadence(4, 600), 4);
}

// Not a terminal: a line after every 3rd step and after the last; the same figures as the log; --quiet: none.
TEST(Progress, OffATerminalALineEveryNStepsAndAfterTheLastMatchingTheLog) {
  const auto dir = t::make_temp_dir("gradsync-progress-");
  const std::vector<std::string> argv{GRADSYNC_BIN, "train", "--model", "mlp:8-16-4", "--data", "synthetic:120",
                                      "--global-batch", "12", "--world-size", "2", "--steps", "10", "--log-every", "3",
                                      "--log", dir + "/log"};
  auto r = t::run(argv, quick());
  ASSERT_TRUE(r.ok()) << r.describe();
  const auto lines = progress_lines(r.err, "gradsync train: ");
  EXPECT_EQ(steps_of(lines), (std::vector<int64_t>{3, 6, 9, 10})) << r.err;
  for (const auto& l : lines) EXPECT_EQ(l.unit, "samples");
  for (const auto& l : lines) EXPECT_EQ(l.total, 10);
  expect_matches_log(lines, read_log(dir + "/log"), 2);
  EXPECT_NE(r.out.find("gradsync train: 10 steps"), std::string::npos) << "the summary stays: " << r.out;

  // The default: about twenty lines (45 steps, one every 3rd); the epochs count on (synthetic:120 / 12 = 10 a epoch).
  auto all = argv;
  all[all.size() - 5] = "45";
  all.erase(all.end() - 4, all.end() - 2);  // no --log-every
  auto d = t::run(all, quick());
  ASSERT_TRUE(d.ok()) << d.describe();
  const auto default_lines = progress_lines(d.err, "gradsync train: ");
  std::vector<int64_t> expected;
  for (int64_t s = 3; s <= 45; s += 3) expected.push_back(s);
  EXPECT_EQ(steps_of(default_lines), expected) << d.err;
  expect_matches_log(default_lines, read_log(dir + "/log"), 2);
  EXPECT_EQ(default_lines.back().epoch, 4);

  auto quiet = argv;
  quiet.push_back("--quiet");
  auto q = t::run(quiet, quick());
  ASSERT_TRUE(q.ok()) << q.describe();
  EXPECT_EQ(q.err.find("step "), std::string::npos) << q.err;
  EXPECT_EQ(q.out, "");
}

// Token data counts valid tokens: under global-mean the log's samples are the step's valid tokens.
TEST(Progress, TokenDataReportsTokensPerSecond) {
  const auto dir = t::make_temp_dir("gradsync-progress-tokens-");
  auto r = t::run({GRADSYNC_BIN, "train", "--model", "gpt:256-32-16-1-2", "--data", "fortunes", "--global-batch",
                   "8", "--world-size", "2", "--steps", "4", "--log-every", "2", "--reduction", "global-mean",
                   "--optimizer", "adam", "--log", dir + "/log"},
                  quick());
  ASSERT_TRUE(r.ok()) << r.describe();
  const auto lines = progress_lines(r.err, "gradsync train: ");
  EXPECT_EQ(steps_of(lines), (std::vector<int64_t>{2, 4})) << r.err;
  for (const auto& l : lines) EXPECT_EQ(l.unit, "tokens");
  expect_matches_log(lines, read_log(dir + "/log"), 2);
}

// A pseudo-terminal (Python's pty, standing in for a person's terminal): every step rewrites one line in place;
// no plain lines; the summary follows on a line of its own.
TEST(Progress, OnATerminalOneLineIsRewrittenAndTheSummaryFollows) {
  const auto dir = t::make_temp_dir("gradsync-progress-tty-");
  const std::string under_pty =
      "import os, pty, sys\n"
      "pid, fd = pty.fork()\n"
      "if pid == 0:\n"
      "    os.execv(sys.argv[1], sys.argv[1:])\n"
      "out = b''\n"
      "while True:\n"
      "    try:\n"
      "        chunk = os.read(fd, 65536)\n"
      "    except OSError:\n"
      "        break\n"
      "    if not chunk:\n"
      "        break\n"
      "    out += chunk\n"
      "_, status = os.waitpid(pid, 0)\n"
      "sys.stdout.buffer.write(out)\n"
      "sys.exit(os.waitstatus_to_exitcode(status))\n";
  auto r = t::run({kPython, "-c", under_pty, GRADSYNC_BIN, "train", "--model", "mlp:8-16-4", "--data",
                   "synthetic:120", "--global-batch", "12", "--world-size", "2", "--steps", "6", "--log-every", "4",
                   "--log", dir + "/log"},
                  quick());
  ASSERT_TRUE(r.ok()) << r.describe();
  const auto lines = progress_lines(r.out, "\r");
  EXPECT_EQ(steps_of(lines), (std::vector<int64_t>{1, 2, 3, 4, 5, 6})) << "every step, not every 4th: " << r.out;
  expect_matches_log(lines, read_log(dir + "/log"), 2);
  EXPECT_EQ(r.out.find("gradsync train: step"), std::string::npos) << "no plain lines on a terminal: " << r.out;
  EXPECT_NE(r.out.find("\x1b[K"), std::string::npos) << "a shorter line clears the rest of a longer one";
  const auto last = r.out.rfind("\rstep 6/6");
  const auto summary = r.out.find("gradsync train: 6 steps");
  ASSERT_NE(summary, std::string::npos) << r.out;
  EXPECT_LT(last, summary);
  const auto between = r.out.substr(last, summary - last);
  EXPECT_NE(between.find('\n'), std::string::npos) << "the summary starts on its own line: " << r.out;
  EXPECT_EQ(between.find("\rstep"), 0u);
  EXPECT_EQ(between.find("\rstep", 1), std::string::npos);
}

TEST(Progress, LogEveryIsAPositiveStepCount) {
  auto r = t::run({GRADSYNC_BIN, "train", "--model", "mlp:8-16-4", "--data", "synthetic:12", "--global-batch", "12",
                   "--log-every", "0"},
                  quick());
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.err.find("--log-every: Value 0 not in range 1 to"), std::string::npos) << r.describe();
}
