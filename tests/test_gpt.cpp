// The gpt model and token data (tools/data/gpt_model.h, token_data.cpp) and `gradsync train` on them: the module is
// tests/reference/gpt.py's (keys, order, logits and gradients), the text tokeniser is text_tokens.py's bit for bit,
// a token mean without a valid token is refused, --reduction global-mean under every engine ends where one process
// on each step's sequences ends (float32 and --dtype fp64), and a short run on fortunes learns the text.
#include <cmath>
#include <fstream>
#include <regex>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/data.h"
#include "data/gpt_model.h"
#include "data/models.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"
#include "support/subprocess.h"

namespace t = gradsync::test;
namespace cli = gradsync::cli;

namespace {

const std::string kPython = GRADSYNC_PYTHON;
const std::string kReference = std::string(GRADSYNC_SOURCE_DIR) + "/tests/reference";

t::CommandOptions options(int seconds = 180) {
  return t::job_options(std::chrono::seconds(seconds));
}

// make_case.py's ragged token file (0..T valid tokens per sequence) and a seeded state for `model`.
std::string make_case(const std::string& model, int sequences, const std::string& seed = "3") {
  const std::string dir = t::make_temp_dir("gradsync-gpt-");
  auto made = t::run({kPython, kReference + "/make_case.py", "--model", model, "--n", std::to_string(sequences),
                      "--loss", "ce", "--seed", seed, "--data-out", dir + "/data.pt", "--state-out", dir + "/init.pt"},
                     options());
  EXPECT_TRUE(made.ok()) << made.describe();
  return dir;
}

// The largest |a - b| of each tensor within `rtol` of its largest |b| (compare_states.py's max_rel).
void expect_within(const std::string& a, const std::string& b, double rtol, const std::string& what) {
  auto r = t::run({kPython, kReference + "/compare_states.py", a, b, "--rtol", fmt::format("{:g}", rtol)}, options());
  const auto last = r.out.rfind('{');
  ASSERT_NE(last, std::string::npos) << what << ": " << r.describe();
  const double max_rel = nlohmann::json::parse(r.out.substr(last)).at("max_rel").get<double>();
  EXPECT_LE(max_rel, rtol) << what << ": " << r.describe();
}

}  // namespace

TEST(Gpt, KeysAreRegisteredInThePythonModulesOrder) {
  auto model = cli::make_model("gpt:16-8-12-2-3");
  std::vector<std::string> keys;
  for (const auto& [name, tensor] : gradsync::state_dict(*model)) keys.push_back(name);
  std::vector<std::string> expected{"wte.weight", "wpe.weight"};
  for (const std::string b : {"blocks.0.", "blocks.1."}) {
    for (const char* k : {"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.proj.weight", "attn.proj.bias",
                          "ln2.weight", "ln2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight",
                          "mlp.proj.bias"}) {
      expected.push_back(b + k);
    }
  }
  expected.insert(expected.end(), {"ln_f.weight", "ln_f.bias"});
  EXPECT_EQ(keys, expected);
  EXPECT_THROW(cli::make_model("gpt:16-8-10-2-3"), gradsync::ConfigError);  // width not a multiple of the heads
  EXPECT_THROW(cli::make_model("gpt:16-8-12-2"), gradsync::ConfigError);
}

// The same state and tokens through tests/reference/gpt.py: logits and every gradient of the summed loss, float64.
TEST(Gpt, LogitsAndGradientsAreThePythonModules) {
  const std::string dir = make_case("gpt:19-7-12-2-3", 6);
  auto model = cli::make_model("gpt:19-7-12-2-3");
  gradsync::load_into(*model, gradsync::load_state_dict(dir + "/init.pt"));
  model->to(torch::kDouble);
  const auto data = cli::load_token_dataset(dir + "/data.pt", 19, 7, 0);
  auto logits = model.forward(data.inputs);
  torch::nn::functional::cross_entropy(logits.reshape({-1, 19}), data.targets.reshape({-1}),
                                       torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(
                                           torch::kSum))
      .backward();
  gradsync::StateDict ours{{"logits", logits.detach()}};
  for (const auto& p : model->named_parameters()) ours.emplace_back("grad." + p.key(), p.value().grad());
  gradsync::save_state_dict(ours, dir + "/ours.pt");
  const std::string script =
      "import sys, torch; sys.path.insert(0, '" + kReference + "'); import gpt\n"
      "d = sys.argv[1]; m = gpt.make_gpt(19, 7, 12, 2, 3)\n"
      "m.load_state_dict(torch.load(d + '/init.pt')); m.double()\n"
      "data = torch.load(d + '/data.pt'); logits = m(data['inputs'])\n"
      "torch.nn.functional.cross_entropy(logits.reshape(-1, 19), data['targets'].reshape(-1), reduction='sum').backward()\n"
      "out = {'logits': logits.detach()}\n"
      "out.update({'grad.' + n: p.grad for n, p in m.named_parameters()})\n"
      "torch.save(out, d + '/theirs.pt')\n";
  auto py = t::run({kPython, "-c", script, dir}, options());
  ASSERT_TRUE(py.ok()) << py.describe();
  expect_within(dir + "/ours.pt", dir + "/theirs.pt", 1e-12, "logits and gradients");
}

