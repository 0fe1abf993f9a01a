// `gradsync train --checkpoint-dir/--resume/--max-restarts` end to end: a run crashed (or killed from outside at
// random points, during steps and during checkpoint writes) and resumed ends bit-identical to an uninterrupted one
// under every strategy; a checkpoint of N ranks loads at M; another configuration is refused naming the flags; the
// launcher restarts a failed group R times, then reports the first failure. The Faults* tests are ctest's `faults`.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gradsync/checkpoint.h"
#include "gradsync/state_dict.h"
#include "support/fault_record.h"
#include "support/subprocess.h"

namespace fs = std::filesystem;
namespace t = gradsync::test;

namespace {

t::CommandOptions options() {
  return t::job_options(std::chrono::seconds(120), {"GRADSYNC_BACKEND"});
}

std::vector<std::string> train_argv(std::vector<std::string> args) {
  std::vector<std::string> argv{GRADSYNC_BIN, "train", "--quiet", "--timeout", "30"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

t::ProcessResult train(std::vector<std::string> args) { return t::run(train_argv(std::move(args)), options()); }

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The log without what differs from run to run (time, memory, bytes).
std::vector<nlohmann::json> steps_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    for (const char* key : {"seconds", "memory_peak", "rss_peak", "sent_bytes"}) j.erase(key);
    out.push_back(j);
  }
  return out;
}

// "" when both state files hold bit-identical tensors under the same keys, else the first difference.
std::string bit_difference(const std::string& a_path, const std::string& b_path) {
  const auto a = gradsync::load_state_dict(a_path), b = gradsync::load_state_dict(b_path);
  if (a.size() != b.size()) return "different key counts";
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first) return "key " + a[i].first + " vs " + b[i].first;
    if (!torch::equal(a[i].second, b[i].second)) {
      return fmt::format("{}: max |diff| {}", a[i].first, (a[i].second - b[i].second).abs().max().item<double>());
    }
  }
  return "";
}

struct Config {
  std::string strategy;
  int world;
  std::string optimizer;  // "sgd" runs with momentum 0.9
  int accumulate;
};

std::vector<std::string> config_flags(const Config& c, int64_t steps, const std::string& data = "synthetic:90") {
  std::vector<std::string> f{"--model", "res:8-16-2-4", "--data", data, "--global-batch", "12",
                             "--strategy", c.strategy, "--accumulate", std::to_string(c.accumulate), "--steps",
                             std::to_string(steps), "--optimizer", c.optimizer};
  if (c.strategy != "local") f = plus(f, {"--world-size", std::to_string(c.world)});
  if (c.optimizer == "sgd") f = plus(f, {"--momentum", "0.9"});
  if (c.strategy.rfind("fsdp", 0) == 0 || c.strategy.rfind("hsdp", 0) == 0) {
    f = plus(f, {"--wrap", "children"});  // several units, each checkpointed
  }
  if (c.strategy.rfind("hsdp", 0) == 0 && c.world > 1) f = plus(f, {"--replicas", "2"});
  return f;
}



}  // namespace

TEST(FaultsResume, EveryStrategyCrashedAtARandomStepResumesBitForBit) {
  const auto dir = t::make_temp_dir("gradsync-resume-");
  std::mt19937 random(7);
  const std::vector<Config> configs{{"ddp", 3, "sgd", 2},          {"fsdp-full", 4, "adam", 3},
                                    {"fsdp-grad-op", 2, "adam", 1}, {"fsdp-no-shard", 3, "sgd", 2},
                                    {"zero1", 3, "adam", 2},        {"local", 1, "adam", 2},
                                    {"hsdp", 4, "sgd", 3}};
  int exact = 0, clean = 0;
  for (const auto& c : configs) {
    const int64_t steps = 11, crash = 1 + static_cast<int64_t>(random() % 10), every = 1 + random() % 3;
    SCOPED_TRACE(fmt::format("{} N={} {} K={}: crash before step {}, checkpoint every {}", c.strategy, c.world,
                             c.optimizer, c.accumulate, crash, every));
    const std::string tag = dir + "/" + c.strategy;
    const auto ref = train(plus(config_flags(c, steps), {"--save-state", tag + "-ref.pt", "--log", tag + "-ref.log"}));
    ASSERT_TRUE(ref.ok()) << ref.describe();
    const auto run = train(plus(config_flags(c, steps),
                                {"--save-state", tag + ".pt", "--log", tag + ".log", "--checkpoint-dir", tag + "-ck",
                                 "--checkpoint-every", std::to_string(every), "--max-restarts", "1", "--inject-fault",
                                 fmt::format("crash@{}", crash)}));
    ASSERT_TRUE(run.ok()) << run.describe();
    EXPECT_NE(run.err.find("was killed by signal 9"), std::string::npos) << run.err;
    EXPECT_NE(run.err.find("restarting the group (1 of 1)"), std::string::npos) << run.err;
    EXPECT_EQ(bit_difference(tag + "-ref.pt", tag + ".pt"), "");
    EXPECT_EQ(steps_of(tag + "-ref.log"), steps_of(tag + ".log"));
    exact += bit_difference(tag + "-ref.pt", tag + ".pt").empty();
    clean += run.err.find("rank " + std::to_string(c.world - 1) + " (pid ") != std::string::npos;  // the crashed one
  }
  fmt::print("faults: {} crashes injected, bit-exact resumes {}/{}\n", configs.size(), exact, configs.size());
  const int n = static_cast<int>(configs.size());
  t::record_faults({n, clean, 0, 0, 0, n, exact, 0});
  fs::remove_all(dir);
}

