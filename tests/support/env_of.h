// defines: env_of(), a launcher environment given as a map, for read_launch_env() without touching the process's.
#pragma once
#include <map>
#include <optional>
#include <string>

#include "gradsync/runtime.h"

namespace gradsync::test {

inline EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace gradsync::test
