// Tests for include/gradsync/state_dict.h: state_dict() keys and order equal to Python's nn.Module.state_dict()
// (own parameters, own buffers, then children), files that real Python torch.load reads as a plain dict with
// identical tensors and vice versa (Python references run GRADSYNC_PYTHON under a timeout), strict load_into,
// atomic saving and the errors for unwritable paths and damaged files.
#include <gtest/gtest.h>

#include "support/error_of.h"
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "common/atomic_file.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"
#include "support/subprocess.h"

namespace {

namespace fs = std::filesystem;
using gradsync::StateDict;
using Names = std::vector<std::string>;

constexpr const char* kPython = GRADSYNC_PYTHON;

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() : path_(gradsync::test::make_temp_dir("gradsync-state-dict-")) {}
  ~TempDir() {
    std::error_code ec;
    // Make everything writable again first (a test may have taken write permission away).
    for (auto it = fs::recursive_directory_iterator(path_, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      if (it->is_directory(ec)) fs::permissions(it->path(), fs::perms::owner_all, fs::perm_options::add, ec);
    }
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  Names entries() const {
    Names out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::string path_;
};

// Runs `python3 -c script args...` with a timeout.
gradsync::test::ProcessResult run_python(const std::string& script, const std::vector<std::string>& args = {}) {
  std::vector<std::string> argv = {kPython, "-c", script};
  argv.insert(argv.end(), args.begin(), args.end());
  gradsync::test::CommandOptions opts;
  opts.timeout = std::chrono::seconds(120);
  opts.env = {{"OMP_NUM_THREADS", "1"}};
  return gradsync::test::run(argv, opts);
}

// The last line of a successful Python run, parsed as JSON; a test failure otherwise.
nlohmann::json python_json(const std::string& script, const std::vector<std::string>& args = {}) {
  const auto r = run_python(script, args);
  if (!r.ok()) {
    ADD_FAILURE() << "python reference failed (needs " << kPython << " with torch):\n" << r.describe();
    return nullptr;
  }
  auto end = r.out.find_last_not_of('\n');
  auto begin = r.out.rfind('\n', end);
  const std::string last = r.out.substr(begin == std::string::npos ? 0 : begin + 1, end - begin);
  try {
    return nlohmann::json::parse(last);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "python printed no JSON last line: " << e.what() << "\n" << r.describe();
    return nullptr;
  }
}

using gradsync::test::error_of;

std::string python_dtype(c10::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "torch.float32";
    case torch::kDouble: return "torch.float64";
    case torch::kHalf: return "torch.float16";
    case torch::kBFloat16: return "torch.bfloat16";
    case torch::kLong: return "torch.int64";
    case torch::kInt: return "torch.int32";
    case torch::kByte: return "torch.uint8";
    case torch::kBool: return "torch.bool";
    default: return std::string("unmapped:") + c10::toString(t);
  }
}

Names keys_of(const StateDict& s) {
  Names out;
  for (const auto& item : s) out.push_back(item.first);
  return out;
}

// ---- a nested module, registered in an interleaved order -----------------------------------------------
// Python's state_dict() lists a module's own parameters, then its own buffers, then each child (recursively) in
// registration order, whatever the order of registration between parameters, buffers and children.

struct InnerImpl : torch::nn::Module {
  InnerImpl() {
    lin = register_module("lin", torch::nn::Linear(3, 2));
    w = register_parameter("w", torch::randn({2, 2}));
    register_buffer("stat", torch::zeros({3}));
  }
  torch::nn::Linear lin{nullptr};
  torch::Tensor w;
};
TORCH_MODULE(Inner);

struct NestedImpl : torch::nn::Module {
  NestedImpl() {
    first = register_module("first", torch::nn::Linear(4, 3));
    scale = register_parameter("scale", torch::ones({3}));
    register_buffer("count", torch::zeros({}, torch::kLong));
    inner = register_module("inner", Inner());
    bn = register_module("bn", torch::nn::BatchNorm1d(2));
    shift = register_parameter("shift", torch::zeros({2}));
    register_buffer("mask", torch::ones({2, 2}, torch::kBool));
  }
  torch::nn::Linear first{nullptr};
  Inner inner{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor scale, shift;
};
TORCH_MODULE(Nested);

// The same module in Python (same names, shapes, dtypes, registration order).
const char* kPythonNested = R"PY(
import torch, torch.nn as nn
class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.w = nn.Parameter(torch.randn(2, 2))
        self.register_buffer("stat", torch.zeros(3))
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.inner = Inner()
        self.bn = nn.BatchNorm1d(2)
        self.shift = nn.Parameter(torch.zeros(2))
        self.register_buffer("mask", torch.ones(2, 2, dtype=torch.bool))
)PY";

const Names kNestedKeys = {"scale",         "shift",       "count",        "mask",         "first.weight",
                           "first.bias",    "inner.w",     "inner.stat",   "inner.lin.weight",
                           "inner.lin.bias", "bn.weight",  "bn.bias",      "bn.running_mean",
                           "bn.running_var", "bn.num_batches_tracked"};

// Gives every entry of a module's state a distinct deterministic value: entry k = (arange(numel) + 100 k) / 8,
// cast to its dtype (bool: odd elements true). The Python side recomputes the same.
void fill_deterministic(const StateDict& state) {
  torch::NoGradGuard no_grad;
  int64_t k = 0;
  for (const auto& [name, t] : state) {
    auto v = (torch::arange(t.numel(), torch::kDouble) + 100.0 * static_cast<double>(k++)) / 8.0;
    if (t.scalar_type() == torch::kBool) v = torch::fmod(torch::arange(t.numel(), torch::kLong), 2) == 1;
    if (t.scalar_type() == torch::kLong) v = torch::arange(t.numel(), torch::kLong) + 100 * (k - 1);
    t.copy_(v.reshape(t.sizes()).to(t.scalar_type()));
  }
}
const char* kPythonFillDeterministic = R"PY(
def deterministic(state):
    out = {}
    for k, (name, t) in enumerate(state.items()):
        if t.dtype == torch.bool:
            v = torch.arange(t.numel()) % 2 == 1
        elif t.dtype == torch.int64:
            v = torch.arange(t.numel()) + 100 * k
        else:
            v = (torch.arange(t.numel(), dtype=torch.float64) + 100.0 * k) / 8.0
        out[name] = v.reshape(t.shape).to(t.dtype)
    return out
)PY";

// A state dict of many dtypes and layouts (non-contiguous, views with a storage offset, 0-dim, empty).
// kPythonSample builds the same values in Python.
StateDict sample_state() {
  auto param = torch::arange(6, torch::kFloat).reshape({2, 3}).div(7).set_requires_grad(true);
  return {
      {"a.f32", torch::arange(12, torch::kFloat).reshape({3, 4}) / 7},
      {"b.f64", torch::arange(5, torch::kDouble) * 0.1 - 0.2},
      {"c.i64", torch::tensor({-(int64_t{1} << 40), int64_t{0}, int64_t{3}, int64_t{1} << 62}, torch::kLong)},
      {"d.bool", torch::tensor({true, false, true})},
      {"e.f16", torch::arange(6, torch::kHalf).reshape({2, 3}) / 3},
      {"f.scalar", torch::tensor(3.5f)},
      {"g.empty", torch::zeros({0, 4})},
      {"h.transposed", torch::arange(6, torch::kFloat).reshape({2, 3}).t()},
      {"i.slice", torch::arange(20, torch::kFloat).slice(0, 5, 9)},
      {"j.i32", torch::tensor({1, -2, 3}, torch::kInt)},
      {"k.u8", torch::arange(4, torch::kByte)},
      {"l.bf16", torch::arange(4, torch::kBFloat16) * 1.5},
      {"m.param", param},
      {"z.first_in_order_not_alphabetical", torch::tensor({9.0f})},
  };
}
const char* kPythonSample = R"PY(
import torch
sample = {
    "a.f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
    "b.f64": torch.arange(5, dtype=torch.float64) * 0.1 - 0.2,
    "c.i64": torch.tensor([-(1 << 40), 0, 3, 1 << 62], dtype=torch.int64),
    "d.bool": torch.tensor([True, False, True]),
    "e.f16": torch.arange(6, dtype=torch.float16).reshape(2, 3) / 3,
    "f.scalar": torch.tensor(3.5),
    "g.empty": torch.zeros(0, 4),
    "h.transposed": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
    "i.slice": torch.arange(20, dtype=torch.float32)[5:9],
    "j.i32": torch.tensor([1, -2, 3], dtype=torch.int32),
    "k.u8": torch.arange(4, dtype=torch.uint8),
    "l.bf16": torch.arange(4, dtype=torch.bfloat16) * 1.5,
    "m.param": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
    "z.first_in_order_not_alphabetical": torch.tensor([9.0]),
}
)PY";

