// Tests for tools/models.{h,cpp} (model specs) and tools/data.{h,cpp} (data sets): state-dict keys and
// semantics equal to Python's nn.Sequential, synthetic data bit-identical to the documented Python recipe,
// Fashion-MNIST reading, and the error messages for bad specs and bad files.
//
// Python references run GRADSYNC_PYTHON (the torch of the same line, installed by scripts/install-deps.sh).
#include <gtest/gtest.h>

#include "support/error_of.h"
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/data.h"
#include "data/models.h"
#include "launch/spawn.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"

namespace {

namespace fs = std::filesystem;
using gradsync::cli::Dataset;
using gradsync::cli::load_dataset;
using gradsync::cli::LossKind;
using gradsync::cli::make_model;

torch::nn::Sequential sequential_model(const std::string& spec) { return make_model(spec).sequential(); }

constexpr const char* kPython = GRADSYNC_PYTHON;

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at scope exit (launch/spawn.h).
struct TempDir : gradsync::cli::TempDir {
  TempDir() : gradsync::cli::TempDir("gradsync-models-data") {}
};

// Sets (or unsets, with nullptr) an environment variable for the scope, restoring the old value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `script` with GRADSYNC_PYTHON, argv[1] = dir. Returns "" on success, else a failure description.
std::string run_python(const std::string& script, const TempDir& dir) {
  const std::string script_path = dir.file("reference.py");
  const std::string log_path = dir.file("reference.log");
  std::ofstream(script_path) << script;
  const std::string cmd =
      std::string(kPython) + " '" + script_path + "' '" + dir.path() + "' > '" + log_path + "' 2>&1";
  const int status = std::system(cmd.c_str());
  if (status == 0) return "";
  return "python reference failed (status " + std::to_string(status) + "; needs " + kPython +
         " with torch: python3-torch, see scripts/install-deps.sh):\n" + read_text(log_path);
}

using gradsync::test::error_of;

std::vector<std::string> parameter_names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& item : m.named_parameters()) out.push_back(item.key());
  return out;
}

std::vector<std::string> buffer_names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& item : m.named_buffers()) out.push_back(item.key());
  return out;
}

// Python's state_dict() order: per child in registration order, its parameters then its buffers.
std::vector<std::string> state_dict_names(const torch::nn::Sequential& model) {
  std::vector<std::string> out;
  for (const auto& child : model->named_children()) {
    for (const auto& p : child.value()->named_parameters(false)) out.push_back(child.key() + "." + p.key());
    for (const auto& b : child.value()->named_buffers(false)) out.push_back(child.key() + "." + b.key());
  }
  return out;
}

using Names = std::vector<std::string>;

}  // namespace

// ---- model specs -------------------------------------------------------------------------------------

TEST(ModelSpec, MlpKeysEqualPython) {
  // Python: list(nn.Sequential(nn.Linear(784,256), nn.ReLU(), nn.Linear(256,10)).state_dict().keys())
  const Names python = {"0.weight", "0.bias", "2.weight", "2.bias"};
  auto model = sequential_model("mlp:784-256-10");
  EXPECT_EQ(state_dict_names(model), python);
  EXPECT_EQ(parameter_names(*model), python);
  EXPECT_TRUE(buffer_names(*model).empty());
  ASSERT_EQ(model->size(), 3u);
  EXPECT_NE(model[0]->as<torch::nn::Linear>(), nullptr);
  EXPECT_NE(model[1]->as<torch::nn::ReLU>(), nullptr);
  EXPECT_NE(model[2]->as<torch::nn::Linear>(), nullptr);
  auto params = model->named_parameters();
  EXPECT_EQ(params["0.weight"].sizes(), torch::IntArrayRef({256, 784}));
  EXPECT_EQ(params["0.bias"].sizes(), torch::IntArrayRef({256}));
  EXPECT_EQ(params["2.weight"].sizes(), torch::IntArrayRef({10, 256}));
  EXPECT_EQ(params["2.bias"].sizes(), torch::IntArrayRef({10}));
  EXPECT_EQ(model->forward(torch::randn({5, 784})).sizes(), torch::IntArrayRef({5, 10}));
}

TEST(ModelSpec, DeepMlpAndTwoLayerMlp) {
  EXPECT_EQ(state_dict_names(sequential_model("mlp:3-4-5-6-2")),
            (Names{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "6.weight", "6.bias"}));
  auto linear_only = sequential_model("mlp:3-2");
  EXPECT_EQ(linear_only->size(), 1u);
  EXPECT_EQ(state_dict_names(linear_only), (Names{"0.weight", "0.bias"}));
}

