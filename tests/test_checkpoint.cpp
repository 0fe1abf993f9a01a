// Tests for include/gradsync/checkpoint.h: a checkpoint restores training bit for bit (model, optimizer state,
// DDP's bucket order, generator state); torn, damaged and foreign checkpoints are never resumed; a writer SIGKILLed
// at random points never leaves an unloadable checkpoint; ranks that see different checkpoints fail naming them.
// The Faults* tests belong to ctest's `faults` label.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/checkpoint_files.h"
#include "gradsync/checkpoint.h"
#include "gradsync/ddp.h"
#include "gradsync/error.h"
#include "gradsync/local.h"
#include "support/error_of.h"
#include "support/fault_record.h"
#include "support/subprocess.h"
#include "support/test_models.h"
#include "support/worker.h"

namespace fs = std::filesystem;
namespace t = gradsync::test;
namespace s = gradsync::test::sharding;
using gradsync::Checkpoints;

namespace {

// A small model, its local engine and Adam, stepped on data that changes every step.
struct Trainer {
  torch::nn::Sequential model = s::make_mlp("6-9-4", false, 3);
  gradsync::LocalEngine engine{model};
  std::unique_ptr<torch::optim::Optimizer> optimizer = s::make_optimizer("adam", engine.parameters());

  void steps(int64_t from, int64_t to) {
    for (int64_t k = from; k < to; ++k) {
      auto [x, y] = s::global_batch(k, 8, 6, 4);
      engine.zero_grad();
      torch::nn::functional::cross_entropy(engine.forward(x), y).backward();
      optimizer->step();
    }
  }
};

bool equal(const gradsync::StateDict& a, const gradsync::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !torch::equal(a[i].second, b[i].second)) return false;
  }
  return true;
}

void flip_byte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.get(c);
  f.seekp(at);
  f.put(static_cast<char>(c ^ 0x10));
}

}  // namespace

TEST(Checkpoints, LoadingContinuesTrainingBitForBitWithTheGeneratorWhereItWas) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-");
  Trainer a;
  a.steps(0, 3);
  Checkpoints(dir, nullptr).save(3, a.engine, *a.optimizer, {{"note", "three"}});
  const auto draw = torch::rand({4});  // what the generator gives right after the save
  a.steps(3, 6);

  torch::manual_seed(99);  // a different generator state and a different model
  Trainer b;
  b.model->parameters()[0].data().add_(1.0);
  Checkpoints checkpoints(dir, nullptr);
  const auto latest = checkpoints.latest();
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->step, 3);
  EXPECT_EQ(latest->meta.at("note"), "three");
  EXPECT_EQ(latest->engine, "LocalEngine");
  checkpoints.load(*latest, b.engine, *b.optimizer);
  EXPECT_TRUE(torch::equal(torch::rand({4}), draw));
  b.steps(3, 6);
  EXPECT_TRUE(equal(gradsync::state_dict(*b.model), gradsync::state_dict(*a.model)));
  fs::remove_all(dir);
}

TEST(Checkpoints, DamagedTornAndForeignCheckpointsAreNeverResumed) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-");
  Trainer a;
  Checkpoints checkpoints(dir, nullptr);
  for (int64_t step = 1; step <= 5; ++step) checkpoints.save(step, a.engine, *a.optimizer);
  const auto path = [&](int64_t step) { return fs::path(checkpoints.list().at(static_cast<size_t>(step - 1)).path); };
  flip_byte(path(5) / "optim.pt", 100);                                  // a bit flip
  fs::resize_file(path(4) / "model.pt", fs::file_size(path(4) / "model.pt") - 3);  // truncation
  fs::remove(path(3) / "rng.pt");                                      // a missing file
  std::ofstream(path(2) / "manifest.json") << "{\"format\": \"gradsync-checkpoint\"";  // a torn manifest
  auto latest = checkpoints.latest();
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->step, 1);
  // What a killed writer leaves: a directory without a manifest, a temp file. Removed by the next start.
  fs::create_directory(fs::path(dir) / "step-000000000009");
  std::ofstream(fs::path(dir) / "step-000000000009" / "model.pt") << "half";
  std::ofstream(fs::path(dir) / "step-000000000001" / "model.pt.tmp.999999999.0123456789abcdef") << "half";
  Checkpoints again(dir, nullptr);
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-000000000009"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-000000000001" / "model.pt.tmp.999999999.0123456789abcdef"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "damaged-step-000000000005" / "optim.pt")) << "kept aside for inspection";
  EXPECT_EQ(again.latest()->step, 1);
  // A file that changed after latest() checked it is refused, naming it, before it is parsed.
  const auto err = t::error_of<gradsync::ConfigError>([&] {
    auto info = *again.latest();
    Trainer b;
    std::ofstream(info.path + "/model.pt", std::ios::binary | std::ios::trunc) << "PK\x03\x04 not a zip";
    again.load(info, b.engine, *b.optimizer);
  });
  EXPECT_NE(err.find("model.pt"), std::string::npos) << err;
  EXPECT_NE(err.find("the manifest lists"), std::string::npos) << err;
  fs::remove_all(dir);
}

