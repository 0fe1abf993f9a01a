// Wrap policies and the unit plan (see wrap_policy.h).
#include "shard/wrap_policy.h"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

// A module of the tree, where it sits, and its trainable parameters under their state-dict keys.
struct Node {
  std::string name;  // qualified ("blocks.1"); "" for the module FSDP wraps
  std::string key;   // its own key in its parent ("1")
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<torch::nn::SequentialImpl> parent_sequential;  // set when it is an element of a Sequential
  size_t slot = 0;                                                // which element
  std::vector<std::string> param_names;
  std::vector<torch::Tensor> params;
  int64_t numel = 0;
};

std::string qualified(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

Node node_of(std::string name, std::string key, std::shared_ptr<torch::nn::Module> module) {
  Node n{std::move(name), std::move(key), std::move(module), nullptr, 0, {}, {}, 0};
  for (const auto& p : n.module->named_parameters(/*recurse=*/true)) {
    if (!p.value().requires_grad()) continue;  // frozen: no unit holds it (see wrap_policy.h)
    n.param_names.push_back(qualified(n.name, p.key()));
    n.params.push_back(p.value());
    n.numel += p.value().numel();
  }
  return n;
}

std::vector<Node> children_of(const Node& parent) {
  auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(parent.module);
  std::vector<Node> out;
  for (const auto& item : parent.module->named_children()) {
    out.push_back(node_of(qualified(parent.name, item.key()), item.key(), item.value()));
    out.back().parent_sequential = sequential;
    out.back().slot = out.size() - 1;  // a Sequential registers its elements in slot order
  }
  return out;
}

bool is_sequential(const Node& n) { return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(n.module) != nullptr; }

// The element lists of the outermost Sequentials (the module itself, if it is one); without any, its direct
// children (units without a slot, run by forward_with).
void find_sites(const Node& n, std::vector<std::vector<Node>>& sites) {
  if (is_sequential(n)) {
    sites.push_back(children_of(n));
    return;
  }
  for (const auto& c : children_of(n)) find_sites(c, sites);
}

std::vector<std::vector<Node>> sites_of(const Node& root) {
  std::vector<std::vector<Node>> sites;
  find_sites(root, sites);
  if (sites.empty()) sites.push_back(children_of(root));
  return sites;
}

void walk(const Node& n, std::vector<Node>& out) {
  out.push_back(n);
  for (const auto& c : children_of(n)) walk(c, out);
}

UnitPlan unit_of(const std::vector<Node>& siblings, size_t first, size_t last) {
  UnitPlan unit;
  unit.name = first == last ? siblings[first].name : siblings[first].name + ".." + siblings[last].key;
  unit.sequential = siblings[first].parent_sequential;
  unit.first_child = siblings[first].slot;
  unit.last_child = siblings[last].slot;
  for (size_t i = first; i <= last; ++i) {
    unit.param_names.insert(unit.param_names.end(), siblings[i].param_names.begin(), siblings[i].param_names.end());
    unit.params.insert(unit.params.end(), siblings[i].params.begin(), siblings[i].params.end());
  }
  return unit;
}

void one_unit_per_child(const std::vector<Node>& children, std::vector<UnitPlan>& units) {
  for (size_t i = 0; i < children.size(); ++i) {
    if (children[i].numel > 0) units.push_back(unit_of(children, i, i));
  }
}

// Consecutive elements with parameters, closed as soon as the group reaches the threshold; a trailing group below
// it is a unit too (keeping it in the root would hold it gathered through the whole step). The direct children of
// a module without a Sequential have no slot: forward_with() runs them by name, one unit each, so they are not
// grouped into ranges a caller could not name.
void group_by_size(const std::vector<Node>& children, int64_t min_params, std::vector<UnitPlan>& units) {
  if (!children.empty() && !children.front().parent_sequential) return one_unit_per_child(children, units);
  bool open = false;
  size_t first = 0, last_with_params = 0;
  int64_t count = 0;
  for (size_t i = 0; i < children.size(); ++i) {
    if (children[i].numel == 0) continue;
    if (!open) {
      open = true;
      first = i;
      count = 0;
    }
    count += children[i].numel;
    last_with_params = i;
    if (count >= min_params) {
      units.push_back(unit_of(children, first, i));
      open = false;
    }
  }
  if (open) units.push_back(unit_of(children, first, last_with_params));
}

void check_not_nested(const std::vector<UnitPlan>& units) {
  for (const auto& a : units) {
    for (const auto& b : units) {
      if (&a != &b && b.name.rfind(a.name + ".", 0) == 0) {
        throw ConfigError(fmt::format("wrap policy: unit '{}' lies inside unit '{}'; units cannot nest", b.name,
                                      a.name));
      }
    }
  }
}

std::vector<UnitPlan> listed(const std::vector<Node>& all, const std::vector<std::string>& names) {
  std::map<std::string, size_t> index;  // qualified name -> position in registration order
  for (size_t i = 1; i < all.size(); ++i) index[all[i].name] = i;
  std::set<size_t> chosen;
  for (const auto& name : names) {
    auto it = index.find(name);
    if (it == index.end()) {
      std::vector<std::string> direct;
      for (const auto& n : all) {
        if (!n.name.empty() && n.name.find('.') == std::string::npos) direct.push_back(n.name);
      }
      throw ConfigError(fmt::format("wrap policy list: the module has no submodule '{}' (qualified names such as "
                                    "blocks.0); its direct children are {}", name, fmt::join(direct, ", ")));
    }
    if (all[it->second].numel == 0) {
      throw ConfigError(fmt::format("wrap policy list: '{}' has no trainable parameters, so it cannot be a unit",
                                    name));
    }
    if (!chosen.insert(it->second).second) {
      throw ConfigError(fmt::format("wrap policy list: '{}' is named twice", name));
    }
  }
  std::vector<UnitPlan> units;
  for (size_t i : chosen) units.push_back(unit_of(all, i, i));  // registration order, whatever the list's
  check_not_nested(units);
  return units;
}

bool type_matches(const torch::nn::Module& module, const std::vector<std::string>& types) {
  const std::string full = module.name(), short_name = module_type_name(module);
  return std::any_of(types.begin(), types.end(),
                     [&](const std::string& t) { return t == full || t == short_name || t == short_name + "Impl"; });
}

// Every module of a listed type (not descending into one), in registration order.
void by_type(const Node& n, const std::vector<std::string>& types, std::vector<UnitPlan>& units, bool& matched,
             std::set<std::string>& seen_types) {
  for (const auto& c : children_of(n)) {
    seen_types.insert(module_type_name(*c.module));
    if (type_matches(*c.module, types)) {
      matched = true;
      if (c.numel > 0) units.push_back(unit_of({c}, 0, 0));  // a wholly frozen one has nothing to shard
      continue;
    }
    by_type(c, types, units, matched, seen_types);
  }
}

std::vector<UnitPlan> typed(const Node& root, const std::vector<std::string>& types) {
  std::vector<UnitPlan> units;
  std::set<std::string> seen;
  bool matched = false;
  by_type(root, types, units, matched, seen);
  if (!matched) {
    throw ConfigError(fmt::format("wrap policy type:{}: the module has no submodule of that type; its types are {}",
                                  fmt::join(types, ","), fmt::join(seen, ", ")));
  }
  return units;
}

}  // namespace