// Python: compares a loaded object `d` against `expected` (plain dict, same key order, dtype, shape, values,
// no requires_grad); prints {"problems": [...], "checked": n}.
const char* kPythonCompare = R"PY(
import json
def compare(d, expected):
    problems = []
    if type(d) is not dict:
        problems.append(f"loaded a {type(d).__name__}, expected a plain dict")
    if list(d.keys()) != list(expected.keys()):
        problems.append(f"keys {list(d.keys())} != expected {list(expected.keys())}")
    checked = 0
    for k, v in expected.items():
        t = d.get(k)
        if not isinstance(t, torch.Tensor):
            problems.append(f"{k}: {type(t).__name__}, not a tensor")
        elif t.dtype != v.dtype or t.shape != v.shape:
            problems.append(f"{k}: {t.dtype} {list(t.shape)} != expected {v.dtype} {list(v.shape)}")
        elif not torch.equal(t, v):
            problems.append(f"{k}: values {t.tolist()} != expected {v.tolist()}")
        elif t.requires_grad:
            problems.append(f"{k}: requires_grad is set")
        else:
            checked += 1
    print(json.dumps({"problems": problems, "checked": checked}))
)PY";

void expect_same_state(const StateDict& actual, const StateDict& expected) {
  ASSERT_EQ(keys_of(actual), keys_of(expected));
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& [name, want] = expected[i];
    const auto& got = actual[i].second;
    EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), want.sizes()) << name;
    if (got.scalar_type() == want.scalar_type() && got.sizes() == want.sizes()) {
      EXPECT_TRUE(torch::equal(got, want)) << name << ": " << got << "\nexpected\n" << want;
    }
  }
}

