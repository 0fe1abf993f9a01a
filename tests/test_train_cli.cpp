// `gradsync train` end to end: flag validation with clear messages, Python-compatible state files, the JSONL
// log, and DDP over N self-started ranks equal to one process on the global batch.
#include <fstream>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace t = gradsync::test;

namespace {

const std::string kPython = GRADSYNC_PYTHON;

t::CommandOptions quick() {
  return t::job_options(std::chrono::seconds(120));
}

t::ProcessResult train(std::vector<std::string> args) {
  std::vector<std::string> argv{GRADSYNC_BIN, "train"};
  argv.insert(argv.end(), args.begin(), args.end());
  return t::run(argv, quick());
}

void expect_error(const std::vector<std::string>& args, const std::string& fragment) {
  auto r = train(args);
  EXPECT_FALSE(r.ok()) << "expected failure for " << fragment;
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.err.find(fragment), std::string::npos) << r.describe();
}

}  // namespace

TEST(TrainCli, BadFlagsAreRejectedWithTheValueAndWhatIsAllowed) {
  const std::vector<std::string> base{"--model", "mlp:8-4-3", "--data", "synthetic:64"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  expect_error(with({"--global-batch", "10", "--world-size", "3"}),
               "--global-batch 10 is not divisible by world size 3 x accumulate 1 = 3");
  expect_error(with({"--global-batch", "16", "--accumulate", "3"}), "choose B as a multiple of 3");
  expect_error(with({"--global-batch", "16", "--optimizer", "adam", "--momentum", "0.9"}),
               "--momentum applies to sgd only");
  expect_error(with({"--global-batch", "16", "--strategy", "local", "--world-size", "2"}),
               "--strategy local runs one process");
  // Choices and ranges are CLI11 validators: the option, the value and what is allowed.
  expect_error(with({"--global-batch", "16", "--optimizer", "rmsprop"}), "--optimizer: rmsprop not in {sgd,adam}");
  expect_error(with({"--global-batch", "16", "--reduction", "median"}), "--reduction: median not in {mean,sum,global-mean}");
  expect_error(with({"--global-batch", "16", "--loss", "hinge"}), "--loss: hinge not in {ce,mse}");
  expect_error(with({"--global-batch", "16", "--world-size", "1025"}), "--world-size: Value 1025 not in range 1 to 1024");
  expect_error(with({"--global-batch", "16", "--accumulate", "0"}), "--accumulate: Value 0 not in range 1 to");
  // Integers past int64 are refused, not clamped or wrapped.
  expect_error(with({"--global-batch", "16", "--steps", "99999999999999999999"}),
               "--steps: Value 99999999999999999999 not in range 0 to");
  expect_error(with({"--global-batch", "16", "--seed", "-1"}), "--seed: Value -1 not in range 0 to");
  // Numbers must be finite (inf and nan would train to nan or break every deadline), files usable up front.
  expect_error(with({"--global-batch", "16", "--lr", "inf"}), "--lr inf is invalid; expected a finite number > 0");
  expect_error(with({"--global-batch", "16", "--weight-decay", "inf"}),
               "--weight-decay inf is invalid; expected a finite number >= 0");
  expect_error(with({"--global-batch", "16", "--timeout", "nan"}), "--timeout nan is invalid");
  expect_error(with({"--global-batch", "16", "--init-state", "/tmp"}), "cannot open state file '/tmp': it is a directory");
  expect_error(with({"--global-batch", "16", "--save-state", "/nonexistent-dir/x.pt"}),
               "--save-state /nonexistent-dir/x.pt: its directory '/nonexistent-dir' is not writable");
  expect_error(with({"--global-batch", "16", "--steps", "2", "--epochs", "1"}), "excludes");
  expect_error({"--model", "mlp:8-x-3", "--data", "synthetic:64", "--global-batch", "16"}, "'x' is not a positive");
  // Parameters as users hold them, and what a sharded run can check.
  expect_error(with({"--global-batch", "16", "--freeze", "9."}), "--freeze 9.: no parameter name starts with it");
  expect_error(with({"--global-batch", "16", "--freeze", "0.,2."}), "every parameter would be frozen");
  expect_error(with({"--global-batch", "16", "--strategy", "ddp", "--wrap", "type:Linear"}),
               "--wrap applies to --strategy fsdp-full, fsdp-grad-op, fsdp-no-shard, hsdp, hsdp-grad-op or zero1, not ddp");
  // Hybrid sharding: R must divide N, and only the hybrid strategies take it.
  expect_error(with({"--global-batch", "16", "--strategy", "hsdp", "--world-size", "4", "--replicas", "3"}),
               "--replicas 3 does not divide the world size 4: hybrid sharding needs N = R x S");
  expect_error(with({"--global-batch", "16", "--strategy", "fsdp-full", "--world-size", "4", "--replicas", "2"}),
               "--replicas applies to --strategy hsdp or hsdp-grad-op, not fsdp-full");
  expect_error(with({"--global-batch", "16", "--strategy", "ddp", "--shard-across-hosts"}),
               "--shard-across-hosts applies to --strategy hsdp or hsdp-grad-op, not ddp");
  expect_error(with({"--global-batch", "16", "--strategy", "hsdp", "--replicas", "0"}),
               "--replicas: Value 0 not in range 1 to 1024");
  expect_error(with({"--global-batch", "16", "--strategy", "fsdp-full", "--verify-every", "1", "--reduce-dtype",
                     "bf16"}), "cannot check a run with --reduce-dtype bf16");
  expect_error(with({"--global-batch", "16", "--strategy", "fsdp-full", "--reduction", "global-mean",
                     "--accumulate-grads", "sharded"}), "it cannot reduce every micro-step");
}

// --version names gradsync, the libtorch it runs on (the reference Python's torch: the same release), Open MPI, the
// backends, and CUDA as the reference's torch has it (a CUDA wheel: compiled in; Debian's: not).
TEST(TrainCli, VersionNamesGradsyncLibtorchMpiBackendsAndCuda) {
  auto r = t::run({GRADSYNC_BIN, "--version"}, quick());
  ASSERT_TRUE(r.ok()) << r.describe();
  auto torch = t::run({kPython, "-c",
                       "import torch; v = torch.__version__.split('.'); "
                       "print(v[0] + '.' + v[1], 'cuda' if torch.version.cuda else 'cpu')"},
                      quick());
  ASSERT_TRUE(torch.ok()) << torch.describe();
  const std::string major_minor = torch.out.substr(0, torch.out.find(' '));
  const bool cuda = torch.out.find("cuda") != std::string::npos;
  EXPECT_EQ(r.out.rfind("gradsync 0.2.0\nlibtorch " + major_minor + ".", 0), 0u) << r.out << " vs " << torch.out;
  EXPECT_NE(r.out.find("\nMPI: Open MPI v4."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nbackends: gloo, mpi\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(cuda ? "\nCUDA: compiled in (CUDA runtime " : "\nCUDA: not compiled in"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.back(), '\n');
  EXPECT_NE(r.out.substr(r.out.size() - 2), "\n\n") << "no empty line at the end";
}

TEST(TrainCli, InitStateMismatchListsTheKeys) {
  const std::string dir = t::make_temp_dir("gradsync-train");
  auto made = t::run({kPython, "-c",
                      "import torch; torch.save({'0.weight': torch.zeros(4, 8), '0.bias': torch.zeros(5), "
                      "'9.weight': torch.zeros(1)}, '" + dir + "/bad.pt')"},
                     quick());
  ASSERT_TRUE(made.ok()) << made.describe();
  auto r = train({"--model", "mlp:8-4-3", "--data", "synthetic:64", "--global-batch", "16", "--strategy", "local",
                  "--init-state", dir + "/bad.pt"});
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.err.find("missing keys: 2.weight, 2.bias"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("unexpected keys: 9.weight"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("0.bias (file [5], model [4])"), std::string::npos) << r.describe();
}

TEST(TrainCli, SavedStateLoadsInPythonWithSequentialKeysAndLogHasOneLinePerStep) {
  const std::string dir = t::make_temp_dir("gradsync-train");
  auto r = train({"--model", "mlp-bn:8-6-3", "--data", "synthetic:64", "--global-batch", "16", "--strategy",
                  "local", "--steps", "5", "--save-state", dir + "/s.pt", "--log", dir + "/log.jsonl"});
  ASSERT_TRUE(r.ok()) << r.describe();
  auto check = t::run({kPython, "-c",
                       "import torch, sys\n"
                       "s = torch.load('" + dir + "/s.pt')\n"
                       "assert type(s) is dict, type(s)\n"
                       "m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),"
                       " torch.nn.Linear(6, 3))\n"
                       "assert list(s) == list(m.state_dict()), list(s)\n"
                       "m.load_state_dict(s)\n"
                       "assert int(s['1.num_batches_tracked']) == 5, s['1.num_batches_tracked']\n"
                       "print('ok')\n"},
                      quick());
  EXPECT_TRUE(check.ok()) << check.describe();
  std::ifstream log(dir + "/log.jsonl");
  int lines = 0;
  for (std::string line; std::getline(log, line);) ++lines;
  EXPECT_EQ(lines, 5);
}

// DDP over 2 and 3 self-started ranks ends where one process on the same global batches ends (SGD with
// momentum, accumulation, shuffled epochs): the mean over ranks of per-rank means is the global mean here.
TEST(TrainCli, SelfStartedRanksMatchOneProcess) {
  const std::string dir = t::make_temp_dir("gradsync-train");
  const std::vector<std::string> common{"--model", "mlp:8-16-3", "--data", "synthetic:120", "--global-batch", "24",
                                        "--momentum", "0.9", "--epochs", "3", "--accumulate", "2"};
  auto local_args = common;
  local_args.insert(local_args.end(), {"--strategy", "local", "--save-state", dir + "/local.pt"});
  ASSERT_TRUE(train(local_args).ok());
  for (const char* n : {"2", "3"}) {
    auto args = common;
    args.insert(args.end(), {"--world-size", n, "--save-state", dir + "/ddp" + n + ".pt"});
    auto r = train(args);
    ASSERT_TRUE(r.ok()) << r.describe();
    auto cmp = t::run({kPython, std::string(GRADSYNC_SOURCE_DIR) + "/tests/reference/compare_states.py",
                       dir + "/ddp" + n + ".pt", dir + "/local.pt", "--rtol", "1e-5", "--atol", "1e-6"},
                      quick());
    EXPECT_TRUE(cmp.ok()) << "N=" << n << ": " << cmp.describe();
  }
}

// --eval: test-split accuracy after every epoch, on stdout, in the summary and the log; evaluation gathers the
// model without touching the engine, so FSDP reports what DDP reports and training is the same as without it.
TEST(TrainCli, EvalReportsTestAccuracyPerEpochForDdpAndFsdp) {
  const std::string dir = t::make_temp_dir("gradsync-eval-");
  std::map<std::string, std::string> accuracy;
  for (const std::string strategy : {"ddp", "fsdp-full"}) {
    auto r = train({"--model", "mlp:784-32-10", "--data", "fashion-mnist", "--global-batch", "600", "--world-size",
                    "2", "--strategy", strategy, "--epochs", "2", "--lr", "0.1", "--eval", "--log",
                    dir + "/" + strategy + ".jsonl"});
    ASSERT_TRUE(r.ok()) << strategy << ": " << r.describe();
    for (int epoch : {0, 1}) {
      const std::string tag = "gradsync train: epoch " + std::to_string(epoch) + ": test accuracy ";
      const auto at = r.out.find(tag);
      ASSERT_NE(at, std::string::npos) << r.out;
      EXPECT_NE(r.out.find("/10000)", at), std::string::npos) << "the whole test split is evaluated: " << r.out;
      const double percent = std::stod(r.out.substr(at + tag.size()));
      EXPECT_GT(percent, 60.0) << strategy << " epoch " << epoch;
      EXPECT_LT(percent, 100.0);
      if (epoch == 1) accuracy[strategy] = r.out.substr(at + tag.size(), r.out.find('\n', at) - at - tag.size());
    }
    EXPECT_NE(r.out.find("; test accuracy " + accuracy[strategy].substr(0, accuracy[strategy].find('%') + 1)),
              std::string::npos) << r.out;
    std::ifstream log(dir + "/" + strategy + ".jsonl");
    int lines_with_accuracy = 0;
    for (std::string line; std::getline(log, line);) lines_with_accuracy += line.find("\"test_accuracy\"") != std::string::npos;
    EXPECT_EQ(lines_with_accuracy, 2) << strategy;
  }
  EXPECT_EQ(accuracy["ddp"], accuracy["fsdp-full"]) << "FSDP trains the same model as DDP";
  expect_error({"--model", "mlp:8-4-3", "--data", "synthetic:64", "--global-batch", "16", "--eval"},
               "--eval needs a held-out split: --data synthetic:64 has none; give --eval-data SPEC");
}
