// Wrap policies and the unit plan (see wrap_policy.h).
#include "shard/wrap_policy.h"

#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

// A direct child with its parameters under their state-dict keys.
struct Child {
  std::string name;
  std::vector<std::string> param_names;
  std::vector<torch::Tensor> params;
  int64_t numel = 0;
};

std::vector<Child> direct_children(const torch::nn::Module& module) {
  std::vector<Child> out;
  for (const auto& item : module.named_children()) {
    Child child;
    child.name = item.key();
    for (const auto& p : item.value()->named_parameters(/*recurse=*/true)) {
      child.param_names.push_back(child.name + "." + p.key());
      child.params.push_back(p.value());
      child.numel += p.value().numel();
    }
    out.push_back(std::move(child));
  }
  return out;
}

UnitPlan unit_of(const std::vector<Child>& children, size_t first, size_t last) {
  UnitPlan unit;
  unit.name = first == last ? children[first].name : children[first].name + ".." + children[last].name;
  unit.first_child = first;
  unit.last_child = last;
  for (size_t i = first; i <= last; ++i) {
    unit.param_names.insert(unit.param_names.end(), children[i].param_names.begin(), children[i].param_names.end());
    unit.params.insert(unit.params.end(), children[i].params.begin(), children[i].params.end());
  }
  return unit;
}

// Consecutive children with parameters, closed as soon as the group reaches the threshold; a trailing group below
// it is a unit too (keeping it in the root would hold it gathered through the whole step).
std::vector<UnitPlan> group_by_size(const std::vector<Child>& children, int64_t min_params) {
  std::vector<UnitPlan> units;
  bool open = false;
  size_t first = 0;
  int64_t count = 0;
  size_t last_with_params = 0;
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
  return units;
}

std::vector<UnitPlan> listed(const std::vector<Child>& children, const std::vector<std::string>& names,
                             std::vector<bool>& taken) {
  std::map<std::string, size_t> index;
  std::vector<std::string> known;
  for (size_t i = 0; i < children.size(); ++i) {
    index[children[i].name] = i;
    known.push_back(children[i].name);
  }
  std::set<size_t> chosen;
  for (const auto& name : names) {
    auto it = index.find(name);
    if (it == index.end()) {
      throw ConfigError(fmt::format("wrap policy list: the module has no direct child '{}'; its children are {}",
                                    name, fmt::join(known, ", ")));
    }
    if (children[it->second].numel == 0) {
      throw ConfigError(fmt::format("wrap policy list: child '{}' has no parameters, so it cannot be a unit", name));
    }
    if (!chosen.insert(it->second).second) {
      throw ConfigError(fmt::format("wrap policy list: child '{}' is named twice", name));
    }
  }
  std::vector<UnitPlan> units;
  for (size_t i : chosen) {  // child order, whatever order the list used
    units.push_back(unit_of(children, i, i));
    taken[i] = true;
  }
  return units;
}

}  // namespace

int64_t UnitPlan::numel() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
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

std::string WrapPolicy::to_string() const {
  switch (kind) {
    case Kind::Children: return "children";
    case Kind::MinParams: return fmt::format("params:{}", min_params);
    case Kind::List: return fmt::format("list:{}", fmt::join(names, ","));
  }
  return "?";
}

WrapPolicy parse_wrap_policy(const std::string& spec) {
  const std::string allowed = "expected children, params:N (N >= 1) or list:NAME[,NAME...]";
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
      throw ConfigError(fmt::format("wrap policy '{}': '{}' is not a positive parameter count; {}", spec, n, allowed));
    }
    return WrapPolicy::at_least(value);
  }
  if (spec.rfind("list:", 0) == 0) {
    std::vector<std::string> names;
    const std::string body = spec.substr(5);
    size_t start = 0;
    while (start <= body.size()) {
      size_t comma = body.find(',', start);
      if (comma == std::string::npos) comma = body.size();
      std::string name = body.substr(start, comma - start);
      if (name.empty()) throw ConfigError(fmt::format("wrap policy '{}': empty child name; {}", spec, allowed));
      names.push_back(name);
      start = comma + 1;
    }
    return WrapPolicy::list(std::move(names));
  }
  throw ConfigError(fmt::format("wrap policy '{}' is not known; {}", spec, allowed));
}

std::vector<UnitPlan> plan_units(const torch::nn::Module& module, const WrapPolicy& policy) {
  auto children = direct_children(module);
  std::vector<bool> taken(children.size(), false);
  std::vector<UnitPlan> units;
  switch (policy.kind) {
    case WrapPolicy::Kind::Children:
      for (size_t i = 0; i < children.size(); ++i) {
        if (children[i].numel == 0) continue;
        units.push_back(unit_of(children, i, i));
      }
      break;
    case WrapPolicy::Kind::MinParams:
      units = group_by_size(children, policy.min_params);
      break;
    case WrapPolicy::Kind::List:
      units = listed(children, policy.names, taken);
      break;
  }
  for (const auto& u : units) {
    for (size_t i = u.first_child; i <= u.last_child; ++i) taken[i] = true;
  }
  // The root unit: the module's own parameters, then every child no unit took, in state-dict order.
  UnitPlan root;
  root.name = "(root)";
  root.is_root = true;
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    root.param_names.push_back(p.key());
    root.params.push_back(p.value());
  }
  for (size_t i = 0; i < children.size(); ++i) {
    if (taken[i]) continue;
    root.param_names.insert(root.param_names.end(), children[i].param_names.begin(), children[i].param_names.end());
    root.params.insert(root.params.end(), children[i].params.begin(), children[i].params.end());
  }
  if (!root.params.empty()) units.push_back(std::move(root));
  return units;
}

}  // namespace gradsync