// Kills a random rank of a running job at a random moment (inside a step, between micro-batches, or while rank 0
// writes a checkpoint: one is written after every step), again and again, resuming each time.
TEST(FaultsResume, RandomKillsDuringStepsAndCheckpointWritesThenResumeIsBitIdentical) {
  const auto dir = t::make_temp_dir("gradsync-kill-");
  const Config c{"ddp", 2, "adam", 3};
  const int64_t steps = 60;
  ASSERT_TRUE(train(plus(config_flags(c, steps), {"--save-state", dir + "/ref.pt", "--log", dir + "/ref.log"})).ok());
  const auto flags = plus(config_flags(c, steps), {"--save-state", dir + "/run.pt", "--log", dir + "/run.log",
                                                   "--checkpoint-dir", dir + "/ck", "--checkpoint-every", "1",
                                                   "--resume"});
  std::mt19937 random(11);
  int kills = 0, clean = 0, orphans = 0;
  for (int attempt = 0; attempt < 8; ++attempt) {
    auto job = t::Process::start(train_argv(flags), options());
    // Wait until the log reaches a random step beyond where this attempt starts, then a random few ms more.
    const size_t done = steps_of(dir + "/run.log").size();
    const size_t target = attempt == 7 ? steps + 1 : done + 1 + random() % 12;
    while (!job.poll() && t::line_count(dir + "/run.log") < target) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto ranks = t::children_of(job.pid());
    std::this_thread::sleep_for(std::chrono::microseconds(random() % 20000));
    if (!ranks.empty()) ::kill(ranks[random() % ranks.size()], SIGKILL);
    const auto r = job.wait();
    ASSERT_FALSE(r.timed_out) << r.describe();
    for (pid_t pid : ranks) orphans += t::process_alive(pid);
    if (r.ok()) break;
    ++kills;
    clean += r.err.find("was killed by signal 9") != std::string::npos;
    gradsync::Checkpoints checkpoints(dir + "/ck", nullptr);  // what the next attempt will resume from
    if (auto latest = checkpoints.latest()) {
      EXPECT_EQ(latest->meta.count("step"), 1u);
    }
  }
  ASSERT_TRUE(fs::exists(dir + "/run.pt")) << "the job did not finish";
  EXPECT_EQ(bit_difference(dir + "/ref.pt", dir + "/run.pt"), "");
  EXPECT_EQ(steps_of(dir + "/ref.log"), steps_of(dir + "/run.log"));
  EXPECT_EQ(orphans, 0);
  EXPECT_EQ(clean, kills);
  EXPECT_GE(kills, 4) << "the kills must land while the job runs";
  const bool exact = bit_difference(dir + "/ref.pt", dir + "/run.pt").empty();
  fmt::print("faults: {} random kills, {} reported naming the rank and signal, {} orphans, 0 hangs, resume "
             "bit-exact: {}\n", kills, clean, orphans, exact);
  t::record_faults({kills, clean, 0, orphans, 0, 1, exact ? 1 : 0, 0});
  fs::remove_all(dir);
}