TEST(GptData, DocumentsAreSplitAtPercentLines) {
  const auto docs = cli::split_documents("one\ntwo\n%\n%\nx\n%\nthree\n%\nlast line");
  ASSERT_EQ(docs.size(), 4u);  // the empty document between the two % lines is dropped
  EXPECT_EQ(docs[0], "one\ntwo\n");
  EXPECT_EQ(docs[1], "x\n");
  EXPECT_EQ(docs[2], "three\n");
  EXPECT_EQ(docs[3], "last line\n");  // a last line without a newline still gets one
  EXPECT_EQ(cli::split_documents("a\n%\nb").size(), 2u);  // "a\n" and "b\n": two bytes each
}

// The tokeniser against tests/reference/text_tokens.py, both splits of a text file and of the fortunes.
TEST(GptData, TextSequencesAreThePythonReferences) {
  const std::string dir = t::make_temp_dir("gradsync-gpt-text-");
  std::ofstream(dir + "/t.txt") << "Hello there\n%\nA\n%\n" << std::string(70, 'z') << "\nend\n%\nx";
  for (int d = 0; d < 12; ++d) std::ofstream(dir + "/t.txt", std::ios::app) << "\n%\ndoc " << d << "\n";
  for (const std::string& spec : std::vector<std::string>{"text:" + dir + "/t.txt", "text-test:" + dir + "/t.txt",
                                                          "fortunes", "fortunes:test"}) {
    auto py = t::run({kPython, kReference + "/text_tokens.py", "--data", spec, "--context", "32", "--out",
                      dir + "/py.pt"}, options());
    ASSERT_TRUE(py.ok()) << spec << ": " << py.describe();
    const auto ours = cli::load_token_dataset(spec, 256, 32, 0);
    const auto theirs = gradsync::load_state_dict(dir + "/py.pt");
    ASSERT_GT(ours.size(), 0) << spec;
    EXPECT_TRUE(torch::equal(ours.inputs, theirs[0].second)) << spec;
    EXPECT_TRUE(torch::equal(ours.targets, theirs[1].second)) << spec;
  }
  EXPECT_THROW(cli::load_token_dataset("fortunes", 300, 32, 0), gradsync::ConfigError);  // bytes: V = 256
}

// A micro-batch whose targets are all -100: its token mean is 0/0. The token mean refuses it, naming the rank and
// step; global-mean trains on it (the step's other tokens carry the gradient).
TEST(GptTrain, AMicroBatchWithoutAValidTokenIsRefusedByATokenMeanOnly) {
  const std::string dir = t::make_temp_dir("gradsync-gpt-empty-");
  auto made = t::run({kPython, "-c",
                      "import sys, torch; x = torch.randint(0, 11, (8, 5)); y = x.clone(); y[:4] = -100\n"
                      "torch.save({'inputs': x, 'targets': y}, sys.argv[1])", dir + "/data.pt"}, options());
  ASSERT_TRUE(made.ok()) << made.describe();
  const std::vector<std::string> common{GRADSYNC_BIN, "train", "--model", "gpt:11-5-8-1-2", "--data", dir + "/data.pt",
                                        "--global-batch", "8", "--accumulate", "2", "--steps", "1", "--no-shuffle",
                                        "--strategy", "local"};
  auto mean = t::run(common, options());
  EXPECT_EQ(mean.exit_code, 1) << mean.describe();
  EXPECT_NE(mean.err.find("holds no valid token"), std::string::npos) << mean.describe();
  EXPECT_NE(mean.err.find("step 0"), std::string::npos) << mean.describe();
  auto global = common;
  global.insert(global.end(), {"--reduction", "global-mean"});
  auto ok = t::run(global, options());
  EXPECT_TRUE(ok.ok()) << ok.describe();
  EXPECT_EQ(ok.out.find("nan"), std::string::npos) << ok.out;
}

