// Reduction names (see Note [Where the division happens] in reduction.h).
#include "gradsync/reduction.h"

#include "gradsync/error.h"

namespace gradsync {

const char* to_string(Reduction reduction) {
  switch (reduction) {
    case Reduction::Mean: return "mean";
    case Reduction::Sum: return "sum";
    case Reduction::GlobalMean: return "global-mean";
  }
  return "?";
}

Reduction parse_reduction(const std::string& text) {
  if (text == "mean") return Reduction::Mean;
  if (text == "sum") return Reduction::Sum;
  if (text == "global-mean") return Reduction::GlobalMean;
  throw ConfigError("reduction '" + text + "' is not known; expected 'mean', 'sum' or 'global-mean'");
}

}  // namespace gradsync
