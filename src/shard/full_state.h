// defines: the full (unsharded) state dict of a sharded model, assembled and loaded the same way by FSDP and ZeRO-1:
// Python's keys and order, parameters in the master dtype, buffers rank 0's.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"
#include "gradsync/state_dict.h"
#include "shard/flat_param.h"

namespace gradsync {

// Collective. Gathers every flat parameter's full master values over `shards` (the world, or a hybrid strategy's
// shard group; a collective per unit when sharded) and assembles the module's state dict on rank 0 of `comm`, or
// every rank (all_ranks); other ranks get an empty one.
// Parameters not in any flat, and every flat when `gather` is false (ZeRO-1: parameters are whole everywhere), come
// from the module itself. Buffers are rank 0's.
StateDict full_state_dict(Collectives& comm, Collectives& shards, const torch::nn::Module& module,
                          const std::vector<FlatParam*>& flats, const std::vector<torch::Tensor>& buffers,
                          bool all_ranks, bool gather);

// Collective over `comm`, the group the flats are sharded over. The whole reduced gradient of every parameter the
// flats hold (zeros where a shard has none), on every rank, in the module's parameter order.
StateDict full_gradient_dict(Collectives& comm, const torch::nn::Module& module, const std::vector<FlatParam*>& flats);

// Collective. Checks rank 0's `state` against the module (strict: missing, unexpected, mis-shaped keys fail on
// every rank, naming them; nothing is modified), broadcasts each flat's values and takes this rank's shard of them
// (the full buffers are freed: the next gather sees the new values), then rank 0's buffers and frozen parameters.
void load_full_state_dict(Collectives& comm, const std::string& who, const torch::nn::Module& module,
                          const std::vector<FlatParam*>& flats, const StateDict& state);

}  // namespace gradsync
