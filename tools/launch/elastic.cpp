// `gradsync launch --nnodes MIN:MAX` (see elastic.h): rounds of membership, and this node's ranks run in each.
#include "launch/elastic.h"

#include <algorithm>
#include <cstdlib>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "launch/elastic_rendezvous.h"

namespace gradsync::cli {
namespace {

constexpr const char* kGrow = "grow: a node is waiting to join";
// A round that ended so is not started again (the host aborts the next one).
constexpr const char* kNotRestartable = "failed (not restartable)";

bool is_failure(const std::string& end) { return end.rfind("grow:", 0) != 0; }

std::vector<ElasticNode> minus(const std::vector<ElasticNode>& a, const std::vector<ElasticNode>& b) {
  std::vector<ElasticNode> out;
  for (const auto& n : a) {
    if (std::find(b.begin(), b.end(), n) == b.end()) out.push_back(n);
  }
  return out;
}

std::string listed(const std::vector<ElasticNode>& nodes) {
  std::vector<std::string> out;
  for (const auto& n : nodes) out.push_back(n.name());
  return fmt::format("{}", fmt::join(out, ", "));
}

// What changed since the last round, for the ranks (GRADSYNC_ELASTIC_CHANGE) and the round's report.
std::string change(const Membership& m, const std::vector<ElasticNode>& previous) {
  if (previous.empty()) return "";
  std::vector<std::string> parts;
  if (const auto lost = minus(previous, m.nodes); !lost.empty()) parts.push_back("lost " + listed(lost));
  if (const auto joined = minus(m.nodes, previous); !joined.empty()) parts.push_back("joined " + listed(joined));
  return parts.empty() ? "the same nodes" : fmt::format("{}", fmt::join(parts, "; "));
}

void announce(const Membership& m, const LaunchOptions& o, const std::string& changed, const std::string& after) {
  const int first = m.node_rank * o.nproc;
  std::string line = fmt::format("round {}: {} node(s), {} ranks: {}; this node is node {} (ranks {}-{})", m.round,
                                 m.nodes.size(), m.nodes.size() * static_cast<size_t>(o.nproc), listed(m.nodes),
                                 m.node_rank, first, first + o.nproc - 1);
  if (!changed.empty()) line += "; " + changed;
  if (!after.empty()) {
    line += fmt::format("; after round {} ended ({})", m.round - 1, after);
    if (is_failure(after)) line += fmt::format(", restart {} of {}", m.restarts, o.max_restarts);
  }
  report_line(line);
}

// This node's part of round m, as a fixed --nnodes launch would run it.
LaunchOptions round_options(const LaunchOptions& elastic, const Membership& m, const Endpoint& endpoint,
                            const std::string& changed) {
  LaunchOptions o = elastic;
  o.min_nodes = o.max_nodes = 0;
  o.nnodes = static_cast<int>(m.nodes.size());
  o.node_rank = m.node_rank;
  o.master_addr = endpoint.host;  // node 0 is the endpoint's host, and its rank 0 serves the ranks' store
  o.master_port = m.master_port;
  o.restart_count = m.restarts;  // the host's count: the ranks' store keys include it, so every node's must agree
  o.extra_env.insert(o.extra_env.begin(), {{"TORCHELASTIC_RUN_ID", elastic.rdzv_id},
                                           {"GRADSYNC_ELASTIC_ROUND", std::to_string(m.round)},
                                           {"GRADSYNC_ELASTIC_CHANGE", changed}});
  return o;
}

class ElasticAgent {
 public:
  explicit ElasticAgent(const LaunchOptions& o) : options_(o), rdzv_(o) {}

  int run() {
    int round = rdzv_.hosting() ? 0 : -1;  // a client starts at whichever round is open
    for (;;) {
      const Membership m = rdzv_.join(round, {previous_, restarts_, give_up(round)});
      if (m.nodes.empty()) {
        report_line("the job finished before this node could join it");
        return 0;
      }
      const std::string changed = change(m, previous_);
      announce(m, options_, changed, last_end_);
      const GroupResult group = run_group(round_options(options_, m, rdzv_.endpoint(), changed),
                                          [&] { return watch(m); });
      if (!store_error_.empty()) throw DistributedError(store_error_);
      round = m.round + 1;
      previous_ = m.nodes;
      if (const auto code = after_round(m, group)) return *code;
    }
  }

