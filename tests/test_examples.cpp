// The example programs run as a user would run them (build/examples/*, under `gradsync launch`), and their own
// checks decide: token_classification exits 0 only when Reduction::GlobalMean gives the per-token mean over the
// concatenated batch and Reduction::Mean with per-micro-batch token means does not.
#include <string>

#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace {

namespace t = gradsync::test;

const std::string kExamples = std::string(GRADSYNC_BUILD_DIR) + "/examples";

t::CommandOptions options() {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(120);
  o.unset_env = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GRADSYNC_STORE_FILE", "MASTER_ADDR",
                 "MASTER_PORT"};
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

}  // namespace
