// `gradsync launch`: the subcommand's options, turned into LaunchOptions and handed to launch().
//
// -n, --master-port, --max-restarts and --grace-period are read as strings and converted here, not by CLI11, so that a bad
// value gets the launcher's own report (the option, the value as typed, the allowed range, then the usage;
// exit status 2) and integers are decimal: CLI11 2.1 converts with base 0, reading "010" as 8.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "gradsync/error.h"
#include "launch/backend_flag.h"
#include "launch/launch.h"

namespace gradsync::cli {
namespace {

constexpr const char* kUsage = "usage: gradsync launch -n N [--nnodes M --node-rank R | --nnodes MIN:MAX "
                               "--rdzv-endpoint HOST:PORT] [--master-addr A] [--master-port P] [--grace-period SECONDS] "
                               "[--max-restarts R] [--no-prefix] [--backend gloo|mpi] -- CMD [ARGS...]";

struct CliArgs {
  std::string nproc = "1";
  std::string nnodes = "1";
  std::string node_rank = "0";
  bool standalone = false;
  bool no_python = false;
  std::string master_addr = "127.0.0.1";
  std::string master_port = "0";
  std::string grace = "5";
  std::string max_restarts = "0";
  std::string rdzv_endpoint, rdzv_id = "none", rdzv_backend = "c10d";
  std::string rdzv_timeout = "600", last_call = "30";
  bool no_prefix = false;
  std::string backend;
  std::vector<std::string> command;
};

std::optional<long> parse_long(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0') return std::nullopt;
  return value;
}

int parse_int_in(const std::string& text, const char* option, long lo, long hi, const char* note = "") {
  auto value = parse_long(text);
  if (!value || *value < lo || *value > hi) {
    throw ConfigError(fmt::format("{} must be an integer from {} to {}{}, got '{}'", option, lo, hi, note, text));
  }
  return static_cast<int>(*value);
}

std::chrono::milliseconds parse_seconds(const std::string& text, const char* option) {
  char* end = nullptr;
  double seconds = text.empty() ? -1 : std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(seconds) || seconds < 0 || seconds > 86400) {
    throw ConfigError(fmt::format("{} must be a number of seconds from 0 to 86400, got '{}'", option, text));
  }
  return std::chrono::milliseconds(static_cast<long>(std::llround(seconds * 1000)));
}

// --nnodes N, or MIN:MAX (elastic): torchrun's syntax.
void parse_nnodes(const std::string& text, LaunchOptions& o) {
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    o.nnodes = parse_int_in(text, "--nnodes", 1, kMaxNproc);
    return;
  }
  const auto bad = [&] {
    return ConfigError(fmt::format("--nnodes MIN:MAX needs integers 1 <= MIN <= MAX <= {}, got '{}'", kMaxNproc, text));
  };
  const auto lo = parse_long(text.substr(0, colon)), hi = parse_long(text.substr(colon + 1));
  if (!lo || !hi || *lo < 1 || *hi < *lo || *hi > kMaxNproc) throw bad();
  o.min_nodes = static_cast<int>(*lo);
  o.max_nodes = static_cast<int>(*hi);
}

LaunchOptions to_options(const CliArgs& a) {
  LaunchOptions o;
  o.nproc = parse_int_in(a.nproc, "-n/--nproc-per-node", 1, kMaxNproc);
  parse_nnodes(a.nnodes, o);
  if (o.min_nodes > 0 && a.node_rank != "0") {
    throw ConfigError(fmt::format("--node-rank {} with --nnodes {}: an elastic job numbers its nodes itself at every "
                                  "rendezvous; drop --node-rank", a.node_rank, a.nnodes));
  }
  o.node_rank = parse_int_in(a.node_rank, "--node-rank", 0, o.nnodes - 1,
                             fmt::format(" (one less than --nnodes {})", o.nnodes).c_str());
  if (a.standalone && o.nnodes > 1) {
    throw ConfigError(fmt::format("--standalone is one node; it cannot be combined with --nnodes {}", o.nnodes));
  }
  o.master_addr = a.master_addr;
  o.master_port = parse_int_in(a.master_port, "--master-port", 0, 65535, " (0: pick a free port)");
  o.grace = parse_seconds(a.grace, "--grace-period");
  o.max_restarts = parse_int_in(a.max_restarts, "--max-restarts", 0, kMaxRestarts);
  o.rdzv_endpoint = a.rdzv_endpoint;
  o.rdzv_id = a.rdzv_id;
  o.rdzv_timeout = parse_seconds(a.rdzv_timeout, "--rdzv-timeout");
  o.last_call = parse_seconds(a.last_call, "--rdzv-last-call");
  o.prefix_output = !a.no_prefix;
  o.command = a.command;
  o.backend = backend_of(a.backend);
  validate(o);
  return o;
}

}  // namespace

