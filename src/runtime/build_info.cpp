// build_info() and describe() (see gradsync/runtime.h).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <ATen/detail/CUDAHooksInterface.h>

#include "gradsync/runtime.h"
#include "runtime/transport.h"

namespace gradsync {
namespace {

// The CUDA runtime's version as "13.0", or "" when this libtorch has no CUDA: without libtorch_cuda, ATen's CUDA
// hooks are the stub that throws.
std::string cuda_runtime_version() {
  try {
    const long v = at::detail::getCUDAHooks().versionCUDART();
    return fmt::format("{}.{}", v / 1000, v % 1000 / 10);
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

BuildInfo build_info() {
  BuildInfo info;
  info.gradsync = GRADSYNC_VERSION;
  info.libtorch = TORCH_VERSION;
  info.mpi = mpi_library_version();
  info.backends = {"gloo", "mpi"};
  info.cuda_runtime = cuda_runtime_version();
  info.cuda_compiled = !info.cuda_runtime.empty();
  info.cuda_devices = info.cuda_compiled ? static_cast<int>(torch::cuda::device_count()) : 0;
  return info;
}

std::string describe(const BuildInfo& info) {
  const std::string cuda =
      info.cuda_compiled ? fmt::format("compiled in (CUDA runtime {}), {} device(s) visible", info.cuda_runtime,
                                       info.cuda_devices)
                         : "not compiled in (a CPU-only libtorch)";
  return fmt::format("gradsync {}\nlibtorch {}\nMPI: {}\nbackends: {}\nCUDA: {}\n", info.gradsync, info.libtorch,
                     info.mpi, fmt::join(info.backends, ", "), cuda);
}

}  // namespace gradsync