TEST(Checkpoints, KeepLeavesTheNewestAndAStepSavedAgainReplacesIt) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-");
  Trainer a;
  Checkpoints checkpoints(dir, nullptr, /*keep=*/2);
  for (int64_t step : {2, 4, 6, 8}) checkpoints.save(step, a.engine, *a.optimizer);
  auto list = checkpoints.list();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].step, 6);
  EXPECT_EQ(list[1].step, 8);
  a.steps(0, 1);
  checkpoints.save(8, a.engine, *a.optimizer, {{"again", "yes"}});
  EXPECT_EQ(checkpoints.latest()->meta.at("again"), "yes");
  EXPECT_NE(t::error_of<gradsync::Error>([&] { Checkpoints(dir + "/step-000000000008/model.pt/x", nullptr); })
                .find("model.pt"),
            std::string::npos);
  fs::remove_all(dir);
}

// A checkpoint whose model.pt is a pickle that would run a command, with a manifest that vouches for it (size and
// CRC-32 rewritten): loading it is refused naming the file and the class, and the command never runs.
TEST(FaultsCheckpoint, APickleThatWouldRunCodeIsRefusedNamingTheFileAndNothingRuns) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-evil-");
  Trainer a;
  Checkpoints checkpoints(dir, nullptr);
  const auto info = checkpoints.save(1, a.engine, *a.optimizer);
  const std::string marker = dir + "/code-ran", model = info.path + "/model.pt";
  const auto py = t::run({GRADSYNC_PYTHON, "-c",
                          "import os, sys, torch\n"
                          "class Evil:\n    def __reduce__(self):\n        return (os.system, ('touch ' + sys.argv[2],))\n"
                          "torch.save({'0.weight': Evil()}, sys.argv[1])\n",
                          model, marker});
  ASSERT_TRUE(py.ok()) << py.describe();
  auto manifest = gradsync::read_manifest(info.path + "/manifest.json");
  for (auto& entry : manifest.files) {
    if (entry.name == "model.pt") entry = gradsync::entry_for("model.pt", gradsync::read_file_bytes(model));
  }
  const auto bytes = gradsync::encode_manifest(manifest);
  std::ofstream(info.path + "/manifest.json", std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  const auto latest = checkpoints.latest();  // the checksums agree: it is the one to resume
  ASSERT_TRUE(latest);
  Trainer b;
  const auto err = t::error_of<gradsync::ConfigError>([&] { checkpoints.load(*latest, b.engine, *b.optimizer); });
  const bool named = err.find(model) != std::string::npos && err.find("posix.system") != std::string::npos;
  EXPECT_TRUE(named) << err;
  EXPECT_FALSE(fs::exists(marker));
  t::record_faults({1, named ? 1 : 0, 0, 0, 0, 0, 0, fs::exists(marker) ? 1 : 0});
  fs::remove_all(dir);
}

// One process saving checkpoint after checkpoint until it is killed (it starts where the last one stopped).
GRADSYNC_WORKER(checkpoint_writer) {
  Trainer a;
  Checkpoints checkpoints(args.at(0), nullptr, /*keep=*/3);  // pruning runs at random kill points too
  const auto latest = checkpoints.latest();
  for (int64_t step = latest ? latest->step + 1 : 1;; ++step) {
    a.steps(step - 1, step);
    checkpoints.save(step, a.engine, *a.optimizer);
  }
}