void add_launch_command(CLI::App& root, int& exit_code) {
  auto args = std::make_shared<CliArgs>();
  CLI::App* sub = root.add_subcommand(
      "launch",
      "Run CMD as N local ranks (torchrun --standalone --nproc_per_node N --no_python), or as this node's N "
      "ranks of a job of --nnodes launchers: sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, "
      "GRADSYNC_STORE_FILE (one node), ...; prefixes output with [rank<r>]; stops all ranks when one fails and "
      "exits with its status. With --nnodes MIN:MAX the job is elastic: it re-forms when a node is lost or joins. "
      "Put `--` before CMD.");
  // torchrun's spellings (--nproc_per_node, --node_rank, ...) are accepted beside gradsync's.
  sub->add_option("-n,--nproc-per-node,--nproc_per_node", args->nproc, "ranks on this node, 1..1024 (default 1)");
  sub->add_option("--nnodes", args->nnodes,
                  "launchers (nodes) forming one job, 1..1024 (default 1); every launcher needs the same "
                  "--nnodes, --nproc-per-node, --master-addr and --master-port, and its own --node-rank. MIN:MAX: "
                  "an elastic job of MIN to MAX nodes meeting at --rdzv-endpoint, re-formed when a node is lost "
                  "or joins (with --max-restarts failures)");
  sub->add_option("--rdzv-endpoint,--rdzv_endpoint", args->rdzv_endpoint,
                  "HOST:PORT where an elastic job's launchers meet (default --master-addr:--master-port); the "
                  "launcher on HOST serves the rendezvous there, with GRADSYNC_STORE_TOKEN if set, and is the one "
                  "node the job cannot lose");
  sub->add_option("--rdzv-id,--rdzv_id", args->rdzv_id, "the elastic job's name at the rendezvous (default none)");
  sub->add_option("--rdzv-backend,--rdzv_backend", args->rdzv_backend, "accepted for torchrun compatibility: c10d")
      ->check(CLI::IsMember({"c10d"}));
  sub->add_option("--rdzv-timeout", args->rdzv_timeout,
                  "seconds a round may take to gather MIN nodes before every launcher gives up (default 600)");
  sub->add_option("--rdzv-last-call", args->last_call,
                  "seconds to wait for more nodes once MIN have joined a round (default 30)");
  sub->add_option("--node-rank,--node_rank", args->node_rank,
                  "this launcher's node, 0..nnodes-1 (default 0): its ranks are node_rank * nproc_per_node + i");
  sub->add_option("--master-addr,--master_addr", args->master_addr,
                  "MASTER_ADDR for the ranks: the host of node 0 (default 127.0.0.1)");
  sub->add_option("--master-port,--master_port", args->master_port,
                  "MASTER_PORT for the ranks, 0..65535 (default 0: a free port; required with --nnodes > 1)");
  sub->add_flag("--standalone", args->standalone, "one node with its own store (torchrun's flag; the default)");
  sub->add_flag("--no-python,--no_python", args->no_python,
                "accepted for torchrun compatibility: CMD always runs as given");
  sub->add_option("--grace-period", args->grace, "seconds between SIGTERM and SIGKILL when stopping (default 5)");
  sub->add_option("--max-restarts,--max_restarts", args->max_restarts,
                  "restart the whole group this many times after a rank fails, 0..1000 (default 0), with "
                  "TORCHELASTIC_RESTART_COUNT set; the ranks resume from their checkpoint (train --resume)");
  sub->add_flag("--no-prefix", args->no_prefix, "do not prefix output lines with [rank<r>]");
  add_backend_flag(sub, args->backend)
      ->description("gloo: start the ranks here, torchrun's way (default); mpi: run CMD under `mpirun -np N` "
                    "(output tagged [1,<rank>]<stdout>: by mpirun)");
  sub->add_option("command", args->command, "the command to run (after --) and its arguments");
  sub->callback([args, &exit_code] {
    LaunchOptions options;
    try {
      options = to_options(*args);
    } catch (const ConfigError& e) {
      fmt::print(stderr, "gradsync launch: error: {}\n{}\n", e.what(), kUsage);
      exit_code = 2;
      return;
    }
    exit_code = launch(options);
  });
}

}  // namespace gradsync::cli
