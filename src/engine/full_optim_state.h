// defines: the full optimizer state dict every engine offers (Engine::full_optim_state_dict): the optimizer's state
// of each original parameter, whole, under the parameter's state-dict name, in PyTorch's
// FSDP.full_optim_state_dict layout:
//
//   {"state": {"blocks.0.fc.weight": {"step": tensor(3.), "exp_avg": <shaped like the parameter>, ...}, ...},
//    "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), ..., "params": ["inp.weight", ...]}, ...]}
//
// A sharded engine's optimizer steps either its shards (parameters()) or its pieces of the original parameters
// (named_parameters()); the state of a flat parameter is assembled on this rank's shard (from the shard's own state
// or its pieces') and all-gathered, one collective per unit and state tensor. Loading takes this rank's part of
// each whole tensor back into the same tensors.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "gradsync/collectives.h"
#include "shard/flat_param.h"
#include "shard/optimizer_state.h"

namespace gradsync {

// One original parameter's whole state.
struct NamedParamState {
  std::string name;
  ParamState state;
};

// The tensors the optimizer steps, each with the original parameters' names it covers (param_groups' "params").
using SteppedNames = std::map<const void*, std::vector<std::string>>;

// The layout above from whole states; parameters without state are left out of "state", as PyTorch does.
c10::IValue optim_state_value(const std::vector<NamedParamState>& states, const torch::optim::Optimizer& optimizer,
                              const SteppedNames& names);
// The "state" entries of such a dict by parameter name; ConfigError naming what is malformed.
std::map<std::string, ParamState> optim_states_of(const c10::IValue& value);

// Collective: every flat parameter's state, whole (see above), gathered over `shards` (the world, or a hybrid
// strategy's shard group). DistributedError when the ranks of `comm` keep different state names for a unit.
std::vector<NamedParamState> gather_optim_states(Collectives& comm, Collectives& shards,
                                                 const std::vector<FlatParam*>& flats,
                                                 const torch::optim::Optimizer& optimizer);
// This rank's part of each whole state into the shards or pieces the optimizer steps (no communication).
void scatter_optim_states(const std::vector<FlatParam*>& flats, torch::optim::Optimizer& optimizer,
                          const std::map<std::string, ParamState>& states);
// The names of what a sharded engine's optimizer may step: each shard (every parameter of its flat) and each piece.
SteppedNames stepped_names(const std::vector<FlatParam*>& flats);

// Sharded checkpoints save and load the optimizer state of shards: ConfigError naming `who` when `optimizer`
// (if given) steps pieces instead.
void require_optimizer_over_shards(const std::string& who, const torch::optim::Optimizer* optimizer,
                                   const std::vector<FlatParam*>& flats);

// Collective: gather_optim_states() as the layout above, on every rank or (rank0_only) rank 0, else an empty dict.
c10::IValue sharded_optim_state_value(Collectives& comm, Collectives& shards, const std::vector<FlatParam*>& flats,
                                      const torch::optim::Optimizer& optimizer, bool rank0_only);

}  // namespace gradsync