int64_t UnitPlan::numel() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

std::string module_type_name(const torch::nn::Module& module) {
  std::string name = module.name();
  if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

WrapPolicy WrapPolicy::children() { return WrapPolicy{}; }

WrapPolicy WrapPolicy::at_least(int64_t min_params) {
  WrapPolicy p;
  p.kind = Kind::MinParams;
  p.min_params = min_params;
  return p;
}

WrapPolicy WrapPolicy::list(std::vector<std::string> names) {
  WrapPolicy p;
  p.kind = Kind::List;
  p.names = std::move(names);
  return p;
}

WrapPolicy WrapPolicy::types(std::vector<std::string> names) {
  WrapPolicy p;
  p.kind = Kind::Types;
  p.names = std::move(names);
  return p;
}

std::string WrapPolicy::to_string() const {
  switch (kind) {
    case Kind::Children: return "children";
    case Kind::MinParams: return fmt::format("params:{}", min_params);
    case Kind::List: return fmt::format("list:{}", fmt::join(names, ","));
    case Kind::Types: return fmt::format("type:{}", fmt::join(names, ","));
  }
  return "?";
}

namespace {

constexpr const char* kAllowedPolicies =
    "expected children, params:N (N >= 1), list:NAME[,NAME...] (qualified module names) or type:TYPE[,TYPE...]";

std::vector<std::string> comma_list(const std::string& spec, const std::string& body, const char* what) {
  std::vector<std::string> names;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == std::string::npos) comma = body.size();
    std::string name = body.substr(start, comma - start);
    if (name.empty()) throw ConfigError(fmt::format("wrap policy '{}': empty {}; {}", spec, what, kAllowedPolicies));
    names.push_back(name);
    start = comma + 1;
  }
  return names;
}

}  // namespace