TEST(ModelSpec, MlpBnKeysEqualPython) {
  // Python: nn.Sequential(nn.Linear(4,8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8,6), nn.BatchNorm1d(6),
  //                       nn.ReLU(), nn.Linear(6,3)): state_dict(), named_parameters(), named_buffers()
  const Names python_state = {
      "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
      "3.weight", "3.bias", "4.weight", "4.bias", "4.running_mean", "4.running_var", "4.num_batches_tracked",
      "6.weight", "6.bias"};
  const Names python_params = {"0.weight", "0.bias",   "1.weight", "1.bias",   "3.weight",
                               "3.bias",   "4.weight", "4.bias",   "6.weight", "6.bias"};
  const Names python_buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked",
                                "4.running_mean", "4.running_var", "4.num_batches_tracked"};
  auto model = sequential_model("mlp-bn:4-8-6-3");
  EXPECT_EQ(state_dict_names(model), python_state);
  EXPECT_EQ(parameter_names(*model), python_params);
  EXPECT_EQ(buffer_names(*model), python_buffers);
  EXPECT_NE(model[1]->as<torch::nn::BatchNorm1d>(), nullptr);
  EXPECT_NE(model[2]->as<torch::nn::ReLU>(), nullptr);
  EXPECT_EQ(model->named_buffers()["1.num_batches_tracked"].scalar_type(), torch::kInt64);

  EXPECT_EQ(state_dict_names(sequential_model("mlp-bn:784-256-10")),
            (Names{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                   "1.num_batches_tracked", "3.weight", "3.bias"}));
}

TEST(ModelSpec, PythonStateDictLoadsByNameAndGivesPythonOutputs) {
  // A Python model's state_dict (with non-trivial BatchNorm running statistics) copied into make_model()
  // by name must reproduce Python's eval-mode outputs.
  TempDir dir;
  const std::string script = R"PY(
import sys, torch, torch.nn as nn
torch.manual_seed(3)
m = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 6), nn.BatchNorm1d(6),
                  nn.ReLU(), nn.Linear(6, 3))
m.train()
for _ in range(3):
    m(torch.randn(16, 5) * 2 + 1)
m.eval()
x = torch.randn(4, 5)
d = dict(m.state_dict())
d["__x"] = x
d["__y"] = m(x).detach()
torch.save(d, sys.argv[1] + "/state.pt")
)PY";
  const std::string err = run_python(script, dir);
  ASSERT_TRUE(err.empty()) << err;

  std::ifstream in(dir.file("state.pt"), std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();

  auto model = sequential_model("mlp-bn:5-7-6-3");
  std::set<std::string> used;
  {
    torch::NoGradGuard no_grad;
    auto copy_in = [&](const std::string& name, torch::Tensor& dst) {
      auto it = dict.find(c10::IValue(name));
      ASSERT_NE(it, dict.end()) << "Python state_dict has no key " << name;
      const auto src = it->value().toTensor();
      ASSERT_EQ(src.sizes(), dst.sizes()) << name;
      ASSERT_EQ(src.scalar_type(), dst.scalar_type()) << name;
      dst.copy_(src);
      used.insert(name);
    };
    for (auto& p : model->named_parameters()) copy_in(p.key(), p.value());
    for (auto& b : model->named_buffers()) copy_in(b.key(), b.value());
  }
  EXPECT_EQ(used.size() + 2, dict.size()) << "Python has keys the C++ model does not";
  model->eval();
  const auto x = dict.at(c10::IValue(std::string("__x"))).toTensor();
  const auto y_python = dict.at(c10::IValue(std::string("__y"))).toTensor();
  const auto y = model->forward(x);
  EXPECT_TRUE(torch::allclose(y, y_python, 1e-5, 1e-6)) << y << "\nvs Python\n" << y_python;
}

TEST(ModelSpec, InputAndOutputSizes) {
  EXPECT_EQ(gradsync::cli::model_input_size("mlp:784-256-10"), 784);
  EXPECT_EQ(gradsync::cli::model_output_size("mlp:784-256-10"), 10);
  EXPECT_EQ(gradsync::cli::model_input_size("mlp-bn:12-3"), 12);
  EXPECT_EQ(gradsync::cli::model_output_size("mlp-bn:12-5-4-3"), 3);
  const auto spec = gradsync::cli::parse_model_spec("mlp-bn:12-5-4-3");
  EXPECT_TRUE(spec.batch_norm);
  EXPECT_EQ(spec.sizes, (std::vector<int64_t>{12, 5, 4, 3}));
  // cnn:C1-C2-OUT reads flattened 28x28 images; its keys are Python's nn.Sequential indices.
  EXPECT_EQ(gradsync::cli::model_input_size("cnn:32-64-10"), 784);
  EXPECT_EQ(gradsync::cli::model_output_size("cnn:32-64-10"), 10);
  auto cnn = sequential_model("cnn:4-8-10");
  std::vector<std::string> keys;
  for (const auto& [name, t] : gradsync::state_dict(*cnn)) keys.push_back(name);
  EXPECT_EQ(keys, (std::vector<std::string>{"1.weight", "1.bias", "4.weight", "4.bias", "8.weight", "8.bias"}));
  EXPECT_EQ(cnn->forward(torch::zeros({5, 784})).sizes(), (std::vector<int64_t>{5, 10}));
}

