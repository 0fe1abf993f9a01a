// The full optimizer state dict (see full_optim_state.h).
#include "engine/full_optim_state.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/consistency.h"
#include "gradsync/error.h"

namespace gradsync {
namespace {

namespace optim = torch::optim;
using Dict = c10::impl::GenericDict;

Dict string_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

template <typename AdamOptions>
void add_adam_options(Dict& d, const AdamOptions& o) {
  d.insert("lr", o.lr());
  d.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  d.insert("eps", o.eps());
  d.insert("weight_decay", o.weight_decay());
  d.insert("amsgrad", o.amsgrad());
}

// The hyperparameters under Python's names.
Dict group_options(const optim::OptimizerOptions& options) {
  auto d = string_dict();
  if (const auto* o = dynamic_cast<const optim::SGDOptions*>(&options)) {
    d.insert("lr", o->lr());
    d.insert("momentum", o->momentum());
    d.insert("dampening", o->dampening());
    d.insert("weight_decay", o->weight_decay());
    d.insert("nesterov", o->nesterov());
  } else if (const auto* o = dynamic_cast<const optim::AdamWOptions*>(&options)) {
    add_adam_options(d, *o);
  } else if (const auto* o = dynamic_cast<const optim::AdamOptions*>(&options)) {
    add_adam_options(d, *o);
  } else {
    d.insert("lr", options.get_lr());
  }
  return d;
}

bool steps_tensor(const optim::Optimizer& optimizer, const torch::Tensor& t) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
    }
  }
  return false;
}

// A flat parameter's state on this rank's shard: the shard's own, or its pieces' put in place (zeros elsewhere).
ParamState shard_state(const FlatParam& flat, const optim::Optimizer& optimizer) {
  if (steps_tensor(optimizer, flat.shard())) return get_param_state(optimizer, flat.shard());
  ParamState out;
  for (size_t i = 0; i < flat.pieces().size(); ++i) {
    const auto piece = get_param_state(optimizer, flat.pieces()[i]);
    if (piece.empty()) continue;
    if (!out.step) out.step = piece.step;
    for (const auto& [name, tensor] : piece.tensors) {
      auto it = std::find_if(out.tensors.begin(), out.tensors.end(), [&](const auto& e) { return e.first == name; });
      if (it == out.tensors.end()) {
        out.tensors.emplace_back(name, torch::zeros({flat.shard_numel()}, tensor.options()));
        it = std::prev(out.tensors.end());
      }
      it->second.narrow(0, flat.piece_offset(i), tensor.numel()).copy_(tensor.reshape({-1}));
    }
  }
  return out;
}

std::string describe(const ParamState& s) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : s.tensors) names.push_back(name);
  return fmt::format("{}step {}", fmt::join(names, ","), s.step ? std::to_string(*s.step) : "-");
}

}  // namespace

c10::IValue optim_state_value(const std::vector<NamedParamState>& states, const optim::Optimizer& optimizer,
                              const SteppedNames& names) {
  auto state = string_dict();
  for (const auto& s : states) {
    if (s.state.empty()) continue;
    auto one = string_dict();
    if (s.state.step) one.insert("step", torch::scalar_tensor(static_cast<double>(*s.state.step), torch::kFloat));
    for (const auto& [name, tensor] : s.state.tensors) one.insert(name, tensor);
    state.insert(s.name, one);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const auto& group : optimizer.param_groups()) {
    auto d = group_options(group.options());
    c10::List<std::string> params;
    for (const auto& p : group.params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        throw ConfigError("full_optim_state_dict: the optimizer steps a tensor that is none of the engine's "
                          "parameters() or named_parameters()");
      }
      for (const auto& name : it->second) params.push_back(name);
    }
    d.insert("params", params);
    groups.push_back(d);
  }
  auto out = string_dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

std::map<std::string, ParamState> optim_states_of(const c10::IValue& value) {
  const auto bad = [](const std::string& what) {
    return ConfigError(fmt::format("full optimizer state dict: {}; expected {{'state': {{name: {{'step': ..., "
                                   "tensor name: tensor}}}}, 'param_groups': [...]}}", what));
  };
  if (!value.isGenericDict() || !value.toGenericDict().contains("state")) throw bad("no 'state' dict");
  const auto state = value.toGenericDict().at("state");
  if (!state.isGenericDict()) throw bad("'state' is not a dict");
  std::map<std::string, ParamState> out;
  for (const auto& entry : state.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isGenericDict()) throw bad("a 'state' entry is not name: dict");
    ParamState s;
    for (const auto& field : entry.value().toGenericDict()) {
      const auto name = field.key().toStringRef();
      if (!field.value().isTensor()) {
        throw bad(fmt::format("'{}' of '{}' is not a tensor", name, entry.key().toStringRef()));
      }
      if (name == "step") {
        s.step = static_cast<int64_t>(std::llround(field.value().toTensor().item<double>()));
      } else {
        s.tensors.emplace_back(name, field.value().toTensor());
      }
    }
    out[entry.key().toStringRef()] = s;
  }
  return out;
}

