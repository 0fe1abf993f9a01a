// `gradsync bench allreduce` (see bench.h): the time of gradsync's allreduce (Collectives, on its transport) next to
// the raw engine under it on the same bytes, in the same processes: a ProcessGroupGloo of c10d's own for gloo,
// MPI_Allreduce for mpi; and gradsync's allreduce of a reduction buffer, as DDP's buckets are (on MPI within a host:
// summed in shared memory). Bandwidths as nccl-tests define them: algbw = bytes / time, busbw = algbw * 2(N-1)/N.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "bench/bench.h"
#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "launch/launch.h"
#include "launch/spawn.h"

namespace gradsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Median seconds of `iterations` runs of each op, interleaved (op 0, op 1, ..., op 0, ...) so that drift in the
// machine's speed falls on all alike, each started together on every rank (a barrier first), after `warmup` runs.
template <typename Barrier>
std::vector<double> time_interleaved(const AllreduceBenchConfig& c, const std::vector<std::function<void()>>& ops,
                                     Barrier&& barrier) {
  for (int i = 0; i < c.warmup; ++i) {
    for (const auto& op : ops) op();
  }
  std::vector<std::vector<double>> seconds(ops.size());
  for (int i = 0; i < c.iterations; ++i) {
    for (size_t k = 0; k < ops.size(); ++k) {
      barrier();
      const auto start = Clock::now();
      ops[k]();
      seconds[k].push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  std::vector<double> medians;
  for (auto& s : seconds) medians.push_back(median(std::move(s)));
  return medians;
}

// c10d's ProcessGroupGloo, made here as a user of c10d would (rank 0 serves a TCPStore on MASTER_PORT, which
// `gradsync launch` reserved but gradsync's own ranks leave unused: they meet through GRADSYNC_STORE_FILE).
c10::intrusive_ptr<c10d::ProcessGroupGloo> raw_gloo(const World& world) {
  const auto addr = process_env("MASTER_ADDR"), port = process_env("MASTER_PORT");
  if (!addr || !port) throw ConfigError("bench-rank: MASTER_ADDR and MASTER_PORT must be set (by `gradsync launch`)");
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(std::stoi(*port));
  store_options.isServer = world.rank() == 0;
  store_options.numWorkers = world.size();
  store_options.timeout = world.timeout();
  auto store = c10::make_intrusive<c10d::TCPStore>(*addr, store_options);
  auto options = c10d::ProcessGroupGloo::Options::create(world.timeout());
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("raw", store),
                                                     world.rank(), world.size(), options);
}

}  // namespace

int64_t parse_byte_size(const std::string& text) {
  size_t used = 0;
  int64_t value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
  }
  const std::string suffix = text.substr(std::min(used, text.size()));
  int shift = suffix.empty() ? 0 : suffix == "K" ? 10 : suffix == "M" ? 20 : suffix == "G" ? 30 : -1;
  if (value < 1 || shift < 0 || value > (int64_t{1} << 31) >> shift || (value << shift) < 4) {
    throw ConfigError(fmt::format("--bytes: '{}' is not a size from 4 bytes to 2G (an integer, optionally with K, "
                                  "M or G: powers of 1024)", text));
  }
  return value << shift;
}

int run_allreduce_rank(const AllreduceBenchConfig& c, const std::string& out) {
  InitOptions init_options;
  init_options.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_seconds * 1000));
  auto world = init(init_options);
  const bool mpi = world->backend() == Backend::Mpi;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  if (!mpi) gloo = raw_gloo(*world);
  std::ofstream log;
  if (world->is_main()) log.open(out);
  for (const auto& size : c.sizes) {
    const int64_t bytes = parse_byte_size(size);
    auto t = torch::ones({bytes / 4}, torch::kFloat);
    auto bucket = world->comm().reduction_buffer(bytes / 4, torch::kFloat);
    auto barrier = [&] { world->comm().barrier(); };
    const auto times = time_interleaved(c, {[&] { world->comm().allreduce(t, Reduction::Sum); }, [&] {
      if (mpi) {
        MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      } else {
        std::vector<at::Tensor> list{t};
        gloo->allreduce(list)->wait();
      }
    }, [&] { world->comm().allreduce(bucket, Reduction::Sum); }}, barrier);
    const double mine = times[0], raw = times[1], in_bucket = times[2];
    const double factor = 2.0 * (world->size() - 1) / world->size();
    if (log.is_open()) {
      log << nlohmann::json{{"bytes", bytes}, {"seconds", mine}, {"raw_seconds", raw},
                            {"algbw_gbps", bytes / mine / 1e9}, {"busbw_gbps", bytes / mine / 1e9 * factor},
                            {"raw_busbw_gbps", bytes / raw / 1e9 * factor}, {"busbw_ratio", raw / mine},
                            {"bucket_seconds", in_bucket}, {"bucket_busbw_gbps", bytes / in_bucket / 1e9 * factor}}
                 .dump()
          << '\n';
    }
  }
  world->comm().barrier();
  return 0;
}

int run_allreduce_bench(const AllreduceBenchConfig& c) {
  for (const auto& size : c.sizes) parse_byte_size(size);  // every bad value before any rank starts
  TempDir dir("gradsync-bench-allreduce-");
  LaunchOptions options;
  options.nproc = c.world_size;
  options.backend = parse_backend(c.backend, "--backend");
  options.prefix_output = false;
  options.command = {self_executable(), "bench-rank", "--out", dir.file("result.jsonl"), "--bytes",
                     fmt::format("{}", fmt::join(c.sizes, ",")), "--iterations", std::to_string(c.iterations),
                     "--warmup", std::to_string(c.warmup), "--timeout", fmt::format("{}", c.timeout_seconds)};
  if (const int status = launch(options); status != 0) {
    throw Error(fmt::format("bench allreduce: the ranks failed (exit status {}; their errors are above)", status));
  }
  std::ifstream in(dir.file("result.jsonl"));
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  if (c.json) {
    fmt::print("{}\n", nlohmann::json{{"backend", c.backend}, {"world_size", c.world_size}, {"sizes", rows}}.dump(2));
    return 0;
  }
  fmt::print("gradsync bench allreduce: {} ranks, backend {}, median of {} (after {} warm-up)\n", c.world_size,
             c.backend, c.iterations, c.warmup);
  fmt::print("  {:>12} {:>10} {:>12} {:>12} {:>10} {:>14} {:>8} {:>10}\n", "bytes", "time ms", "algbw GB/s",
             "busbw GB/s", "raw ms", "raw busbw GB/s", "ratio", "bucket ms");
  for (const auto& r : rows) {
    fmt::print("  {:>12} {:>10.3f} {:>12.2f} {:>12.2f} {:>10.3f} {:>14.2f} {:>8.3f} {:>10.3f}\n",
               r["bytes"].get<int64_t>(), 1e3 * r["seconds"].get<double>(), r["algbw_gbps"].get<double>(),
               r["busbw_gbps"].get<double>(), 1e3 * r["raw_seconds"].get<double>(), r["raw_busbw_gbps"].get<double>(),
               r["busbw_ratio"].get<double>(), 1e3 * r["bucket_seconds"].get<double>());
  }
  return 0;
}

}  // namespace gradsync::cli