TEST(FaultsResume, MaxRestartsGivesUpAfterRFailuresReportingTheFirst) {
  const auto dir = t::make_temp_dir("gradsync-restarts-");
  const auto r = train(plus(config_flags({"ddp", 2, "sgd", 1}, 6),
                            {"--checkpoint-dir", dir + "/ck", "--checkpoint-every", "2", "--max-restarts", "2",
                             "--inject-fault", "crash-always@3"}));
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.describe();
  EXPECT_NE(r.err.find("restarting the group (2 of 2)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("giving up after 2 restart(s); the first failure: rank 1 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by signal 9 (Killed)"), std::string::npos) << r.err;
  // Steps lost <= the interval: every attempt resumed from step 2, the checkpoint before the crash.
  EXPECT_EQ(gradsync::Checkpoints(dir + "/ck", nullptr).latest()->step, 2);
  const bool named = r.err.find("the first failure: rank 1 (pid ") != std::string::npos;
  t::record_faults({3, named ? 3 : 0, r.timed_out ? 1 : 0, 0, 0, 0, 0, 0});
  fs::remove_all(dir);
}

// Saved at 4 ranks under FSDP, loaded at 2 (FSDP) and at 3 (ZeRO-1): the state is the checkpoint's exactly, and
// training on agrees with the uninterrupted 4-rank run: the same global batches (96 samples: no rank pads at 2, 3
// or 4 ranks, see Note [Resuming]), summed in another order.
TEST(FaultsResume, ACheckpointOfNRanksLoadsAtMRanksUnderAnyStrategy) {
  const auto dir = t::make_temp_dir("gradsync-reshard-");
  const Config four{"fsdp-full", 4, "adam", 1};
  const std::string data = "synthetic:96";
  ASSERT_TRUE(train(plus(config_flags(four, 10, data), {"--save-state", dir + "/ref.pt"})).ok());
  ASSERT_TRUE(train(plus(config_flags(four, 5, data), {"--checkpoint-dir", dir + "/ck"})).ok());
  const std::string saved = dir + "/ck/step-000000000005";
  const auto two = train(plus(config_flags({"fsdp-full", 2, "adam", 1}, 5, data),
                              {"--checkpoint-dir", dir + "/ck", "--resume", "--save-state", dir + "/two.pt",
                               "--save-optim", dir + "/two-optim.pt"}));
  ASSERT_TRUE(two.ok()) << two.describe();
  EXPECT_EQ(bit_difference(saved + "/model.pt", dir + "/two.pt"), "");
  const auto py = t::run({GRADSYNC_PYTHON, "-c",
                          "import sys, torch\n"
                          "a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])\n"
                          "for k in ('model', 'rng', 'layout'): torch.load(f'{sys.argv[3]}/{k}.pt', weights_only=True)\n"
                          "same = all(torch.equal(a['state'][n][k], b['state'][n][k]) for n in a['state'] for k in a['state'][n])\n"
                          "sys.exit(0 if same and a['state'].keys() == b['state'].keys() else 1)\n",
                          saved + "/optim.pt", dir + "/two-optim.pt", saved});
  EXPECT_TRUE(py.ok()) << py.describe();
  const auto three = train(plus(config_flags({"zero1", 3, "adam", 1}, 10, data),
                                {"--checkpoint-dir", dir + "/ck", "--resume", "--save-state", dir + "/three.pt"}));
  ASSERT_TRUE(three.ok()) << three.describe();
  const auto a = gradsync::load_state_dict(dir + "/ref.pt"), b = gradsync::load_state_dict(dir + "/three.pt");
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LT((a[i].second - b[i].second).abs().max().item<double>(), 1e-5) << a[i].first;
  }
  t::record_faults({});  // no fault injected, none of its runs hung (each is asserted): it adds to no figure
  fs::remove_all(dir);
}

// A checkpoint saved under hsdp (2 replicas of 2) holds the whole model and optimizer state: it resumes bit for bit
// under hsdp, and to rounding under fsdp-full, ddp and hsdp-grad-op at another world size (2 replicas of 1).
TEST(FaultsResume, AnHsdpCheckpointResumesUnderHsdpFsdpDdpAndAnotherWorldSize) {
  const auto dir = t::make_temp_dir("gradsync-hsdp-resume-");
  const Config hsdp{"hsdp", 4, "adam", 3};
  const std::string data = "synthetic:96";
  ASSERT_TRUE(train(plus(config_flags(hsdp, 8, data), {"--save-state", dir + "/ref.pt"})).ok());
  const auto first = train(plus(config_flags(hsdp, 4, data), {"--checkpoint-dir", dir + "/ck"}));
  ASSERT_TRUE(first.ok()) << first.describe();
  for (const Config& c : {hsdp, Config{"fsdp-full", 4, "adam", 3}, Config{"ddp", 4, "adam", 3},
                          Config{"hsdp-grad-op", 2, "adam", 3}}) {
    SCOPED_TRACE(fmt::format("resumed under {} at N = {}", c.strategy, c.world));
    const std::string ck = dir + "/ck-" + c.strategy;
    fs::copy(dir + "/ck", ck, fs::copy_options::recursive);
    const std::string out = dir + "/" + c.strategy + ".pt";
    const auto resumed = train(plus(config_flags(c, 8, data), {"--checkpoint-dir", ck, "--resume", "--save-state", out,
                                                               "--log", out + ".log"}));
    ASSERT_TRUE(resumed.ok()) << resumed.describe();
    EXPECT_EQ(steps_of(out + ".log").size(), 4u) << "steps 5 to 8 only: the run resumed";
    if (c.strategy == "hsdp") {
      EXPECT_EQ(bit_difference(dir + "/ref.pt", out), "");
      continue;
    }
    const auto a = gradsync::load_state_dict(dir + "/ref.pt"), b = gradsync::load_state_dict(out);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_LT((a[i].second - b[i].second).abs().max().item<double>(), 1e-5) << a[i].first;
    }
  }
  t::record_faults({});  // no fault injected, none of its runs hung (each is asserted): it adds to no figure
  fs::remove_all(dir);
}

