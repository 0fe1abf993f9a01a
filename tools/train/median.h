// The median of a sample, as train's trace summary and bench report it: one definition, so "median step" means
// the same in both.
#pragma once

#include <algorithm>
#include <vector>

namespace gradsync::cli {

// 0 for an empty sample; the mean of the middle two for an even count.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace gradsync::cli
