// The strategies of `gradsync train` (see strategy.h).
#include "train/strategy.h"

namespace gradsync::cli {

const std::map<std::string, Strategy>& strategy_names() {
  static const std::map<std::string, Strategy> names{
      {"local", Strategy::Local},          {"ddp", Strategy::Ddp},
      {"fsdp-full", Strategy::FsdpFull},   {"fsdp-grad-op", Strategy::FsdpGradOp},
      {"fsdp-no-shard", Strategy::FsdpNoShard}, {"zero1", Strategy::Zero1},
      {"hsdp", Strategy::Hsdp},            {"hsdp-grad-op", Strategy::HsdpGradOp},
  };
  return names;
}

std::string to_string(Strategy strategy) {
  for (const auto& [name, value] : strategy_names()) {
    if (value == strategy) return name;
  }
  return "?";
}

bool is_hybrid(Strategy s) { return s == Strategy::Hsdp || s == Strategy::HsdpGradOp; }
bool is_fsdp(Strategy s) {
  return s == Strategy::FsdpFull || s == Strategy::FsdpGradOp || s == Strategy::FsdpNoShard || is_hybrid(s);
}
bool is_sharded(Strategy s) { return is_fsdp(s) || s == Strategy::Zero1; }
bool holds_replicas(Strategy s) { return s == Strategy::Ddp || s == Strategy::FsdpNoShard; }

}  // namespace gradsync::cli
