// defines: sharded checkpoints: every rank writes and reads only what it owns, its parameter shards and the
// optimizer state of those shards, to DIR/shard-<rank>-of-<N>.pt. No rank ever holds the whole model.
//
// File format (encode_torch_file of a dict, common/torch_file.h: torch.load(f, weights_only=True) reads it as nested
// dicts):
//   {"format": "gradsync-sharded/1", "kind": "fsdp:full_shard" | "zero1" | ..., "rank": r, "world_size": N,
//    "units": {UNIT: {"numel": n, "padded_numel": P, "shard_offset": o, "shard": Tensor,
//                     "optimizer": {"step": s (Adam/AdamW), "exp_avg": Tensor, ...}}}}
// Loading requires the same world size and unit layout: to change either, save the full state dict (rank 0,
// unsharded) and load that instead, which re-shards.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

struct ShardSlot {
  std::string unit;
  int64_t numel = 0;
  int64_t padded_numel = 0;
  int64_t shard_offset = 0;
  torch::Tensor shard;  // the tensor the optimizer steps: saved from, and loaded into (in place)
};

std::string shard_file(const std::string& dir, int rank, int world);

// Writes this rank's file atomically (creating DIR). `optimizer` may be null (parameters only).
void save_shards(const std::string& dir, const std::string& kind, int rank, int world,
                 const std::vector<ShardSlot>& slots, const torch::optim::Optimizer* optimizer);

// Reads this rank's file into the slots' shard tensors and, if `optimizer` is given, installs the saved optimizer
// state of each shard. Throws ConfigError naming the file and the first mismatch (world size, rank, unit, sizes).
void load_shards(const std::string& dir, int rank, int world, const std::vector<ShardSlot>& slots,
                 torch::optim::Optimizer* optimizer);

}  // namespace gradsync