StateDict clone_state(const StateDict& s) {
  StateDict out;
  for (const auto& [name, t] : s) out.emplace_back(name, t.detach().clone());
  return out;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace

// ---- keys and order ------------------------------------------------------------------------------------

TEST(StateDict, KeysAndOrderFollowPythonRules) {
  Nested model;
  const auto state = gradsync::state_dict(*model);
  EXPECT_EQ(keys_of(state), kNestedKeys);
  // The module's own tensors, not copies.
  EXPECT_TRUE(state[0].second.is_same(model->scale));
  EXPECT_TRUE(state[4].second.is_same(model->first->weight));
  EXPECT_TRUE(state[14].second.is_same(model->bn->num_batches_tracked));

  // Real Python for the same module: keys, order, shapes, dtypes.
  const auto py = python_json(std::string(kPythonNested) + R"PY(
import json
print(json.dumps([[k, list(v.shape), str(v.dtype)] for k, v in Nested().state_dict().items()]))
)PY");
  ASSERT_TRUE(py.is_array()) << py.dump();
  ASSERT_EQ(py.size(), state.size()) << py.dump();
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(py[i][0].get<std::string>(), state[i].first) << "position " << i;
    EXPECT_EQ(py[i][1].get<std::vector<int64_t>>(), state[i].second.sizes().vec()) << state[i].first;
    EXPECT_EQ(py[i][2].get<std::string>(), python_dtype(state[i].second.scalar_type())) << state[i].first;
  }
}

TEST(StateDict, OptionalParametersAndBuffersLeftOutAsInPython) {
  // Python leaves None parameters/buffers out of state_dict(): Linear(bias=False) has no "bias";
  // BatchNorm1d(affine=False, track_running_stats=False) has no entries at all.
  torch::nn::Sequential model(torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)),
                              torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(2).affine(false).track_running_stats(false)),
                              torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(2).affine(false)),
                              torch::nn::Linear(2, 1));
  const auto py = python_json(R"PY(
import json, torch.nn as nn
m = nn.Sequential(nn.Linear(3, 2, bias=False), nn.BatchNorm1d(2, affine=False, track_running_stats=False),
                  nn.BatchNorm1d(2, affine=False), nn.Linear(2, 1))
print(json.dumps(list(m.state_dict().keys())))
)PY");
  ASSERT_TRUE(py.is_array()) << py.dump();
  const Names expected = {"0.weight", "2.running_mean", "2.running_var", "2.num_batches_tracked", "3.weight",
                          "3.bias"};
  EXPECT_EQ(py.get<Names>(), expected);
  const auto state = gradsync::state_dict(*model);
  EXPECT_EQ(keys_of(state), expected);
  for (const auto& [name, t] : state) EXPECT_TRUE(t.defined()) << name << " is an undefined tensor";
}

