// defines: Strategy, the engine `gradsync train --strategy` trains with, parsed once from its CLI spelling.
#pragma once
#include <map>
#include <string>

namespace gradsync::cli {

enum class Strategy {
  Local,        // one process, no communication (LocalEngine)
  Ddp,          // DistributedDataParallel
  FsdpFull,     // FullyShardedDataParallel, FULL_SHARD (ZeRO-3)
  FsdpGradOp,   // FullyShardedDataParallel, SHARD_GRAD_OP (ZeRO-2)
  FsdpNoShard,  // FullyShardedDataParallel, NO_SHARD
  Hsdp,         // FullyShardedDataParallel, HYBRID_SHARD: full shard in a shard group, replicated across R groups
  HsdpGradOp,   // FullyShardedDataParallel, HYBRID_SHARD_GRAD_OP
  Zero1,        // Zero1DataParallel
};

// "local", "ddp", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "hsdp", "hsdp-grad-op", "zero1": the CLI's spelling, for CLI11's
// CheckedTransformer and for messages.
const std::map<std::string, Strategy>& strategy_names();
std::string to_string(Strategy strategy);

bool is_fsdp(Strategy strategy);
bool is_hybrid(Strategy strategy);   // hsdp, hsdp-grad-op: --replicas applies
bool is_sharded(Strategy strategy);  // FSDP (any) or ZeRO-1: parameters() are shards
// After optimizer.step() every rank's module holds the whole updated parameters (ddp, fsdp-no-shard); the others
// hold shards, or (zero1) the whole parameters only once the next forward gathers them.
bool holds_replicas(Strategy strategy);

}  // namespace gradsync::cli