// After its first step DDP has not rebuilt its buckets yet; the rebuild due at the next forward (from rank 0's
// gradient order) is part of the checkpoint, or three ranks would sum in another order at step 1.
TEST(Resume, DdpOfThreeRanksResumedAfterItsFirstStepIsBitExact) {
  const auto dir = t::make_temp_dir("gradsync-resume-ddp-");
  const Config c{"ddp", 3, "sgd", 1};
  ASSERT_TRUE(train(plus(config_flags(c, 6), {"--save-state", dir + "/ref.pt"})).ok());
  ASSERT_TRUE(train(plus(config_flags(c, 1), {"--checkpoint-dir", dir + "/ck"})).ok());
  ASSERT_TRUE(train(plus(config_flags(c, 6), {"--checkpoint-dir", dir + "/ck", "--resume", "--save-state",
                                              dir + "/run.pt"})).ok());
  EXPECT_EQ(bit_difference(dir + "/ref.pt", dir + "/run.pt"), "");
  const auto steps_past = train(plus(config_flags(c, 3), {"--checkpoint-dir", dir + "/ck", "--resume"}));
  EXPECT_NE(steps_past.err.find("the checkpoint is at step 6, past the 3 step(s) this run trains"), std::string::npos)
      << steps_past.describe();
  const auto fresh = train(plus(config_flags(c, 3), {"--checkpoint-dir", dir + "/ck"}));
  EXPECT_NE(fresh.err.find("already holds checkpoints of an earlier run (up to step 6); add --resume"),
            std::string::npos) << fresh.describe();
  fs::remove_all(dir);
}

TEST(Resume, AnotherConfigurationIsRefusedNamingEveryFlagWithBothValues) {
  const auto dir = t::make_temp_dir("gradsync-resume-cfg-");
  const Config c{"ddp", 2, "sgd", 1};
  ASSERT_TRUE(train(plus(config_flags(c, 2), {"--checkpoint-dir", dir})).ok());
  const auto r = train(plus(config_flags(c, 4), {"--checkpoint-dir", dir, "--resume", "--lr", "0.05", "--seed", "3"}));
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.err.find("--lr was '0.01', is '0.05'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--seed was '0', is '3'"), std::string::npos) << r.err;
  const auto no_dir = train(plus(config_flags(c, 2), {"--resume"}));
  EXPECT_NE(no_dir.err.find("--resume needs --checkpoint-dir DIR"), std::string::npos) << no_dir.describe();
  std::ofstream(dir + "/file") << "x";
  const auto not_dir = train(plus(config_flags(c, 2), {"--checkpoint-dir", dir + "/file/sub"}));
  EXPECT_NE(not_dir.err.find("is not a directory"), std::string::npos) << not_dir.describe();
  fs::remove_all(dir);
}

TEST(Launch, MaxRestartsStartsTheGroupAgainWithTheAttemptNumber) {
  const auto r = t::run({GRADSYNC_BIN, "launch", "-n", "2", "--max-restarts", "3", "--", "/bin/sh", "-c",
                         "test \"$TORCHELASTIC_RESTART_COUNT\" = 2 && test \"$TORCHELASTIC_MAX_RESTARTS\" = 3"},
                        options());
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.err.find("restarting the group (2 of 3)"), std::string::npos) << r.err;
  const auto bad = t::run({GRADSYNC_BIN, "launch", "--max-restarts", "-1", "--", "true"}, options());
  EXPECT_NE(bad.err.find("--max-restarts must be an integer from 0 to 1000, got '-1'"), std::string::npos)
      << bad.describe();
}