// res:IN-H-B-OUT is not a Sequential; its keys and their order are Python's Res (tests/reference/torch_train.py):
// list(Res(5, 6, 2, 3).state_dict().keys()).
TEST(ModelSpec, ResKeysAndOrderEqualPythonAndItIsNotASequential) {
  auto res = make_model("res:5-6-2-3");
  std::vector<std::string> keys;
  for (const auto& [name, t] : gradsync::state_dict(*res)) keys.push_back(name);
  EXPECT_EQ(keys, (Names{"inp.weight", "inp.bias", "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.fc.weight",
                         "blocks.0.fc.bias", "blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc.weight",
                         "blocks.1.fc.bias", "out.weight", "out.bias"}));
  EXPECT_EQ(parameter_names(*res), keys);
  EXPECT_THROW(res.sequential(), gradsync::ConfigError);
  EXPECT_EQ(res.forward(torch::zeros({4, 5})).sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(gradsync::cli::model_input_size("res:784-64-3-10"), 784);
  EXPECT_EQ(gradsync::cli::model_output_size("res:784-64-3-10"), 10);
}

TEST(ModelSpec, BadSpecsNameTheProblemAndTheAllowedForms) {
  struct Case {
    std::string spec, expected;
  };
  const std::vector<Case> cases = {
      {"mlp:784-x-10", "model spec 'mlp:784-x-10': 'x' is not a positive integer"},
      {"mlp:784-0-10", "'0' is not a positive integer"},
      {"mlp:-784-10", "empty layer size"},
      {"mlp:784--10", "empty layer size"},
      {"mlp:784-10-", "empty layer size"},
      {"mlp: 784-10", "' 784' is not a positive integer"},
      {"mlp:+784-10", "'+784' is not a positive integer"},
      {"mlp:784-1.5", "'1.5' is not a positive integer"},
      {"mlp:784", "need at least two"},
      {"mlp:", "no layer sizes"},
      {"mlp", "missing ':'"},
      {"784-10", "missing ':'"},
      {"", "missing ':'"},
      {"cnn:784-10", "cnn takes exactly three sizes (channels C1, C2 and outputs), got 2"},
      {"cnn:4-8-0", "'0' is not a positive integer"},
      {"res:8-16-10", "res takes exactly four sizes (inputs, width, blocks, outputs), got 3"},
      {"res:8-16-0-10", "'0' is not a positive integer"},
      {"gpt:256-64-64-2", "gpt takes exactly five sizes (vocabulary, context, width, blocks, heads), got 4"},
      {"gpt:256-64-66-2-4", "gpt's width 66 is not a multiple of its 4 heads"},
      {"gpt:256-0-64-2-4", "'0' is not a positive integer"},
      {"conv:4-8-10", "unknown model kind 'conv'"},
      {"MLP:784-10", "unknown model kind 'MLP'"},
      {"mlp:99999999999999999999-10", "too large"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("spec '" + c.spec + "'");
    const std::string msg = error_of<gradsync::ConfigError>([&] { make_model(c.spec); });
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected mlp:IN-H...-OUT, mlp-bn:IN-H...-OUT, cnn:C1-C2-OUT, res:IN-H-B-OUT or "
                       "gpt:V-T-D-L-H"), std::string::npos) << msg;
    error_of<gradsync::ConfigError>([&] { gradsync::cli::model_input_size(c.spec); });
    error_of<gradsync::ConfigError>([&] { gradsync::cli::model_output_size(c.spec); });
  }
}

// ---- synthetic data ----------------------------------------------------------------------------------

namespace {

std::string synthetic_script(int64_t n, int64_t in, int64_t out, const char* loss, const std::string& seed) {
  return "import sys, math, torch\n"
         "N, IN, OUT, seed = " +
         std::to_string(n) + ", " + std::to_string(in) + ", " + std::to_string(out) + ", " + seed +
         "\n"
         "g = torch.Generator(); g.manual_seed(seed)\n"
         "X = torch.randn(N, IN, generator=g)\n"
         "W = torch.randn(IN, OUT, generator=g)\n"
         "logits = X @ W\n"
         "Y = logits.argmax(dim=1) if '" +
         loss +
         "' == 'ce' else logits / math.sqrt(IN)\n"
         "torch.save({'inputs': X, 'targets': Y}, sys.argv[1] + '/synthetic.pt')\n";
}

}  // namespace