std::vector<NamedParamState> gather_optim_states(Collectives& comm, Collectives& shards,
                                                 const std::vector<FlatParam*>& flats,
                                                 const optim::Optimizer& optimizer) {
  std::vector<NamedParamState> out;
  for (const auto* flat : flats) {
    const auto mine = shard_state(*flat, optimizer);
    // The same state names and step on every rank, or the all-gathers below would pair different tensors.
    check_same_on_every_rank(comm, fmt::format("full_optim_state_dict: unit '{}'", flat->name()), {describe(mine)});
    std::vector<torch::Tensor> whole;
    for (const auto& [name, tensor] : mine.tensors) whole.push_back(flat->gather_shards(shards, tensor.reshape({-1})));
    for (const auto& e : flat->entries()) {
      NamedParamState s{e.name, {}};
      if (!mine.empty()) s.state.step = mine.step;
      for (size_t t = 0; t < whole.size(); ++t) {
        auto part = whole[t].narrow(0, e.offset, e.numel).view(e.shape).clone();
        s.state.tensors.emplace_back(mine.tensors[t].first, part);
      }
      out.push_back(std::move(s));
    }
  }
  return out;
}

void scatter_optim_states(const std::vector<FlatParam*>& flats, optim::Optimizer& optimizer,
                          const std::map<std::string, ParamState>& states) {
  for (auto* flat : flats) {
    ParamState part;  // this rank's shard of every state tensor
    std::map<std::string, torch::Tensor> whole;
    for (const auto& e : flat->entries()) {
      auto it = states.find(e.name);
      if (it == states.end()) continue;
      if (it->second.step) part.step = it->second.step;
      for (const auto& [name, tensor] : it->second.tensors) {
        if (tensor.numel() != e.numel) {
          throw ConfigError(fmt::format("full optimizer state dict: '{}' of '{}' has {} values, the parameter {}",
                                        name, e.name, tensor.numel(), e.numel));
        }
        auto& full = whole[name];
        if (!full.defined()) full = torch::zeros({flat->padded_numel()}, tensor.options());
        full.narrow(0, e.offset, e.numel).copy_(tensor.reshape({-1}));
      }
    }
    for (const auto& [name, full] : whole) {
      part.tensors.emplace_back(name, full.narrow(0, flat->shard_offset(), flat->shard_numel()));
    }
    auto& shard = flat->shard();
    if (steps_tensor(optimizer, shard)) {
      set_param_state(optimizer, shard, part);
      continue;
    }
    for (size_t i = 0; i < flat->pieces().size(); ++i) {
      ParamState piece{part.step, {}};
      for (const auto& [name, t] : part.tensors) {
        piece.tensors.emplace_back(name, t.narrow(0, flat->piece_offset(i), flat->pieces()[i].numel()));
      }
      set_param_state(optimizer, flat->pieces()[i], part.empty() ? ParamState{} : piece);
    }
  }
}

void require_optimizer_over_shards(const std::string& who, const optim::Optimizer* optimizer,
                                   const std::vector<FlatParam*>& flats) {
  if (!optimizer) return;
  for (const auto* flat : flats) {
    if (steps_tensor(*optimizer, flat->shard())) continue;
    throw ConfigError(fmt::format("{}: the optimizer does not step the shard of unit '{}' (built over "
                                  "named_parameters()?); a sharded checkpoint keeps the state of shards: save "
                                  "full_optim_state_dict() with state_dict() instead", who, flat->name()));
  }
}

c10::IValue sharded_optim_state_value(Collectives& comm, Collectives& shards, const std::vector<FlatParam*>& flats,
                                      const optim::Optimizer& optimizer, bool rank0_only) {
  const auto states = gather_optim_states(comm, shards, flats, optimizer);
  if (rank0_only && comm.rank() != 0) return string_dict();
  return optim_state_value(states, optimizer, stepped_names(flats));
}

SteppedNames stepped_names(const std::vector<FlatParam*>& flats) {
  SteppedNames names;
  for (auto* flat : flats) {
    auto& all = names[flat->shard().unsafeGetTensorImpl()];
    for (size_t i = 0; i < flat->entries().size(); ++i) {
      all.push_back(flat->entries()[i].name);
      names[flat->pieces()[i].unsafeGetTensorImpl()] = {flat->entries()[i].name};
    }
  }
  return names;
}

}  // namespace gradsync
