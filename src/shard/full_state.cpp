// Full state dicts of sharded models (see full_state.h).
#include "shard/full_state.h"

#include <set>

#include <fmt/format.h>

#include "common/consistency.h"

namespace gradsync {
namespace {

// Rank 0's buffers, as copies: on every rank when all_ranks (one broadcast), else only rank 0's own.
std::map<const void*, torch::Tensor> buffer_copies(Collectives& comm, const std::vector<torch::Tensor>& buffers,
                                                   bool all_ranks) {
  std::vector<torch::Tensor> copies;
  for (const auto& b : buffers) copies.push_back(b.detach().clone());
  if (all_ranks && comm.size() > 1) comm.broadcast_coalesced(copies, /*root=*/0);
  std::map<const void*, torch::Tensor> by_tensor;
  for (size_t i = 0; i < buffers.size(); ++i) by_tensor[buffers[i].unsafeGetTensorImpl()] = copies[i];
  return by_tensor;
}

}  // namespace

StateDict full_state_dict(Collectives& comm, Collectives& shards, const torch::nn::Module& module,
                          const std::vector<FlatParam*>& flats, const std::vector<torch::Tensor>& buffers,
                          bool all_ranks, bool gather) {
  const bool receiver = all_ranks || comm.rank() == 0;
  std::map<std::string, torch::Tensor> values;
  for (auto* flat : gather ? flats : std::vector<FlatParam*>{}) {
    auto full = flat->full_master(shards);  // a collective: every rank of the shard group takes part
    if (!receiver) continue;
    for (const auto& e : flat->entries()) values[e.name] = full.narrow(0, e.offset, e.numel).view(e.shape).clone();
  }
  const auto rank0_buffers = buffer_copies(comm, buffers, all_ranks);
  if (!receiver) return {};
  StateDict out;
  for (const auto& [name, tensor] : state_dict(module)) {
    auto value = values.find(name);
    auto buffer = rank0_buffers.find(tensor.unsafeGetTensorImpl());
    if (value != values.end()) {
      out.emplace_back(name, value->second);
    } else {
      out.emplace_back(name, buffer != rank0_buffers.end() ? buffer->second : tensor.detach().clone());
    }
  }
  return out;
}

StateDict full_gradient_dict(Collectives& comm, const torch::nn::Module& module, const std::vector<FlatParam*>& flats) {
  std::map<std::string, torch::Tensor> values;
  for (auto* flat : flats) {
    auto full = flat->full_master_grad(comm);
    for (const auto& e : flat->entries()) values[e.name] = full.narrow(0, e.offset, e.numel).view(e.shape).clone();
  }
  StateDict out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (auto it = values.find(p.key()); it != values.end()) out.emplace_back(p.key(), it->second);
  }
  return out;
}

void load_full_state_dict(Collectives& comm, const std::string& who, const torch::nn::Module& module,
                          const std::vector<FlatParam*>& flats, const StateDict& state) {
  const bool root_rank = comm.rank() == 0;
  fail_together(comm, fmt::format("{}: load_state_dict", who),
                root_rank ? state_dict_mismatch(state, state_dict(module)) : "");
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  torch::NoGradGuard no_grad;
  for (auto* flat : flats) {
    auto full = torch::zeros({flat->padded_numel()}, torch::TensorOptions().dtype(flat->master_dtype()));
    if (root_rank) {
      for (const auto& e : flat->entries()) full.narrow(0, e.offset, e.numel).copy_(given.at(e.name).reshape({-1}));
    }
    if (comm.size() > 1) comm.broadcast(full, /*root=*/0);
    flat->load_full_master(full);
  }
  // Everything no flat holds (buffers, frozen parameters): rank 0's values, then one broadcast.
  std::set<std::string> in_flats;
  for (auto* flat : flats) {
    for (const auto& e : flat->entries()) in_flats.insert(e.name);
  }
  std::vector<torch::Tensor> replicated;
  for (const auto& [name, tensor] : state_dict(module)) {
    if (in_flats.count(name)) continue;
    if (root_rank) tensor.detach().copy_(given.at(name));
    replicated.push_back(tensor.detach());
  }
  if (comm.size() > 1 && !replicated.empty()) comm.broadcast_coalesced(replicated, /*root=*/0);
}

}  // namespace gradsync