TEST(Dataset, SyntheticCrossEntropyIsBitIdenticalToPython) {
  TempDir dir;
  const std::string err = run_python(synthetic_script(1000, 37, 7, "ce", "1234"), dir);
  ASSERT_TRUE(err.empty()) << err;
  const Dataset python = load_dataset(dir.file("synthetic.pt"), 37, 7, LossKind::CrossEntropy, 0);
  const Dataset ours = load_dataset("synthetic:1000", 37, 7, LossKind::CrossEntropy, 1234);
  ASSERT_EQ(ours.size(), 1000);
  EXPECT_EQ(ours.inputs.sizes(), torch::IntArrayRef({1000, 37}));
  EXPECT_EQ(ours.inputs.scalar_type(), torch::kFloat32);
  EXPECT_EQ(ours.targets.sizes(), torch::IntArrayRef({1000}));
  EXPECT_EQ(ours.targets.scalar_type(), torch::kInt64);
  EXPECT_TRUE(torch::equal(ours.inputs, python.inputs));
  EXPECT_TRUE(torch::equal(ours.targets, python.targets));
  // Every class shows up, so the targets are not degenerate.
  EXPECT_EQ(std::get<0>(torch::_unique(ours.targets)).numel(), 7);
}

TEST(Dataset, SyntheticMeanSquaredIsBitIdenticalToPythonWithA64BitSeed) {
  TempDir dir;
  const std::string err = run_python(synthetic_script(300, 20, 3, "mse", "18446744073709551557"), dir);
  ASSERT_TRUE(err.empty()) << err;
  const Dataset python = load_dataset(dir.file("synthetic.pt"), 20, 3, LossKind::MeanSquared, 0);
  const Dataset ours = load_dataset("synthetic:300", 20, 3, LossKind::MeanSquared, 18446744073709551557ull);
  EXPECT_EQ(ours.targets.sizes(), torch::IntArrayRef({300, 3}));
  EXPECT_EQ(ours.targets.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(ours.inputs, python.inputs));
  EXPECT_TRUE(torch::equal(ours.targets, python.targets));
}

TEST(Dataset, SyntheticIsReproducibleFromTheSeed) {
  const auto a = load_dataset("synthetic:64", 8, 4, LossKind::CrossEntropy, 5);
  const auto b = load_dataset("synthetic:64", 8, 4, LossKind::CrossEntropy, 5);
  const auto c = load_dataset("synthetic:64", 8, 4, LossKind::CrossEntropy, 6);
  EXPECT_TRUE(torch::equal(a.inputs, b.inputs));
  EXPECT_TRUE(torch::equal(a.targets, b.targets));
  EXPECT_FALSE(torch::equal(a.inputs, c.inputs));
  // The same seed gives the same inputs whatever the loss.
  const auto m = load_dataset("synthetic:64", 8, 4, LossKind::MeanSquared, 5);
  EXPECT_TRUE(torch::equal(a.inputs, m.inputs));
  EXPECT_TRUE(torch::equal(a.targets, m.targets.argmax(1)));
}

