// Tests for include/gradsync/join.h: ranks holding 3, 5 and 7 batches train under Join and end with the same
// parameters as real PyTorch's DDP under torch.distributed.algorithms.join.Join (tests/reference/join_reference.py),
// for both divide_by_initial_world_size choices; every rank ends with identical parameters.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/data.h"
#include "data/models.h"
#include "gradsync/ddp.h"
#include "gradsync/join.h"
#include "gradsync/runtime.h"
#include "gradsync/state_dict.h"
#include "support/parity.h"
#include "support/subprocess.h"
#include "support/worker.h"

namespace {

namespace t = gradsync::test;
namespace parity = gradsync::test::parity;

// The same loop as join_reference.py: rank r takes global batches off_r .. off_r + count_r - 1 of B rows each.
// args: model data init counts(comma) batch lr divide(1|0) out(with {rank})
GRADSYNC_WORKER(join_rank) {
  torch::set_num_threads(1);
  auto world = gradsync::init({std::chrono::seconds(60), std::nullopt, std::nullopt});
  const int rank = world->rank();
  std::vector<int64_t> counts;
  for (size_t at = 0; at <= args[3].size();) {
    const size_t comma = std::min(args[3].find(',', at), args[3].size());
    counts.push_back(std::stoll(args[3].substr(at, comma - at)));
    at = comma + 1;
  }
  const int64_t batch = std::stoll(args[4]);
  auto model = gradsync::cli::make_model(args[0]);
  gradsync::load_into(*model, gradsync::load_state_dict(args[2]));
  const auto spec = gradsync::cli::parse_model_spec(args[0]);
  const auto data = gradsync::cli::load_dataset_file(args[1], spec.input_size(), spec.output_size(),
                                                     gradsync::cli::LossKind::CrossEntropy);
  gradsync::DistributedDataParallel ddp(model, world);
  torch::optim::SGD optimizer(ddp.parameters(), torch::optim::SGDOptions(std::stod(args[5])));
  gradsync::Join join(ddp, gradsync::JoinOptions().divide_by_initial_world_size(args[6] == "1"));
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += counts[static_cast<size_t>(r)];
  for (int64_t j = 0; j < counts[static_cast<size_t>(rank)]; ++j) {
    const int64_t g = offset + j;
    join.notify();
    ddp.zero_grad();
    auto loss = torch::cross_entropy_loss(ddp.forward(data.inputs.narrow(0, g * batch, batch)),
                                          data.targets.narrow(0, g * batch, batch));
    loss.backward();
    optimizer.step();
  }
  const int64_t shadowed = join.join();
  int64_t longest = 0;
  for (auto c : counts) longest = std::max(longest, c);
  WORKER_CHECK(shadowed == longest - counts[static_cast<size_t>(rank)], "rank {} shadowed {} steps", rank, shadowed);
  std::string out = args[7];
  out.replace(out.find("{rank}"), 6, std::to_string(rank));
  gradsync::save_state_dict(ddp.state_dict(), out);
  return 0;
}

t::CommandOptions options() {
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(180);
  o.env = {{"OMP_NUM_THREADS", "1"}};
  return o;
}

struct JoinCase {
  std::string model = "mlp:6-5-4";
  int samples = 60;
  std::string counts = "3,5,7";
  int batch = 4;
  std::string lr = "0.1";
  std::string loss = "ce";
};

void expect_equal_to_pytorch(const std::string& divide) {
  const JoinCase c;
  const std::string dir = t::make_temp_dir("gradsync-join-");
  ASSERT_TRUE(parity::make_case(c, "7", dir, options()).ok());
  const std::vector<std::string> common{"--model", c.model, "--data", dir + "/data.pt", "--init-state",
                                        dir + "/init.pt", "--batches", c.counts, "--batch-size",
                                        std::to_string(c.batch), "--lr", c.lr, "--divide-by-initial-world-size",
                                        divide, "--save-state", dir + "/pytorch.pt"};
  std::vector<std::string> py{GRADSYNC_BIN, "launch", "-n", "3", "--", parity::kPython,
                              parity::kReference + "/join_reference.py"};
  py.insert(py.end(), common.begin(), common.end());
  const auto theirs = t::run(py, options());
  ASSERT_TRUE(theirs.ok()) << theirs.describe();

  const auto ranks = t::run_ranks(3, t::worker_argv("join_rank", {c.model, dir + "/data.pt", dir + "/init.pt",
                                                                   c.counts, std::to_string(c.batch), c.lr, divide,
                                                                   dir + "/gradsync-{rank}.pt"}),
                                  options());
  for (size_t r = 0; r < ranks.size(); ++r) ASSERT_TRUE(ranks[r].ok()) << "rank " << r << ": " << ranks[r].describe();
  for (int r = 0; r < 3; ++r) {
    const auto verdict = t::run({parity::kPython, parity::kReference + "/compare_states.py",
                                 fmt::format("{}/gradsync-{}.pt", dir, r), dir + "/pytorch.pt", "--rtol", "1e-6"},
                                options());
    EXPECT_TRUE(verdict.ok()) << "rank " << r << " vs PyTorch: " << verdict.describe();
  }
}

TEST(Join, UnevenRanksEqualPyTorchsJoinDividingByTheInitialWorldSize) { expect_equal_to_pytorch("1"); }
TEST(Join, UnevenRanksEqualPyTorchsJoinDividingByTheRanksStillTraining) { expect_equal_to_pytorch("0"); }

}  // namespace