// ---- files: gradsync -> Python -------------------------------------------------------------------------

TEST(StateDict, SavedFileLoadsWeightsOnlyInPythonAsAPlainDictOfIdenticalTensors) {
  TempDir dir;
  const std::string path = dir.file("sample.pt");
  gradsync::save_state_dict(sample_state(), path);
  const auto result = python_json(std::string(kPythonSample) + kPythonCompare + R"PY(
import sys
compare(torch.load(sys.argv[1], weights_only=True), sample)  # PyTorch 2.6's default
)PY", {path});
  ASSERT_TRUE(result.is_object()) << result.dump();
  EXPECT_EQ(result["problems"], nlohmann::json::array()) << result.dump(2);
  EXPECT_EQ(result["checked"].get<size_t>(), sample_state().size()) << result.dump(2);
}

TEST(StateDict, SavedModuleStateLoadsStrictlyIntoThePythonModule) {
  TempDir dir;
  const std::string path = dir.file("nested.pt");
  Nested model;
  const auto state = gradsync::state_dict(*model);
  fill_deterministic(state);
  gradsync::save_state_dict(state, path);
  const auto result = python_json(std::string(kPythonNested) + kPythonFillDeterministic + kPythonCompare + R"PY(
import sys
d = torch.load(sys.argv[1])
m = Nested()
m.load_state_dict(d, strict=True)
compare(d, deterministic(m.state_dict()))
)PY", {path});
  ASSERT_TRUE(result.is_object()) << result.dump();
  EXPECT_EQ(result["problems"], nlohmann::json::array()) << result.dump(2);
  EXPECT_EQ(result["checked"].get<size_t>(), kNestedKeys.size()) << result.dump(2);
}

// ---- files: Python -> gradsync -------------------------------------------------------------------------

TEST(StateDict, PythonSavedDictLoadsWithIdenticalTensors) {
  TempDir dir;
  const std::string path = dir.file("python.pt");
  const auto r = run_python(std::string(kPythonSample) + R"PY(
import sys
torch.save(dict(sample), sys.argv[1])
)PY", {path});
  ASSERT_TRUE(r.ok()) << r.describe();
  const auto loaded = gradsync::load_state_dict(path);
  expect_same_state(loaded, sample_state());
}

TEST(StateDict, PythonModuleStateLoadsIntoTheCppModule) {
  TempDir dir;
  const std::string path = dir.file("python_nested.pt");
  const auto r = run_python(std::string(kPythonNested) + kPythonFillDeterministic + R"PY(
import sys
m = Nested()
m.load_state_dict(deterministic(m.state_dict()))
torch.save(dict(m.state_dict()), sys.argv[1])
)PY", {path});
  ASSERT_TRUE(r.ok()) << r.describe();

  Nested expected_model;
  const auto expected = gradsync::state_dict(*expected_model);
  fill_deterministic(expected);

  Nested model;
  const auto loaded = gradsync::load_state_dict(path);
  EXPECT_EQ(keys_of(loaded), kNestedKeys);
  gradsync::load_into(*model, loaded);
  expect_same_state(gradsync::state_dict(*model), expected);
  // load_into copies into the module's existing tensors (parameters keep their identity and requires_grad).
  EXPECT_TRUE(gradsync::state_dict(*model)[0].second.is_same(model->scale));
  EXPECT_TRUE(model->scale.requires_grad());
}

TEST(StateDict, RoundTripThroughGradsyncFiles) {
  TempDir dir;
  const std::string path = dir.file("roundtrip.pt");
  gradsync::save_state_dict(sample_state(), path);
  expect_same_state(gradsync::load_state_dict(path), sample_state());

  Nested a, b;
  fill_deterministic(gradsync::state_dict(*a));
  gradsync::save_state_dict(gradsync::state_dict(*a), path);
  gradsync::load_into(*b, gradsync::load_state_dict(path));
  expect_same_state(gradsync::state_dict(*b), gradsync::state_dict(*a));
}

// ---- strict load_into ----------------------------------------------------------------------------------

