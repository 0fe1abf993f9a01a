// Gradient and replica checks (see verify.h).
#include "gradsync/verify.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"
#include "gradsync/state_dict.h"

namespace gradsync {

GradientCheck compare_gradients(const std::vector<std::string>& names, const std::vector<torch::Tensor>& got,
                                const std::vector<torch::Tensor>& expected, double rtol, double atol) {
  if (got.size() != expected.size() || names.size() != got.size()) {
    throw ConfigError(fmt::format("compare_gradients: {} names, {} gradients and {} references; expected equal "
                                  "counts", names.size(), got.size(), expected.size()));
  }
  GradientCheck out;
  for (size_t i = 0; i < got.size(); ++i) {
    auto ref = expected[i].to(torch::kDouble);
    auto diff = (got[i].to(torch::kDouble) - ref).abs().max().item<double>();
    auto scale = ref.abs().max().item<double>();
    out.max_abs_ref = std::max(out.max_abs_ref, scale);
    if (diff > atol + rtol * scale) out.ok = false;
    if (diff >= out.max_abs_diff) {
      out.max_abs_diff = diff;
      out.worst = names[i];
    }
  }
  return out;
}

uint64_t tensor_digest(const torch::Tensor& tensor) {
  auto t = tensor.detach().contiguous();
  const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
  const size_t size = static_cast<size_t>(t.numel()) * t.element_size();
  uint64_t hash = 1469598103934665603ULL;
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ULL;
  }
  return hash;
}

void check_replicas_identical(Collectives& comm, const torch::nn::Module& module, bool buffers) {
  auto state = state_dict(module);
  if (!buffers) {
    const auto params = module.named_parameters();
    state.erase(std::remove_if(state.begin(), state.end(), [&](const auto& e) { return !params.contains(e.first); }),
                state.end());
  }
  std::string mine;
  for (const auto& [name, tensor] : state) mine += fmt::format("{:016x}\n", tensor_digest(tensor));
  auto all = comm.allgather_strings(mine);
  for (size_t k = 0; k < state.size(); ++k) {
    std::vector<int> differing;
    for (int r = 1; r < comm.size(); ++r) {
      if (all[static_cast<size_t>(r)].substr(k * 17, 16) != all[0].substr(k * 17, 16)) differing.push_back(r);
    }
    if (!differing.empty()) {
      throw DistributedError(fmt::format(
          "replica check on rank {}: '{}' differs from rank 0's on rank(s) {} (the first divergent of {} {}); the "
          "replicas are no longer synchronised",
          comm.rank(), state[k].first, fmt::join(differing, ", "), state.size(),
          buffers ? "parameters and buffers" : "parameters"));
    }
  }
}

}  // namespace gradsync