WrapPolicy parse_wrap_policy(const std::string& spec) {
  if (spec == "children") return WrapPolicy::children();
  if (spec.rfind("params:", 0) == 0) {
    const std::string n = spec.substr(7);
    size_t used = 0;
    long long value = 0;
    try {
      value = std::stoll(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (n.empty() || used != n.size() || value < 1) {
      throw ConfigError(fmt::format("wrap policy '{}': '{}' is not a positive parameter count; {}", spec, n,
                                    kAllowedPolicies));
    }
    return WrapPolicy::at_least(value);
  }
  if (spec.rfind("list:", 0) == 0) return WrapPolicy::list(comma_list(spec, spec.substr(5), "module name"));
  if (spec.rfind("type:", 0) == 0) return WrapPolicy::types(comma_list(spec, spec.substr(5), "type name"));
  throw ConfigError(fmt::format("wrap policy '{}' is not known; {}", spec, kAllowedPolicies));
}

std::vector<UnitPlan> plan_units(const torch::nn::Module& module, const WrapPolicy& policy) {
  // named_children() needs a shared_ptr; the plan never outlives the module, so a non-owning one will do.
  const Node root = node_of("", "", std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module>{},
                                                                       const_cast<torch::nn::Module*>(&module)));
  std::vector<UnitPlan> units;
  switch (policy.kind) {
    case WrapPolicy::Kind::Children:
      for (const auto& site : sites_of(root)) one_unit_per_child(site, units);
      break;
    case WrapPolicy::Kind::MinParams:
      for (const auto& site : sites_of(root)) group_by_size(site, policy.min_params, units);
      break;
    case WrapPolicy::Kind::List: {
      std::vector<Node> all;
      walk(root, all);
      units = listed(all, policy.names);
      break;
    }
    case WrapPolicy::Kind::Types:
      units = typed(root, policy.names);
      break;
  }
  std::set<const void*> taken;
  for (const auto& u : units) {
    for (const auto& p : u.params) taken.insert(p.unsafeGetTensorImpl());
  }
  // The root unit: every trainable parameter no unit took, in state-dict order.
  UnitPlan rest;
  rest.name = "(root)";
  rest.is_root = true;
  for (size_t i = 0; i < root.params.size(); ++i) {
    if (taken.count(root.params[i].unsafeGetTensorImpl())) continue;
    rest.param_names.push_back(root.param_names[i]);
    rest.params.push_back(root.params[i]);
  }
  if (!rest.params.empty()) units.push_back(std::move(rest));
  return units;
}

}  // namespace gradsync