TEST(StateDict, LoadIntoListsEveryMismatchAndModifiesNothing) {
  Nested model;
  const auto before = clone_state(gradsync::state_dict(*model));

  // Start from a complete, correct state (all values different from the model's), then break it.
  auto state = clone_state(gradsync::state_dict(*model));
  fill_deterministic(state);
  StateDict broken;
  for (const auto& [name, t] : state) {
    if (name == "inner.w" || name == "bn.running_var") continue;            // missing
    if (name == "first.weight") {
      broken.emplace_back(name, torch::zeros({4, 3}));                      // transposed shape
    } else if (name == "count") {
      broken.emplace_back(name, torch::zeros({1}, torch::kLong));           // 0-dim expected
    } else {
      broken.emplace_back(name, t);
    }
  }
  broken.emplace_back("inner.extra", torch::zeros({1}));  // unexpected
  broken.emplace_back("head.weight", torch::zeros({2}));  // unexpected

  const std::string msg = error_of<gradsync::ConfigError>([&] { gradsync::load_into(*model, broken); });
  for (const char* key : {"inner.w", "bn.running_var", "inner.extra", "head.weight", "first.weight", "count"}) {
    EXPECT_NE(msg.find(key), std::string::npos) << "message does not name " << key << ": " << msg;
  }
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 3]"), std::string::npos) << "file shape of first.weight: " << msg;
  EXPECT_NE(msg.find("[3, 4]"), std::string::npos) << "model shape of first.weight: " << msg;
  // Correct entries (e.g. "scale", "bn.weight") are not reported...
  EXPECT_EQ(msg.find("scale"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("bn.weight"), std::string::npos) << msg;
  // ...and were not copied either: nothing changed.
  expect_same_state(gradsync::state_dict(*model), before);

  // Only one unexpected key: still an error, still nothing modified.
  auto plus_one = state;
  plus_one.emplace_back("surplus", torch::zeros({1}));
  const std::string msg2 = error_of<gradsync::ConfigError>([&] { gradsync::load_into(*model, plus_one); });
  EXPECT_NE(msg2.find("surplus"), std::string::npos) << msg2;
  expect_same_state(gradsync::state_dict(*model), before);

  // The complete state loads, in any key order.
  StateDict reversed(state.rbegin(), state.rend());
  gradsync::load_into(*model, reversed);
  expect_same_state(gradsync::state_dict(*model), state);
}

// ---- atomic saving and errors --------------------------------------------------------------------------

TEST(StateDict, SaveIsAtomicAndLeavesNoTempFile) {
  TempDir dir;
  const std::string path = dir.file("model.pt");
  gradsync::save_state_dict(sample_state(), path);
  EXPECT_EQ(dir.entries(), Names{"model.pt"});

  // Overwriting replaces the content (rename over the old file), again without leftovers.
  const StateDict second = {{"only", torch::tensor({1.0f, 2.0f})}};
  gradsync::save_state_dict(second, path);
  EXPECT_EQ(dir.entries(), Names{"model.pt"});
  expect_same_state(gradsync::load_state_dict(path), second);

  // A relative path in the current directory works too.
  const auto cwd = fs::current_path();
  fs::current_path(dir.path());
  gradsync::save_state_dict(second, "relative.pt");
  fs::current_path(cwd);
  EXPECT_EQ(dir.entries(), (Names{"model.pt", "relative.pt"}));
  expect_same_state(gradsync::load_state_dict(dir.file("relative.pt")), second);
}

// A symlink planted where the writer makes its temp file must not redirect the write (the temp file is created
// with O_EXCL | O_NOFOLLOW under a random name), and temp files a killed writer left are removed at the next save.
TEST(StateDict, SaveNeverWritesThroughAPlantedSymlinkAndRemovesStaleTempFiles) {
  TempDir dir;
  const std::string path = dir.file("model.pt"), victim = dir.file("victim");
  write_bytes(victim, "victim");
  // The name the writer once used (<path>.tmp.<pid>), and one in today's form whose pid runs: both left alone.
  fs::create_symlink(victim, path + ".tmp." + std::to_string(::getpid()));
  write_bytes(path + ".tmp." + std::to_string(::getpid()) + ".0123", "a live writer's");
  // A killed writer's leftovers (pids beyond any pid_max): a file, and a symlink that must go without its target.
  write_bytes(path + ".tmp.999999999.deadbeef", "torn");
  fs::create_symlink(victim, path + ".tmp.999999998.cafe");
  gradsync::save_state_dict(sample_state(), path);
  EXPECT_EQ(read_bytes(victim), "victim");
  expect_same_state(gradsync::load_state_dict(path), sample_state());
  EXPECT_EQ(dir.entries(), (Names{"model.pt", "model.pt.tmp." + std::to_string(::getpid()),
                                  "model.pt.tmp." + std::to_string(::getpid()) + ".0123", "victim"}));
  // Exclusive creation never opens an existing name, dangling symlink or not.
  fs::create_symlink(dir.file("nowhere"), dir.file("dangling"));
  for (const auto& name : {dir.file("dangling"), path + ".tmp." + std::to_string(::getpid())}) {
    EXPECT_EQ(gradsync::create_exclusive(name), -1) << name;
    EXPECT_EQ(errno, EEXIST) << name;
  }
  EXPECT_FALSE(fs::exists(dir.file("nowhere")));
  EXPECT_EQ(read_bytes(victim), "victim");
}