TEST(FaultsCheckpoint, AWriterKilledAtRandomPointsNeverLeavesAnUnloadableCheckpoint) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-kill-");
  std::mt19937 random(20261201);
  int kills = 0, torn_removed = 0, loaded = 0;
  for (int trial = 0; trial < 10; ++trial) {
    t::CommandOptions o;
    o.timeout = std::chrono::seconds(60);
    auto writer = t::Process::start(t::worker_argv("checkpoint_writer", {dir}), o);
    // Once this attempt has saved (a newer step has a manifest), a random moment later.
    const auto newest = [&] {
      std::string name;
      for (const auto& e : fs::directory_iterator(dir)) {
        const auto n = e.path().filename().string();
        if (n.rfind("step-", 0) == 0 && fs::exists(e.path() / "manifest.json")) name = std::max(name, n);
      }
      return name;
    };
    const std::string before = newest();
    while (newest() <= before && !writer.poll()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::microseconds(random() % 300000));
    writer.signal(SIGKILL);
    const auto r = writer.wait();
    ASSERT_EQ(r.term_signal, SIGKILL) << r.describe();
    ++kills;
    for (const auto& entry : fs::directory_iterator(dir)) {
      torn_removed += entry.is_directory() && !fs::exists(entry.path() / "manifest.json");
    }
    Checkpoints checkpoints(dir, nullptr);  // removes what the writer left
    const auto latest = checkpoints.latest();
    ASSERT_TRUE(latest) << "trial " << trial;
    for (const auto& info : checkpoints.list()) {  // every complete checkpoint loads
      Trainer b;
      ASSERT_NO_THROW(checkpoints.load(info, b.engine, *b.optimizer)) << info.path;
      ++loaded;
    }
  }
  fmt::print("faults: checkpoint writer killed {} times; {} torn checkpoint directories removed; {} complete "
             "checkpoints loaded, 0 unloadable\n", kills, torn_removed, loaded);
  t::record_faults({kills, kills, 0, 0, 0, 0, 0, 0});  // each kill left only loadable checkpoints (asserted)
  fs::remove_all(dir);
}

// Disk full, as RLIMIT_FSIZE makes it: the save fails naming the file and errno, the previous checkpoint stays
// the one to resume, and nothing torn is left for it.
GRADSYNC_WORKER(checkpoint_disk_full) {
  Trainer a;
  Checkpoints checkpoints(args.at(0), nullptr);
  checkpoints.save(1, a.engine, *a.optimizer);
  ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing the process
  rlimit limit{1000, 1000};
  WORKER_CHECK(::setrlimit(RLIMIT_FSIZE, &limit) == 0, "setrlimit");
  std::string err = "did not throw";
  try {
    checkpoints.save(2, a.engine, *a.optimizer);
  } catch (const gradsync::Error& e) {
    err = e.what();
  }
  WORKER_CHECK(err.find("step-000000000002/model.pt") != std::string::npos, "{}", err);
  WORKER_CHECK(err.find("File too large (errno 27)") != std::string::npos, "{}", err);
  WORKER_CHECK(Checkpoints(args.at(0), nullptr).latest()->step == 1, "the previous checkpoint must stay");
  return 0;
}

TEST(FaultsCheckpoint, ADiskFullDuringASaveNamesTheFileAndErrnoAndKeepsThePreviousCheckpoint) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-full-");
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(60);
  const auto r = t::run(t::worker_argv("checkpoint_disk_full", {dir}), o);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_FALSE(fs::exists(fs::path(dir) / "step-000000000002" / "manifest.json"));
  t::record_faults({1, r.ok() ? 1 : 0, r.timed_out ? 1 : 0, 0, 0, 0, 0, 0});
  fs::remove_all(dir);
}

// Each rank resumes from its own directory: rank 1's holds another step.
GRADSYNC_WORKER(checkpoint_disagreement) {
  auto world = s::join();
  auto model = s::make_mlp("6-9-4", false, 3);
  gradsync::DistributedDataParallel ddp(model, world);
  auto optimizer = s::make_optimizer("sgd", ddp.parameters());
  const std::string dir = fmt::format("{}/rank{}", args.at(0), world->rank());
  Checkpoints checkpoints(dir, nullptr);  // alone: each rank writes its own
  checkpoints.save(world->rank() == 1 ? 7 : 5, ddp, *optimizer);
  std::string err = "did not throw";
  try {
    Checkpoints(dir, &world->comm()).latest();
  } catch (const gradsync::ConfigError& e) {
    err = e.what();
  }
  WORKER_CHECK(err.find("ranks disagree on the checkpoint") != std::string::npos, "{}", err);
  WORKER_CHECK(err.find("rank 1: " + args.at(0) + "/rank1/step-000000000007") != std::string::npos, "{}", err);
  WORKER_CHECK(err.find("rank 0: " + args.at(0) + "/rank0/step-000000000005") != std::string::npos, "{}", err);
  return 0;
}

TEST(FaultsCheckpoint, RanksThatSeeDifferentCheckpointsFailNamingThemAndTheirCheckpoints) {
  const auto dir = t::make_temp_dir("gradsync-ckpt-ranks-");
  t::CommandOptions o;
  o.timeout = std::chrono::seconds(90);
  int clean = 0, hangs = 0;
  for (const auto& r : t::run_ranks(3, t::worker_argv("checkpoint_disagreement", {dir}), o)) {
    EXPECT_TRUE(r.ok()) << r.describe();
    clean += r.ok();
    hangs += r.timed_out;
  }
  t::record_faults({3, clean, hangs, 0, 0, 0, 0, 0});
  fs::remove_all(dir);
}