// --reduction global-mean on 3 ranks without padding (uneven ranks, ragged token counts, K = 2) against one process on
// each step's sequences (gradsync's --replay-ranks, itself checked against PyTorch's): 1e-10 in float64, 5e-5 in
// float32; the per-micro-batch token mean (DDP's default) is not (more than 1e-3).
TEST(GptTrain, GlobalMeanUnderEveryEngineIsOneProcessOnEachStepsSequences) {
  const std::string dir = make_case("gpt:23-6-12-2-2", 50);
  for (const std::string dtype : {"fp64", "fp32"}) {
    const std::vector<std::string> common{"--model", "gpt:23-6-12-2-2", "--data", dir + "/data.pt", "--init-state",
                                          dir + "/init.pt", "--global-batch", "12", "--accumulate", "2",
                                          "--optimizer", "adam", "--lr", "0.01", "--steps", "4", "--no-pad",
                                          "--dtype", dtype, "--quiet"};
    auto run = [&](const std::string& name, std::vector<std::string> flags) {
      flags.insert(flags.begin(), {GRADSYNC_BIN, "train", "--save-state", dir + "/" + name + ".pt"});
      flags.insert(flags.end(), common.begin(), common.end());
      auto r = t::run(flags, options());
      EXPECT_TRUE(r.ok()) << name << ": " << r.describe();
    };
    run("one-" + dtype, {"--strategy", "local", "--replay-ranks", "3", "--reduction", "global-mean"});
    // The same one process in real PyTorch (tests/reference/torch_global_batches.py).
    std::vector<std::string> py{kPython, kReference + "/torch_global_batches.py", "--ranks", "3", "--save-state",
                                dir + "/pytorch-" + dtype + ".pt"};
    py.insert(py.end(), common.begin(), common.end() - 1);  // not --quiet
    auto reference = t::run(py, options());
    ASSERT_TRUE(reference.ok()) << reference.describe();
    expect_within(dir + "/one-" + dtype + ".pt", dir + "/pytorch-" + dtype + ".pt", dtype == "fp64" ? 1e-10 : 1e-5,
                  "one process against PyTorch's, " + dtype);
    run("mean-" + dtype, {"--strategy", "ddp", "--world-size", "3"});
    // float32: the ranks' sums in another order round differently, and Adam's 1/sqrt(v) amplifies that where a
    // gradient is tiny (a few elements differ by 1e-4 of themselves), so the bound is on each tensor's scale. How
    // much a tensor moves depends on the CPU's float32 kernels (1.05e-5 on an AVX2-only machine, below 1e-5 with
    // AVX-512), hence 5e-5: still 20 times below the token-mean control's 1e-3. float64 at 1e-10 is the exact proof.
    const double tolerance = dtype == "fp64" ? 1e-10 : 5e-5;
    for (const std::string strategy : {"ddp", "fsdp-full", "fsdp-grad-op", "zero1"}) {
      std::vector<std::string> flags{"--strategy", strategy, "--world-size", "3", "--reduction", "global-mean"};
      if (strategy != "ddp") flags.insert(flags.end(), {"--wrap", "type:Block"});
      run(strategy + "-" + dtype, flags);
      expect_within(dir + "/" + strategy + "-" + dtype + ".pt", dir + "/one-" + dtype + ".pt", tolerance,
                    strategy + " " + dtype);
    }
    auto control = t::run({kPython, kReference + "/compare_states.py", dir + "/mean-" + dtype + ".pt",
                           dir + "/one-" + dtype + ".pt", "--rtol", "1e-3", "--expect-different"}, options());
    EXPECT_TRUE(control.ok()) << "the token mean per micro-batch should differ: " << control.describe();
  }
}

// Two ranks, global-mean, accumulation, on real text: the held-out documents fall well below the 8 bits per byte of
// a uniform guess, and the run prints a sample.
TEST(GptTrain, AShortFortunesRunLearnsTheText) {
  auto r = t::run({GRADSYNC_BIN, "train", "--model", "gpt:256-64-64-2-4", "--data", "fortunes", "--world-size", "2",
                   "--strategy", "ddp", "--reduction", "global-mean", "--accumulate", "2", "--global-batch", "32",
                   "--optimizer", "adam", "--lr", "3e-3", "--steps", "150", "--eval", "--sample", "60"},
                  options(300));
  ASSERT_TRUE(r.ok()) << r.describe();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(eval: loss ([0-9.]+) nats per token, ([0-9.]+) bits per byte)")))
      << r.out;
  const double nats = std::stod(m[1]), bits = std::stod(m[2]);
  EXPECT_NEAR(bits, nats / std::log(2.0), 1e-3);
  EXPECT_LT(bits, 4.0) << r.out;
  EXPECT_NE(r.out.find("sample (seed 0): The "), std::string::npos) << r.out;
}