TEST(StateDict, SaveErrorsNameThePathAndErrnoText) {
  TempDir dir;
  const StateDict state = {{"w", torch::ones({2})}};

  const std::string missing_dir = dir.file("no/such/dir/model.pt");
  std::string msg = error_of<gradsync::Error>([&] { gradsync::save_state_dict(state, missing_dir); });
  EXPECT_NE(msg.find(missing_dir), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOENT)), std::string::npos) << msg;

  write_bytes(dir.file("plain_file"), "x");
  const std::string under_file = dir.file("plain_file/model.pt");
  msg = error_of<gradsync::Error>([&] { gradsync::save_state_dict(state, under_file); });
  EXPECT_NE(msg.find(under_file), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOTDIR)), std::string::npos) << msg;

  // The target is an existing directory: the rename fails; the temp file is removed, the directory untouched.
  fs::create_directory(dir.file("is_a_dir"));
  write_bytes(dir.file("is_a_dir/keep"), "keep");
  msg = error_of<gradsync::Error>([&] { gradsync::save_state_dict(state, dir.file("is_a_dir")); });
  EXPECT_NE(msg.find(dir.file("is_a_dir")), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(EISDIR)), std::string::npos) << msg;
  EXPECT_EQ(dir.entries(), (Names{"is_a_dir", "plain_file"})) << "a temp file was left behind";
  EXPECT_EQ(read_bytes(dir.file("is_a_dir/keep")), "keep");

  // A directory without write permission (meaningless for root, who may write anyway).
  if (::geteuid() != 0) {
    fs::create_directory(dir.file("readonly"));
    fs::permissions(dir.file("readonly"), fs::perms::owner_read | fs::perms::owner_exec);
    const std::string ro = dir.file("readonly/model.pt");
    msg = error_of<gradsync::Error>([&] { gradsync::save_state_dict(state, ro); });
    EXPECT_NE(msg.find(ro), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::strerror(EACCES)), std::string::npos) << msg;
  }
}

TEST(StateDict, DamagedOrWrongFilesGiveAClearConfigError) {
  TempDir dir;
  const std::string good = dir.file("good.pt");
  gradsync::save_state_dict(sample_state(), good);
  const std::string bytes = read_bytes(good);
  ASSERT_GT(bytes.size(), 200u);

  // Cuts that leave the zip trailer (zip64 end record 56 B + locator 20 B + end record 22 B) fully missing.
  // Cuts inside the last ~40 bytes: see FileTruncatedInItsLastBytesIsRejected below.
  for (size_t keep : {size_t{0}, size_t{10}, bytes.size() / 2, bytes.size() - 100, bytes.size() - 60}) {
    const std::string path = dir.file(fmt::format("truncated_{}.pt", keep));
    write_bytes(path, bytes.substr(0, keep));
    const std::string msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << "truncated to " << keep << " bytes: " << msg;
  }

  const std::string text = dir.file("text.pt");
  write_bytes(text, "this is not a torch file\n");
  std::string msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(text); });
  EXPECT_NE(msg.find(text), std::string::npos) << msg;
  EXPECT_NE(msg.find("torch.save"), std::string::npos) << "the message says what is expected: " << msg;

  const std::string absent = dir.file("absent.pt");
  msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(absent); });
  EXPECT_NE(msg.find(absent), std::string::npos) << msg;

  // A valid torch file that holds a tensor, not a dict.
  const std::string tensor_file = dir.file("tensor.pt");
  const auto tensor_bytes = torch::pickle_save(torch::ones({3}));
  write_bytes(tensor_file, std::string(tensor_bytes.begin(), tensor_bytes.end()));
  msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(tensor_file); });
  EXPECT_NE(msg.find(tensor_file), std::string::npos) << msg;
  EXPECT_NE(msg.find("dict"), std::string::npos) << msg;

  // A dict that holds something other than tensors (Python: torch.save({"w": 3}, f)).
  c10::Dict<std::string, int64_t> ints;
  ints.insert("w", 3);
  const std::string ints_file = dir.file("ints.pt");
  const auto ints_bytes = torch::pickle_save(ints);
  write_bytes(ints_file, std::string(ints_bytes.begin(), ints_bytes.end()));
  msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(ints_file); });
  EXPECT_NE(msg.find(ints_file), std::string::npos) << msg;

  // The undamaged file still loads (the checks above are not vacuous).
  expect_same_state(gradsync::load_state_dict(good), sample_state());
}

