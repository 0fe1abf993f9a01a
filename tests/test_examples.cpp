// The example programs run as a user would run them (build/examples/*, under `gradsync launch`); every output the
// README quotes is checked against what the program prints; and their own checks decide: token_classification exits 0 only when Reduction::GlobalMean gives the per-token mean over the
// concatenated batch and Reduction::Mean with per-micro-batch token means does not.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace {

namespace t = gradsync::test;

const std::string kExamples = std::string(GRADSYNC_BUILD_DIR) + "/examples";

t::CommandOptions options() {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(120);
  o.unset_env = t::launcher_variables({"LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  return o;
}

void expect_global_mean_verdict(const t::ProcessResult& r) {
  EXPECT_NE(r.out.find("verdict: GlobalMean is the per-token mean over every rank and micro-batch"),
            std::string::npos) << r.describe();
  EXPECT_EQ(r.out.find("verdict: WRONG"), std::string::npos) << r.describe();
}

TEST(Examples, TokenClassificationUnderTheLauncherWithThreeRanks) {
  auto r = t::run({GRADSYNC_BIN, "launch", "-n", "3", "--", kExamples + "/token_classification"}, options());
  ASSERT_FALSE(r.timed_out) << r.describe();
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  expect_global_mean_verdict(r);
  EXPECT_NE(r.out.find("[rank0]: 3 ranks, 2 micro-batches each"), std::string::npos) << r.describe();
  for (const char* rank : {"rank 0:", "rank 1:", "rank 2:"}) EXPECT_NE(r.out.find(rank), std::string::npos) << rank;
}

TEST(Examples, TokenClassificationInOneProcess) {
  auto r = t::run({kExamples + "/token_classification"}, options());
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  expect_global_mean_verdict(r);
  EXPECT_NE(r.out.find("1 rank, 2 micro-batches each"), std::string::npos) << r.describe();
}

// Your own GPT (blocks in a Sequential, its loop unchanged) under FSDP with a unit per block and GlobalMean over
// ragged token counts: the program compares itself with one process on the global batch and exits 1 if it differs.
TEST(Examples, GptUnderFsdpWithBlocksAsUnitsIsOneProcessOnTheGlobalBatch) {
  auto r = t::run({GRADSYNC_BIN, "launch", "-n", "3", "--", kExamples + "/gpt"}, options());
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("[rank0]: 3 ranks, units: blocks.0 blocks.1 (root)"), std::string::npos) << r.describe();
  EXPECT_NE(r.out.find("equals one process on the global batch: yes"), std::string::npos) << r.describe();
}

}  // namespace

namespace {

// Every "`build/gradsync launch -n N -- build/examples/NAME [ARGS]` prints:" in the README, with the fenced block
// that follows it: the program's output must contain each quoted line, so the README stays true.
struct Quote {
  std::vector<std::string> argv;
  std::vector<std::string> lines;
};

std::vector<Quote> readme_quotes() {
  std::ifstream in(std::string(GRADSYNC_SOURCE_DIR) + "/README.md");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::regex quote(R"(`build/gradsync (launch -n \d+ -- build/examples/[^`]+)`,? prints:\s*```\n([^`]*)```)");
  std::vector<Quote> out;
  for (std::sregex_iterator it(text.begin(), text.end(), quote), end; it != end; ++it) {
    Quote q;
    std::istringstream words((*it)[1].str());
    q.argv.push_back(GRADSYNC_BIN);
    for (std::string w; words >> w;) {
      if (w.rfind("build/", 0) == 0) w = std::string(GRADSYNC_BUILD_DIR) + w.substr(5);
      q.argv.push_back(w);
    }
    std::istringstream lines((*it)[2].str());
    for (std::string l; std::getline(lines, l);) {
      if (!l.empty()) q.lines.push_back(l);
    }
    out.push_back(q);
  }
  return out;
}

// ddp_fashion_mnist reads the unpacked IDX files: the README's `fmnist` directory, made here as it says.
std::string unpacked_fashion_mnist() {
  const std::string dir = t::make_temp_dir("gradsync-fmnist-");
  const auto r = t::run({"sh", "-c", "for f in /usr/share/datasets/fashion-mnist/*.gz; do gunzip -c \"$f\" > \"$0/$(basename \"$f\" .gz)\"; done", dir});
  EXPECT_TRUE(r.ok()) << r.describe();
  return dir;
}

TEST(Examples, EveryOutputTheReadmeQuotesIsWhatTheProgramPrints) {
  const auto quotes = readme_quotes();
  ASSERT_GE(quotes.size(), 5u) << "sum_vs_mean, ddp_fashion_mnist, fsdp_layers, accumulation and gpt are quoted";
  const std::string fmnist = unpacked_fashion_mnist();
  for (auto q : quotes) {
    for (auto& a : q.argv) {
      if (a == "fmnist") a = fmnist;
    }
    auto opts = options();
    opts.timeout = std::chrono::seconds(240);
    const auto r = t::run(q.argv, opts);
    ASSERT_TRUE(r.ok()) << q.argv[5] << ": " << r.describe();
    std::set<std::string> printed;
    std::istringstream out(r.out);
    for (std::string l; std::getline(out, l);) printed.insert(l);
    for (const auto& line : q.lines) EXPECT_TRUE(printed.count(line)) << q.argv.back() << " did not print: " << line << "\n" << r.out;
  }
  std::filesystem::remove_all(fmnist);
}

}  // namespace
