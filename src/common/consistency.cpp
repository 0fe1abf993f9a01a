// Cross-rank model and plan checks (see consistency.h).
#include "common/consistency.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "gradsync/state_dict.h"

namespace gradsync {
namespace {

std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

std::string first_difference(const std::vector<std::string>& reference, const std::vector<std::string>& other,
                             int rank) {
  const size_t common = std::min(reference.size(), other.size());
  for (size_t k = 0; k < common; ++k) {
    if (reference[k] != other[k]) {
      return fmt::format("entry #{}: rank 0 has '{}', rank {} has '{}'", k, reference[k], rank, other[k]);
    }
  }
  if (reference.size() == other.size()) return "";
  return other.size() > reference.size()
             ? fmt::format("rank {} has an extra entry '{}'", rank, other[common])
             : fmt::format("rank {} lacks '{}'", rank, reference[common]);
}

}  // namespace

std::vector<std::string> describe_module(const torch::nn::Module& module) {
  std::vector<std::string> lines;
  const auto params = module.named_parameters(/*recurse=*/true);
  for (const auto& [name, tensor] : state_dict(module)) {
    const bool is_param = params.find(name) != nullptr;
    lines.push_back(fmt::format("{} {} {} [{}]", is_param ? "parameter" : "buffer", name,
                                c10::toString(tensor.scalar_type()), fmt::join(tensor.sizes(), ", ")));
  }
  return lines;
}

void check_same_on_every_rank(Collectives& comm, const std::string& who, const std::vector<std::string>& lines) {
  auto all = comm.allgather_strings(join_lines(lines));
  const auto reference = split_lines(all[0]);
  std::vector<std::string> problems;
  for (int r = 1; r < comm.size(); ++r) {
    auto diff = first_difference(reference, split_lines(all[static_cast<size_t>(r)]), r);
    if (!diff.empty()) problems.push_back(diff);
  }
  if (!problems.empty()) {
    throw DistributedError(fmt::format("{} on rank {}: the ranks differ: {}", who, comm.rank(),
                                       fmt::join(problems, "; ")));
  }
}

void fail_together(Collectives& comm, const std::string& who, const std::string& problem) {
  auto all = comm.allgather_strings(problem);
  std::vector<std::string> problems;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) problems.push_back(fmt::format("rank {}: {}", r, all[r]));
  }
  if (!problems.empty()) throw ConfigError(fmt::format("{}: {}", who, fmt::join(problems, "; ")));
}

}  // namespace gradsync