TEST(Dataset, BadSpecsNameTheProblem) {
  struct Case {
    std::string spec, expected;
  };
  const std::vector<Case> cases = {
      {"synthetic:0", "'0' is not a positive integer"},
      {"synthetic:-5", "'-5' is not a positive integer"},
      {"synthetic:abc", "'abc' is not a positive integer"},
      {"synthetic:", "'' is not a positive integer"},
      {"synthetic", "expected synthetic:N"},
      {"fashion-mnist:val", "split 'val' is unknown; expected fashion-mnist, fashion-mnist:train or"},
      {"fashion-mnist:", "split '' is unknown"},
      {"", "dataset spec is empty; expected fashion-mnist[:train|:test], synthetic:N"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("spec '" + c.spec + "'");
    const std::string msg =
        error_of<gradsync::ConfigError>([&] { load_dataset(c.spec, 784, 10, LossKind::CrossEntropy, 0); });
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
  }
  std::string msg = error_of<gradsync::ConfigError>(
      [] { load_dataset("fashion-mnist", 100, 10, LossKind::CrossEntropy, 0); });
  EXPECT_NE(msg.find("784 inputs"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the model takes 100"), std::string::npos) << msg;
  msg = error_of<gradsync::ConfigError>(
      [] { load_dataset("fashion-mnist:test", 784, 3, LossKind::MeanSquared, 0); });
  EXPECT_NE(msg.find("10 classes but the model has 3 outputs"), std::string::npos) << msg;
  msg = error_of<gradsync::ConfigError>([] { gradsync::cli::parse_loss_kind("l1"); });
  EXPECT_NE(msg.find("loss 'l1' is unknown; expected ce"), std::string::npos) << msg;
  EXPECT_EQ(gradsync::cli::parse_loss_kind("ce"), LossKind::CrossEntropy);
  EXPECT_EQ(gradsync::cli::parse_loss_kind("mse"), LossKind::MeanSquared);
}

// ---- Fashion-MNIST -----------------------------------------------------------------------------------

TEST(Dataset, FashionMnistLoadsTrainAndTest) {
  const std::string dir = gradsync::cli::fashion_mnist_dir();
  struct stat st {};
  if (::stat((dir + "/train-images-idx3-ubyte.gz").c_str(), &st) != 0) {
    GTEST_SKIP() << "Fashion-MNIST not installed in " << dir << " (apt-get install dataset-fashion-mnist)";
  }
  const Dataset train = load_dataset("fashion-mnist", 784, 10, LossKind::CrossEntropy, 0);
  EXPECT_EQ(train.inputs.sizes(), torch::IntArrayRef({60000, 784}));
  EXPECT_EQ(train.inputs.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(train.inputs.is_contiguous());
  EXPECT_GE(train.inputs.min().item<float>(), 0.0f);
  EXPECT_LE(train.inputs.max().item<float>(), 1.0f);
  EXPECT_EQ(train.inputs.max().item<float>(), 1.0f);  // some pixel is 255
  EXPECT_EQ(train.targets.sizes(), torch::IntArrayRef({60000}));
  EXPECT_EQ(train.targets.scalar_type(), torch::kInt64);
  EXPECT_EQ(train.targets.min().item<int64_t>(), 0);
  EXPECT_EQ(train.targets.max().item<int64_t>(), 9);
  // Fashion-MNIST is balanced: 6000 examples per class in train.
  EXPECT_TRUE(torch::equal(torch::bincount(train.targets), torch::full({10}, 6000, torch::kInt64)));

  const Dataset test = load_dataset("fashion-mnist:test", 784, 10, LossKind::MeanSquared, 0);
  EXPECT_EQ(test.inputs.sizes(), torch::IntArrayRef({10000, 784}));
  EXPECT_EQ(test.targets.sizes(), torch::IntArrayRef({10000, 10}));
  EXPECT_EQ(test.targets.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(test.targets.sum(1), torch::ones({10000})));
  const Dataset test_ce = load_dataset("fashion-mnist:test", 784, 10, LossKind::CrossEntropy, 0);
  EXPECT_TRUE(torch::equal(test.targets.argmax(1), test_ce.targets));
}

namespace {

void put_be32(std::vector<unsigned char>& out, uint32_t v) {
  out.push_back(static_cast<unsigned char>(v >> 24));
  out.push_back(static_cast<unsigned char>(v >> 16));
  out.push_back(static_cast<unsigned char>(v >> 8));
  out.push_back(static_cast<unsigned char>(v));
}

void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::vector<unsigned char> idx_images(uint32_t magic, uint32_t count, uint32_t side, size_t pixel_bytes) {
  std::vector<unsigned char> out;
  put_be32(out, magic);
  put_be32(out, count);
  put_be32(out, side);
  put_be32(out, side);
  for (size_t i = 0; i < pixel_bytes; ++i) out.push_back(static_cast<unsigned char>(i % 256));
  return out;
}

std::vector<unsigned char> idx_labels(uint32_t magic, std::vector<unsigned char> labels) {
  std::vector<unsigned char> out;
  put_be32(out, magic);
  put_be32(out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

}  // namespace

TEST(Dataset, FashionMnistReaderOnSmallIdxFilesFromTheEnvironmentDirectory) {
  TempDir dir;
  write_gz(dir.file("train-images-idx3-ubyte.gz"), idx_images(2051, 3, 28, 3 * 784));
  write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_labels(2049, {9, 0, 4}));
  ScopedEnv env("GRADSYNC_FASHION_MNIST_DIR", dir.path().c_str());
  const Dataset d = load_dataset("fashion-mnist:train", 784, 10, LossKind::CrossEntropy, 0);
  ASSERT_EQ(d.inputs.sizes(), torch::IntArrayRef({3, 784}));
  const auto expected =
      torch::arange(3 * 784, torch::kInt64).remainder(256).to(torch::kUInt8).to(torch::kFloat32).div(255.0f);
  EXPECT_TRUE(torch::equal(d.inputs, expected.view({3, 784})));
  EXPECT_TRUE(torch::equal(d.targets, torch::tensor({9, 0, 4}, torch::kInt64)));
  const Dataset m = load_dataset("fashion-mnist", 784, 10, LossKind::MeanSquared, 0);
  EXPECT_TRUE(torch::equal(m.targets, torch::one_hot(torch::tensor({9, 0, 4}), 10).to(torch::kFloat32)));
}

TEST(Dataset, FashionMnistErrorsNameTheFileAndTheFix) {
  TempDir dir;
  const std::string images = dir.file("train-images-idx3-ubyte.gz");
  const std::string labels = dir.file("train-labels-idx1-ubyte.gz");
  ScopedEnv env("GRADSYNC_FASHION_MNIST_DIR", dir.path().c_str());
  auto load = [] { load_dataset("fashion-mnist", 784, 10, LossKind::CrossEntropy, 0); };
  auto expect_error = [&](const std::vector<std::string>& parts) {
    const std::string msg = error_of<std::runtime_error>(load);
    for (const auto& part : parts)
      EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
  };

  {
    SCOPED_TRACE("missing files");
    expect_error({images, "No such file or directory", "apt-get install dataset-fashion-mnist", "make deps",
                  "GRADSYNC_FASHION_MNIST_DIR"});
  }
  write_gz(labels, idx_labels(2049, {1, 2}));
  {
    SCOPED_TRACE("wrong image magic");
    write_gz(images, idx_images(2049, 2, 28, 2 * 784));
    expect_error({images, "magic number 2049, expected 2051"});
  }
  {
    SCOPED_TRACE("wrong image size");
    write_gz(images, idx_images(2051, 2, 32, 2 * 32 * 32));
    expect_error({images, "32x32 images, expected 28x28"});
  }
  {
    SCOPED_TRACE("truncated pixels");
    write_gz(images, idx_images(2051, 2, 28, 784 + 100));
    expect_error({images, "truncated", "need 1568 bytes but only 884"});
  }
  {
    SCOPED_TRACE("trailing data");
    write_gz(images, idx_images(2051, 2, 28, 2 * 784 + 1));
    expect_error({images, "more data than the 1584 bytes its header declares"});
  }
  {
    SCOPED_TRACE("not gzip at all but too short");
    std::ofstream(images) << "hi";
    expect_error({images, "truncated"});
  }
  write_gz(images, idx_images(2051, 2, 28, 2 * 784));
  {
    SCOPED_TRACE("wrong label magic");
    write_gz(labels, idx_labels(2051, {1, 2}));
    expect_error({labels, "magic number 2051, expected 2049"});
  }
  {
    SCOPED_TRACE("label out of range");
    write_gz(labels, idx_labels(2049, {1, 10}));
    expect_error({labels, "label 10 at index 1 is outside 0..9"});
  }
  {
    SCOPED_TRACE("count mismatch");
    write_gz(labels, idx_labels(2049, {1, 2, 3}));
    expect_error({images, "has 2 images", labels, "has 3 labels"});
  }
  {
    SCOPED_TRACE("corrupt gzip stream");
    std::vector<unsigned char> good;
    {
      write_gz(labels, idx_labels(2049, {1, 2}));
      std::ifstream in(labels, std::ios::binary);
      good.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    ASSERT_GT(good.size(), 14u);
    for (size_t i = 10; i < good.size(); ++i) good[i] ^= 0x5a;
    std::ofstream(labels, std::ios::binary).write(reinterpret_cast<const char*>(good.data()), good.size());
    const std::string msg = error_of<std::runtime_error>(load);
    EXPECT_NE(msg.find(labels), std::string::npos) << msg;
  }
  {
    SCOPED_TRACE("success after all that");
    write_gz(labels, idx_labels(2049, {1, 2}));
    EXPECT_EQ(load_dataset("fashion-mnist", 784, 10, LossKind::CrossEntropy, 0).size(), 2);
  }
}

// ---- torch.save files --------------------------------------------------------------------------------

namespace {

// Every file the torch.save tests use, written by one Python run. Inputs flatten to 6 features; OUT = 4.
const char* kFilesScript = R"PY(
import sys, torch
from collections import OrderedDict
d = sys.argv[1]
def save(name, obj, **kw):
    torch.save(obj, d + "/" + name + ".pt", **kw)
g = torch.Generator(); g.manual_seed(7)
X = torch.rand(6, 1, 2, 3, dtype=torch.float64, generator=g)
ce = torch.tensor([0, 1, 2, 3, 0, 1])
mse = torch.randn(6, 4, generator=g, dtype=torch.float64)
save("ok_ce", {"inputs": X, "targets": ce, "extra": 1})
save("ok_mse", {"inputs": X.float(), "targets": mse})
save("ok_noncontiguous", {"inputs": torch.randn(6, 6, generator=g).t(), "targets": ce})
save("ok_mse_1d", {"inputs": X, "targets": mse[:, 0].clone()})
save("tensor", X)
save("list", [X, ce])
save("ordered_dict", OrderedDict(inputs=X, targets=ce))
save("legacy", {"inputs": X, "targets": ce}, _use_new_zipfile_serialization=False)
save("no_targets", {"inputs": X, "labels": ce})
save("targets_list", {"inputs": X, "targets": [0, 1]})
save("int_inputs", {"inputs": torch.ones(6, 6, dtype=torch.int64), "targets": ce})
save("half_inputs", {"inputs": torch.ones(6, 6, dtype=torch.float16), "targets": ce})
save("scalar_inputs", {"inputs": torch.tensor(1.0), "targets": ce})
save("empty", {"inputs": torch.zeros(0, 6), "targets": torch.zeros(0, dtype=torch.int64)})
save("wide", {"inputs": torch.zeros(6, 7), "targets": ce})
save("row_mismatch", {"inputs": X, "targets": ce[:5].clone()})
save("nan_inputs", {"inputs": torch.tensor([[0.0] * 6] * 5 + [[0.0, 0.0, float("nan"), 0.0, 0.0, 0.0]]), "targets": ce})
save("ce_too_big", {"inputs": X, "targets": torch.tensor([0, 1, 2, 4, 0, 1])})
save("ce_negative", {"inputs": X, "targets": torch.tensor([0, 1, -1, 3, 0, 1])})
save("ce_float", {"inputs": X, "targets": ce.float()})
save("ce_int32", {"inputs": X, "targets": ce.int()})
save("ce_2d", {"inputs": X, "targets": ce.view(6, 1)})
save("mse_width", {"inputs": X, "targets": torch.zeros(6, 3)})
save("mse_int", {"inputs": X, "targets": torch.zeros(6, 4, dtype=torch.int64)})
save("mse_inf", {"inputs": X, "targets": torch.full((6, 4), float("inf"))})
open(d + "/garbage.pt", "w").write("this is not a torch file\n")
open(d + "/empty_file.pt", "w").close()
)PY";

}  // namespace

TEST(Dataset, TorchSaveFilesLoadAndConvert) {
  TempDir dir;
  const std::string err = run_python(kFilesScript, dir);
  ASSERT_TRUE(err.empty()) << err;

  const Dataset ce = load_dataset(dir.file("ok_ce.pt"), 6, 4, LossKind::CrossEntropy, 0);
  EXPECT_EQ(ce.inputs.sizes(), torch::IntArrayRef({6, 6}));
  EXPECT_EQ(ce.inputs.scalar_type(), torch::kFloat32);  // float64 converted
  EXPECT_TRUE(ce.inputs.is_contiguous());
  EXPECT_FALSE(ce.inputs.requires_grad());
  EXPECT_TRUE(torch::equal(ce.targets, torch::tensor({0, 1, 2, 3, 0, 1}, torch::kInt64)));

  const Dataset mse = load_dataset(dir.file("ok_mse.pt"), 6, 4, LossKind::MeanSquared, 0);
  EXPECT_TRUE(torch::equal(mse.inputs, ce.inputs));  // X.float() in Python == our float64 -> float32
  EXPECT_EQ(mse.targets.sizes(), torch::IntArrayRef({6, 4}));
  EXPECT_EQ(mse.targets.scalar_type(), torch::kFloat32);

  const Dataset nc = load_dataset(dir.file("ok_noncontiguous.pt"), 6, 4, LossKind::CrossEntropy, 0);
  EXPECT_TRUE(nc.inputs.is_contiguous());
  EXPECT_EQ(nc.inputs.sizes(), torch::IntArrayRef({6, 6}));

  const Dataset one = load_dataset(dir.file("ok_mse_1d.pt"), 6, 1, LossKind::MeanSquared, 0);
  EXPECT_EQ(one.targets.sizes(), torch::IntArrayRef({6, 1}));

  const Dataset rows = gradsync::cli::select_rows(ce, torch::tensor({4, 1}));
  EXPECT_TRUE(torch::equal(rows.targets, torch::tensor({0, 1}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(rows.inputs[1], ce.inputs[1]));
}

// A --data file cut by a few bytes (a copy that stopped short) is refused before any parsing, naming the file;
// it is never read past its end.
TEST(Dataset, TorchSaveFileCutShortIsRefusedNamingIt) {
  TempDir dir;
  c10::impl::GenericDict data(c10::StringType::get(), c10::TensorType::get());
  data.insert("inputs", torch::randn({256, 6}));
  data.insert("targets", torch::randint(0, 4, {256}, torch::kLong));
  const std::string whole = dir.file("whole.pt");
  gradsync::save_torch_file(data, whole);
  EXPECT_EQ(load_dataset(whole, 6, 4, LossKind::CrossEntropy, 0).inputs.size(0), 256);
  std::ifstream in(whole, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (size_t cut = 1; cut <= 4; ++cut) {
    const std::string path = dir.file(fmt::format("cut_{}.pt", cut));
    std::ofstream(path, std::ios::binary) << bytes.substr(0, bytes.size() - cut);
    const std::string msg =
        error_of<gradsync::ConfigError>([&] { load_dataset(path, 6, 4, LossKind::CrossEntropy, 0); });
    EXPECT_NE(msg.find(path), std::string::npos) << "cut " << cut << ": " << msg;
  }
}

TEST(Dataset, TorchSaveFileErrorsNameTheFileTheValueAndWhatIsAllowed) {
  TempDir dir;
  const std::string err = run_python(kFilesScript, dir);
  ASSERT_TRUE(err.empty()) << err;

  struct Case {
    std::string file;
    LossKind loss;
    bool config_error;  // else any std::runtime_error
    std::vector<std::string> parts;
  };
  const auto CE = LossKind::CrossEntropy;
  const auto MSE = LossKind::MeanSquared;
  const std::vector<Case> cases = {
      {"missing.pt", CE, false, {"cannot open file: No such file or directory", "synthetic:N"}},
      {"", CE, false, {"is a directory"}},  // the directory itself
      {"garbage.pt", CE, false, {"not a readable torch.save file", "torch.save({\"inputs\": X"}},
      {"empty_file.pt", CE, false, {"not a readable torch.save file"}},
      {"legacy.pt", CE, false, {"not a readable torch.save file", "default zip format"}},
      {"tensor.pt", CE, true, {"holds a Tensor, expected a dict"}},
      {"list.pt", CE, true, {"holds a GenericList, expected a dict"}},
      {"no_targets.pt", CE, true, {"no key 'targets' (keys: 'inputs', 'labels')"}},
      {"targets_list.pt", CE, true, {"'targets' is a GenericList, expected a tensor"}},
      {"int_inputs.pt", CE, true, {"'inputs' has dtype int64, expected float32 or float64"}},
      {"half_inputs.pt", CE, true, {"'inputs' has dtype float16, expected float32 or float64"}},
      {"scalar_inputs.pt", CE, true, {"'inputs' is a scalar"}},
      {"empty.pt", CE, true, {"'inputs' has 0 rows"}},
      {"wide.pt", CE, true, {"shape [6, 7] flattens to 7 features per row, but the model takes 6 inputs"}},
      {"row_mismatch.pt", CE, true, {"'targets' has shape [5] but 'inputs' has 6 rows"}},
      {"nan_inputs.pt", CE, true, {"'inputs' contains a non-finite value", "flat index 32"}},
      {"ce_too_big.pt", CE, true, {"target 4 at row 3 is outside the model's classes [0, 4)"}},
      {"ce_negative.pt", CE, true, {"target -1 at row 2 is outside the model's classes [0, 4)"}},
      {"ce_float.pt", CE, true, {"dtype float32, but loss ce needs int64 class indices", "need loss mse"}},
      {"ce_int32.pt", CE, true, {"dtype int32, but loss ce needs int64 class indices"}},
      {"ce_2d.pt", CE, true, {"shape [6, 1], but loss ce needs class indices of shape [6]"}},
      {"mse_width.pt", MSE, true, {"shape [6, 3], but loss mse with a model of 4 outputs needs [6, 4]"}},
      {"mse_int.pt", MSE, true, {"dtype int64, but loss mse needs float32 or float64 targets [n, 4]"}},
      {"mse_inf.pt", MSE, true, {"'targets' contains a non-finite value"}},
  };
  for (const auto& c : cases) {
    const std::string path = c.file.empty() ? dir.path() : dir.file(c.file);
    SCOPED_TRACE("file '" + path + "'");
    auto load = [&] { load_dataset(path, 6, 4, c.loss, 0); };
    const std::string msg =
        c.config_error ? error_of<gradsync::ConfigError>(load) : error_of<std::runtime_error>(load);
    EXPECT_NE(msg.find(path), std::string::npos) << "path missing in: " << msg;
    for (const auto& part : c.parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
    }
  }
  // torch.save(OrderedDict(...)) is what torch.save(model.state_dict()) writes: it loads like a dict.
  EXPECT_EQ(load_dataset(dir.file("ordered_dict.pt"), 6, 4, CE, 0).size(), 6);

  // Unreadable file (not as root: root reads anything).
  if (::geteuid() != 0) {
    const std::string path = dir.file("ok_ce.pt");
    ::chmod(path.c_str(), 0);
    const std::string msg =
        error_of<std::runtime_error>([&] { load_dataset(path, 6, 4, LossKind::CrossEntropy, 0); });
    EXPECT_NE(msg.find("Permission denied"), std::string::npos) << msg;
  }
}