 private:
  // The round's end as every launcher sees it; a value when this launcher is done.
  std::optional<int> after_round(const Membership& m, const GroupResult& group) {
    const std::string me = m.nodes[static_cast<size_t>(m.node_rank)].name();
    if (!group.interrupted.empty()) {
      last_end_ = group.interrupted;
    } else if (group.code == 0) {
      if (rdzv_.finish(m)) return 0;
      last_end_ = rdzv_.ended(m.round);
    } else if (group.signalled) {
      rdzv_.end(m.round, fmt::format("failed: the launcher of node {} was stopped by a signal", me));
      return group.code;
    } else {
      const char* kind = group.code == kExitConfigError ? kNotRestartable : "failed";
      last_end_ = rdzv_.end(m.round, fmt::format("{}: node {}: {}", kind, me, group.first_failure));
    }
    if (is_failure(last_end_)) restarts_ = m.restarts + 1;  // the host's count is the one every node is sent
    return std::nullopt;
  }

  // The host's verdict before round `round` (empty: go on): out of restarts, or a failure no restart mends.
  std::string give_up(int round) const {
    if (!rdzv_.hosting() || last_end_.empty()) return "";
    if (last_end_.rfind(kNotRestartable, 0) == 0) {
      return fmt::format("not restarting: round {} ended ({}); a rank's configuration error comes back at every "
                         "restart", round - 1, last_end_);
    }
    if (restarts_ > options_.max_restarts) {
      return fmt::format("giving up after {} restart(s): round {} ended ({})", options_.max_restarts, round - 1,
                         last_end_);
    }
    return "";
  }

  // Polled while the ranks run: the round ended elsewhere, or (the host) a newcomer waits and there is room.
  std::string watch(const Membership& m) {
    try {
      if (auto end = rdzv_.ended(m.round); !end.empty()) return end;
      const bool room = static_cast<int>(m.nodes.size()) < options_.max_nodes;
      if (rdzv_.hosting() && room && rdzv_.waiting(m.round) > 0) return rdzv_.end(m.round, kGrow);
    } catch (const std::exception& e) {
      store_error_ = error_text(e);
      return "the rendezvous store failed";
    }
    return "";
  }

  const LaunchOptions& options_;
  ElasticRendezvous rdzv_;
  std::vector<ElasticNode> previous_;
  std::string last_end_;
  std::string store_error_;
  int restarts_ = 0;  // failed rounds so far: the host's decides; a client's only follows what the host sent
};

}  // namespace

Endpoint endpoint_of(const LaunchOptions& o) {
  if (o.rdzv_endpoint.empty()) return {o.master_addr, o.master_port};
  const std::string& e = o.rdzv_endpoint;
  const auto colon = e.rfind(':');
  std::string host = colon == std::string::npos ? "" : e.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port = colon == std::string::npos ? "" : e.substr(colon + 1);
  char* end = nullptr;
  const long value = port.empty() ? 0 : std::strtol(port.c_str(), &end, 10);
  if (host.empty() || port.empty() || *end != '\0' || value < 1 || value > 65535) {
    throw ConfigError(fmt::format("--rdzv-endpoint must be HOST:PORT with a port from 1 to 65535 (e.g. "
                                  "10.0.0.1:29400), got '{}'", e));
  }
  return {host, static_cast<int>(value)};
}

void validate_elastic(const LaunchOptions& o) {
  if (o.max_nodes < o.min_nodes || o.max_nodes > kMaxNproc) {
    throw ConfigError(fmt::format("--nnodes MIN:MAX needs 1 <= MIN <= MAX <= {}, got '{}:{}'", kMaxNproc, o.min_nodes,
                                  o.max_nodes));
  }
  if (o.backend == Backend::Mpi) {
    throw ConfigError("--nnodes MIN:MAX with --backend mpi: mpirun's jobs have a fixed size; use the gloo backend");
  }
  if (o.rdzv_endpoint.empty() && o.master_port == 0) {
    throw ConfigError(fmt::format("--nnodes {}:{} needs --rdzv-endpoint HOST:PORT (or --master-addr and "
                                  "--master-port): where every launcher meets", o.min_nodes, o.max_nodes));
  }
  (void)endpoint_of(o);       // throws naming a malformed --rdzv-endpoint
  (void)read_store_token();  // and a GRADSYNC_STORE_TOKEN the rendezvous could not use
  if (o.rdzv_id.empty() || o.rdzv_id.find_first_of("/ \t\n") != std::string::npos) {
    throw ConfigError(fmt::format("--rdzv-id must be a non-empty name without '/' or white space, got '{}'",
                                  o.rdzv_id));
  }
  if (o.rdzv_timeout.count() <= 0) {
    throw ConfigError(fmt::format("--rdzv-timeout must be > 0 seconds, got {} ms", o.rdzv_timeout.count()));
  }
}

int launch_elastic(const LaunchOptions& options) {
  try {
    return ElasticAgent(options).run();
  } catch (const RendezvousAborted& e) {
    report_line(e.what());
  } catch (const std::exception& e) {
    report_line(fmt::format("{}; the elastic job cannot go on without the rendezvous host (the launcher at "
                            "--rdzv-endpoint), or this node's link to it is cut", error_text(e)));
  }
  return 1;
}

}  // namespace gradsync::cli