// libtorch 1.13's pickle_load reads past the end of a zip cut inside its last ~40 bytes (the end records) and may
// then load it as if intact; load_state_dict checks the zip structure first. Loading the intact file before each
// cut one leaves its tail in the freed heap block the next buffer is likely to reuse, which is what made the
// over-read "succeed".
TEST(StateDict, FileTruncatedInItsLastBytesIsRejected) {
  TempDir dir;
  const std::string good = dir.file("good.pt");
  gradsync::save_state_dict(sample_state(), good);
  const std::string bytes = read_bytes(good);
  for (size_t cut = 1; cut <= 40; ++cut) {
    const std::string path = dir.file(fmt::format("cut_{}.pt", cut));
    write_bytes(path, bytes.substr(0, bytes.size() - cut));
    // Loading the intact file first leaves its bytes in a freed heap block of the same size, which the next
    // load's buffer is likely to reuse: what the over-read then finds there is the intact file's tail.
    gradsync::load_state_dict(good);
    const std::string msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << "cut " << cut << " bytes: " << msg;
  }
}

TEST(StateDict, PythonOrderedDictStateDictAndDdpCheckpointLoad) {
  // torch.save(model.state_dict()) writes an OrderedDict with _metadata (libtorch's own unpickler turns it into
  // None); a Python DDP checkpoint's keys start with "module.".
  TempDir dir;
  const auto r = run_python(std::string(kPythonNested) + kPythonFillDeterministic + R"PY(
import sys
from collections import OrderedDict
m = Nested()
m.load_state_dict(deterministic(m.state_dict()))
torch.save(m.state_dict(), sys.argv[1])
torch.save(OrderedDict(("module." + k, v) for k, v in m.state_dict().items()), sys.argv[2])
)PY", {dir.file("ordered.pt"), dir.file("ddp.pt")});
  ASSERT_TRUE(r.ok()) << r.describe();
  Nested model;
  const auto expected = gradsync::state_dict(*model);
  fill_deterministic(expected);
  const auto ordered = gradsync::load_state_dict(dir.file("ordered.pt"));
  EXPECT_EQ(keys_of(ordered), kNestedKeys) << "the file's order is Python's state_dict order";
  expect_same_state(ordered, expected);
  auto ddp = gradsync::load_state_dict(dir.file("ddp.pt"));
  EXPECT_EQ(gradsync::consume_prefix_in_state_dict_if_present(ddp, "module."), kNestedKeys.size());
  expect_same_state(ddp, expected);
  EXPECT_EQ(gradsync::consume_prefix_in_state_dict_if_present(ddp, "module."), 0u) << "already consumed";
}

TEST(StateDict, FileNamingAnyOtherClassIsRefusedAndNothingRuns) {
  // A weights-only reader: a pickled function or class is named in the error and never called.
  TempDir dir;
  const std::string marker = dir.file("ran");
  const auto r = run_python(R"PY(
import sys, os, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"w": torch.ones(2), "x": Evil()}, sys.argv[1])
)PY", {dir.file("evil.pt"), marker});
  ASSERT_TRUE(r.ok()) << r.describe();
  const std::string msg = error_of<gradsync::ConfigError>([&] { gradsync::load_state_dict(dir.file("evil.pt")); });
  EXPECT_NE(msg.find("'posix.system'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.file("evil.pt")), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(marker)) << "code from the file ran";
}
