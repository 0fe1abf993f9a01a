// `gradsync lab --quick --json` end to end (tools/lab/): the real CLI on Fashion-MNIST, starting its own DDP
// ranks. The test asserts what the lab measured, not only that it ran: DDP's gradient is the single-process mean
// at every world size and (N >= 2) not the sum; K backward passes sum; the loss is a per-sample mean; uneven
// per-rank batches give the mean of the per-rank means with Reduction::Mean and the mean over all samples with
// Reduction::GlobalMean; FSDP (full shard) applies the mean at every world size; the claims table grades the
// statements about sum or mean as the figures say; the plots are real PNG files.
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/subprocess.h"

namespace {

namespace fs = std::filesystem;
namespace t = gradsync::test;

// The parts of one lab run's JSON, checked one by one (one lab run: ctest runs every TEST in its own process).
void check_ddp(const nlohmann::json& json) {
  const double tol = json.at("tolerance").get<double>();
  EXPECT_EQ(tol, 1e-5);
  std::set<int> seen;
  for (const auto& d : json.at("ddp")) {
    const int n = d.at("world_size").get<int>();
    seen.insert(n);
    SCOPED_TRACE("world size " + std::to_string(n));
    EXPECT_EQ(d.at("verdict"), "mean");
    EXPECT_LT(d.at("max_abs_diff_to_mean").get<double>(), tol);
    EXPECT_LT(d.at("max_abs_diff_between_ranks").get<double>(), tol);
    const auto ranks = d.at("ranks");
    ASSERT_EQ(ranks.size(), static_cast<size_t>(n));
    if (n == 1) {
      // One rank: the sum of one gradient is that gradient; the lab must say so, not claim to reject the sum.
      EXPECT_EQ(d.at("note"), "N=1: sum = mean");
      EXPECT_EQ(d.at("max_abs_diff_to_sum").get<double>(), d.at("max_abs_diff_to_mean").get<double>());
      continue;
    }
    EXPECT_GT(d.at("max_abs_diff_to_sum").get<double>(), tol);
    // The sum is N times the mean: the probe element shows it.
    EXPECT_NEAR(d.at("probe").at("sum").get<double>(), n * d.at("probe").at("mean").get<double>(), 1e-6);
    for (const auto& r : ranks) {
      // Before synchronisation each rank holds its own shard's gradient, visibly different from the mean...
      EXPECT_GT(r.at("before_sync").at("max_abs_diff_to_mean").get<double>(), tol);
      EXPECT_LT(r.at("before_sync").at("max_abs_diff_to_own_shard").get<double>(), tol);
      // ...and after it, the mean.
      EXPECT_LT(r.at("after_sync").at("max_abs_diff_to_mean").get<double>(), tol);
      EXPECT_EQ(r.at("samples").get<int64_t>(), d.at("global_batch").get<int64_t>() / n);
    }
  }
  EXPECT_EQ(seen, (std::set<int>{1, 2, 4}));
}

void check_accumulation(const nlohmann::json& json) {
  const auto& a = json.at("accumulation");
  const double k = a.at("micro_batches").get<double>();
  EXPECT_EQ(k, 4);
  EXPECT_EQ(a.at("raw_verdict"), "sum");
  EXPECT_NEAR(a.at("raw_ratio").get<double>(), k, 1e-4);
  EXPECT_LT(a.at("raw_max_abs_diff_to_sum").get<double>(), 1e-5);
  EXPECT_GT(a.at("raw_max_abs_diff_to_mean").get<double>(), 1e-5);
  EXPECT_EQ(a.at("scaled_verdict"), "mean");
  EXPECT_LT(a.at("scaled_max_abs_diff_to_mean").get<double>(), 1e-6);
}

void check_loss(const nlohmann::json& json) {
  const auto& l = json.at("loss_vs_batch");
  EXPECT_EQ(l.at("verdict"), "per-sample mean");
  std::set<int64_t> batches;
  for (const auto& run : l.at("runs")) {
    const auto b = run.at("batch").get<int64_t>();
    batches.insert(b);
    // Cross-entropy over 10 classes from a fresh model: about ln 10 = 2.30 per sample, at every B.
    EXPECT_NEAR(run.at("step0_loss").get<double>(), 2.30, 0.1) << "B = " << b;
    EXPECT_NEAR(run.at("sum_over_mean").get<double>(), static_cast<double>(b), 0.01 * static_cast<double>(b));
    EXPECT_EQ(run.at("losses").size(), l.at("steps").get<size_t>());
    EXPECT_LT(run.at("final_loss").get<double>(), run.at("step0_loss").get<double>()) << "training did not train";
  }
  EXPECT_EQ(batches, (std::set<int64_t>{256, 1024, 4096}));
}

void check_uneven(const nlohmann::json& json) {
  ASSERT_EQ(json.at("uneven").size(), 2u);  // world sizes 2 and 4
  for (const auto& u : json.at("uneven")) {
    EXPECT_EQ(u.at("verdict"), "mean of per-rank means");
    EXPECT_LT(u.at("max_abs_diff_to_mean_of_rank_means").get<double>(), 1e-5);
    EXPECT_GT(u.at("max_abs_diff_to_sample_mean").get<double>(), 1e-5);
    // Reduction::GlobalMean on the same shares: the mean over all samples, every rank dividing by the whole batch.
    const auto& g = u.at("global_mean");
    EXPECT_EQ(g.at("verdict"), "sample mean");
    EXPECT_LT(g.at("max_abs_diff_to_sample_mean").get<double>(), 1e-6);
    EXPECT_GT(g.at("max_abs_diff_to_mean_of_rank_means").get<double>(), 1e-5);
    EXPECT_LT(g.at("max_abs_diff_between_ranks").get<double>(), 1e-5);
    int64_t shares = 0;
    for (const auto& n : u.at("samples")) shares += n.get<int64_t>();
    EXPECT_EQ(g.at("total_items").get<int64_t>(), shares);
  }
}

void check_sharded(const nlohmann::json& json) {
  const double tol = json.at("tolerance").get<double>();
  std::set<int> seen;
  for (const auto& s : json.at("sharded")) {
    const int n = s.at("world_size").get<int>();
    seen.insert(n);
    SCOPED_TRACE("FSDP world size " + std::to_string(n));
    EXPECT_EQ(s.at("strategy"), "full_shard");
    EXPECT_EQ(s.at("verdict"), "mean");
    EXPECT_LT(s.at("max_abs_diff_to_mean").get<double>(), tol);
    EXPECT_LT(s.at("max_abs_diff_between_ranks").get<double>(), tol);
    if (n == 1) {
      EXPECT_EQ(s.at("note"), "N=1: sum = mean");
    } else {
      EXPECT_GT(s.at("max_abs_diff_to_sum").get<double>(), tol);
    }
  }
  EXPECT_EQ(seen, (std::set<int>{1, 2, 4}));
}

// The claims table: every statement graded, and the ones the question is about decided by figures that lie orders
// of magnitude apart, on both sides of the tolerance, at world sizes 2 and 4.
void check_claims(const nlohmann::json& json) {
  const double tol = json.at("tolerance").get<double>();
  const std::map<std::string, std::string> expected{
      {"ddp-averages", "true"}, {"ddp-sums", "false"}, {"loss-sums", "false"}, {"weighted-by-batch", "false"},
      {"no-division", "false"}, {"deepspeed-divides", "true only when"}, {"fsdp-averages", "true"},
      {"more-samples-count-more", "true only when"}, {"summed-loss-sums", "false"}, {"token-mean-over-k", "false"},
      {"ddp-token-mean", "false"}, {"global-mean-tokens", "true"}, {"ddp-bn-averaged", "false"},
      {"sync-bn-weighted", "true"}};
  const bool tokens = !json.at("tokens").empty();  // the token claims are graded only with the tokens experiment
  const bool batch_norm = !json.at("batch_norm").is_null();  // and the BatchNorm ones with theirs
  std::set<std::string> seen;
  for (const auto& c : json.at("claims")) {
    const auto id = c.at("id").get<std::string>();
    SCOPED_TRACE("claim " + id);
    seen.insert(id);
    ASSERT_TRUE(expected.count(id));
    if ((!tokens && id.find("token") != std::string::npos) || (!batch_norm && id.find("-bn-") != std::string::npos)) {
      EXPECT_EQ(c.at("verdict").get<std::string>().rfind("inconclusive (no measurement", 0), 0u);
      continue;
    }
    const auto verdict = c.at("verdict").get<std::string>();
    EXPECT_EQ(verdict.rfind(expected.at(id), 0), 0u) << verdict << "; " << c.at("measured");
    EXPECT_FALSE(c.at("claim").get<std::string>().empty());
    EXPECT_FALSE(c.at("claim_ko").get<std::string>().empty());
    EXPECT_FALSE(c.at("source").get<std::string>().empty());
    const double to_claim = c.at("deviation_from_claim").get<double>();
    const double to_alternative = c.at("deviation_from_alternative").get<double>();
    const bool refuted = verdict == "false";
    const double near = refuted ? to_alternative : to_claim, far = refuted ? to_claim : to_alternative;
    EXPECT_LT(near, tol);
    EXPECT_GT(far, tol);
    EXPECT_GE(far, 100 * near) << "the hypotheses are not orders of magnitude apart";
  }
  EXPECT_EQ(seen.size(), expected.size());
  for (const auto& c : json.at("claims")) {
    const auto id = c.at("id").get<std::string>();
    if (id != "ddp-averages" && id != "ddp-sums" && id != "weighted-by-batch") continue;
    const auto measured = c.at("measured").get<std::string>();
    EXPECT_NE(measured.find("N=2"), std::string::npos) << id << ": " << measured;
    EXPECT_NE(measured.find("N=4"), std::string::npos) << id << ": " << measured;
  }
}

// The tokens experiment (a gpt on fortunes, float64): GlobalMean is one process's token mean to rounding, the mean of
// per-micro-batch token means is off it by exactly what its weights predict, at each (N, K); over the curves' Adam
// steps GlobalMean stays on the reference and the mean of means does not.
void check_tokens(const nlohmann::json& json, const std::string& dir) {
  const auto& rows = json.at("tokens");
  ASSERT_EQ(rows.size(), 3u);
  const std::vector<std::pair<int, int>> shapes{{1, 4}, {2, 2}, {4, 1}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    SCOPED_TRACE(r.dump());
    EXPECT_EQ(r.at("world_size").get<int>(), shapes[i].first);
    EXPECT_EQ(r.at("accumulate").get<int>(), shapes[i].second);
    EXPECT_LT(r.at("global_mean_rel_diff").get<double>(), 1e-12);
    const double measured = r.at("mean_of_means_rel_diff").get<double>();
    EXPECT_GT(measured, 1e-3);
    EXPECT_NEAR(measured, r.at("mean_of_means_predicted_rel_diff").get<double>(), 1e-9 * measured);
    EXPECT_LT(r.at("mean_of_means_to_prediction").get<double>(), 1e-12);
  }
  const auto& curves = json.at("tokens_experiment").at("curves");
  EXPECT_LT(curves.at("global_mean_final_rel_diff").get<double>(), 1e-8);
  EXPECT_GT(curves.at("mean_of_means_final_rel_diff").get<double>(), 1e-3);
  EXPECT_EQ(curves.at("reference").size(), curves.at("steps").get<size_t>());
  EXPECT_TRUE(fs::exists(dir + "/tokens.png"));
  EXPECT_TRUE(fs::exists(dir + "/tokens.csv"));
}

// The BatchNorm experiment (mlp-bn, float64): under DDP rank 0 saved its own running statistics, not the ranks'
// average; SyncBatchNorm's are the count-weighted ones of the union, not the plain mean of the ranks'.
void check_batch_norm(const nlohmann::json& json) {
  const auto& rows = json.at("batch_norm").at("rows");
  ASSERT_EQ(rows.size(), 2u);  // world sizes 2 and 4
  for (const auto& r : rows) {
    SCOPED_TRACE(r.dump());
    const auto n = r.at("world_size").get<size_t>();
    EXPECT_EQ(r.at("equal_samples").size(), n);
    EXPECT_EQ(r.at("uneven_samples").size(), n);
    EXPECT_NE(r.at("uneven_samples").front(), r.at("uneven_samples").back());
    EXPECT_LT(r.at("ddp_to_rank0").get<double>(), 1e-12);
    EXPECT_GT(r.at("ddp_to_averaged").get<double>(), 1e-4);
    EXPECT_LT(r.at("sync_to_weighted").get<double>(), 1e-12);
    EXPECT_GT(r.at("sync_to_plain_mean").get<double>(), 1e-4);
  }
}

void check_files(const nlohmann::json& json, const std::string& dir) {
  auto report = [&](const std::string& name) { return dir + "/" + name; };
  ASSERT_TRUE(json.at("plots").at("rendered").get<bool>()) << json.at("plots").dump();
  for (const char* png : {"loss_vs_batch.png", "ddp_deviation.png", "ddp_ranks.png", "claims.png"}) {
    std::ifstream in(report(png), std::ios::binary);
    ASSERT_TRUE(in) << png;
    std::string head(8, '\0');
    in.read(head.data(), 8);
    EXPECT_EQ(head, std::string("\x89PNG\r\n\x1a\n", 8)) << png;
  }
  for (const char* file : {"report.md", "results.json", "loss_curves.csv", "ddp.csv", "ddp_ranks.csv", "plots.gp"}) {
    EXPECT_TRUE(fs::exists(report(file))) << file;
  }
  std::ifstream md(report("report.md"));
  std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("## Answer"), std::string::npos);
  EXPECT_NE(text.find("## 답변"), std::string::npos);
  // The claims table in both languages, and its plot.
  EXPECT_NE(text.find("| claim | source | verdict |"), std::string::npos);
  EXPECT_NE(text.find("| 주장 | 출처 | 판정 |"), std::string::npos);
  EXPECT_NE(text.find("DDP and FSDP sum the per-process gradients. | answer 2 | **false**"), std::string::npos);
  EXPECT_NE(text.find("| **거짓** |"), std::string::npos);
  EXPECT_NE(text.find("![every claim"), std::string::npos);
  EXPECT_NE(text.find("## 7. BatchNorm statistics"), std::string::npos);
  EXPECT_NE(text.find("SyncBatchNorm weights each process by its batch size. | gradsync | **true**"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(report("results.json"))).at("ddp"), json.at("ddp"));
}

