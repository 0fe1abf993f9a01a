// defines: parse_flag(), how the CLI hands a flag's value to a library parser: the library's ConfigError speaks of
// its own API ("wrap policy 'x' ..."), and the CLI adds which flag carried the value ("--wrap: ...").
#pragma once
#include <string>

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync::cli {

template <typename Parse>
auto parse_flag(const std::string& flag, const std::string& value, Parse&& parse) {
  try {
    return parse(value);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", flag, e.what()));
  }
}

}  // namespace gradsync::cli