TEST(LabCli, QuickRunMeasuresPerSampleMeanSummedAccumulationAndDdpMean) {
  const auto dir = t::make_temp_dir("gradsync-test-lab-");
  t::CommandOptions options;
  options.timeout = std::chrono::seconds(240);
  const auto out = dir + "/report";
  auto run = t::run({GRADSYNC_BIN, "lab", "--quick", "--json", "--out", out}, options);
  ASSERT_TRUE(run.ok()) << run.describe();
  const auto json = nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(json.is_discarded()) << "stdout is not one JSON document:\n" << run.out.substr(0, 2000);
  EXPECT_NE(run.err.find("[lab] DDP, world size 4"), std::string::npos) << "no progress on stderr:\n" << run.err;
  {
    SCOPED_TRACE("loss vs batch size");
    check_loss(json);
  }
  {
    SCOPED_TRACE("accumulation");
    check_accumulation(json);
  }
  {
    SCOPED_TRACE("DDP");
    check_ddp(json);
  }
  {
    SCOPED_TRACE("uneven");
    check_uneven(json);
  }
  {
    SCOPED_TRACE("sharded");
    check_sharded(json);
  }
  {
    SCOPED_TRACE("claims");
    check_claims(json);
  }
  {
    SCOPED_TRACE("tokens");
    check_tokens(json, out);
  }
  {
    SCOPED_TRACE("BatchNorm");
    check_batch_norm(json);
  }
  {
    SCOPED_TRACE("files");
    check_files(json, out);
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
}

// The same experiments on the residual model (not a Sequential: FSDP runs its blocks in their Sequential's slots;
// the CNN's parity with PyTorch under every strategy is tests/test_sharded_parity.cpp's):
// every measurement still tells the sum from the mean (--no-tokens, --no-batch-norm: those experiments train their
// own models).
TEST(LabCli, QuickRunOnResReachesTheSameAnswer) {
  for (const char* model : {"res:784-16-2-10"}) {
    const auto dir = t::make_temp_dir("gradsync-test-lab-model-");
    t::CommandOptions options;
    options.timeout = std::chrono::seconds(240);
    auto run = t::run({GRADSYNC_BIN, "lab", "--quick", "--json", "--no-tokens", "--no-batch-norm", "--model", model,
                       "--out", dir + "/report"}, options);
    ASSERT_TRUE(run.ok()) << model << ": " << run.describe();
    EXPECT_NE(run.err.find(std::string("model ") + model), std::string::npos) << run.err;
    const auto json = nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(json.is_discarded()) << run.out.substr(0, 2000);
    SCOPED_TRACE(model);
    check_sharded(json);
    check_claims(json);
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }
  auto bad = t::run({GRADSYNC_BIN, "lab", "--quick", "--model", "mlp:10-5-3"});
  EXPECT_EQ(bad.exit_code, 1) << bad.describe();
  EXPECT_NE(bad.err.find("needs 784 inputs and 10 outputs (it has 10 and 3)"), std::string::npos) << bad.err;
}

TEST(LabCli, RejectsBadWorldSizes) {
  auto r = t::run({GRADSYNC_BIN, "lab", "--quick", "--world-sizes", "0,2"});
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.err.find("--world-sizes: 0 is out of range"), std::string::npos) << r.err;
}

TEST(LabCli, RankSubcommandIsHidden) {
  auto r = t::run({GRADSYNC_BIN, "--help"});
  EXPECT_NE(r.out.find("lab"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("lab-rank"), std::string::npos) << r.out;
}

}  // namespace
