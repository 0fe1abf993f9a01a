// The `gradsync` command line: registers one subcommand per folder (launch/, train/, lab/, bench/, trace/).
#include <cstdlib>
#include <exception>
#include <string>

#include <malloc.h>

#include <CLI/CLI.hpp>

#include "bench/bench.h"
#include "gradsync/runtime.h"
#include "lab/lab.h"
#include "launch/launch.h"
#include "trace/trace.h"
#include "train/train.h"

namespace {

// Sharded steps free and re-allocate megabytes every step (FSDP's gathered parameters, the transports' receive
// buffers), and glibc hands such blocks back to the kernel at each free (mmap above a threshold that it adapts,
// trimming of the heap), so every step page-faults them in again: 8-20 thousand faults per rank per step here. Kept
// for reuse: zero1 on Gloo 0.63 x its step time, fsdp-full 0.94 x (docs/performance.md). Settings the user makes
// (GLIBC_TUNABLES, or glibc's older MALLOC_*_ variables) win.
void keep_freed_memory_for_reuse() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::string(tunables).find("glibc.malloc.") != std::string::npos) return;
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_")) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: blocks up to 32 MiB come from the heap
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace

int main(int argc, char** argv) {
  keep_freed_memory_for_reuse();
  CLI::App app{"gradsync: data-parallel training for libtorch with declared gradient semantics"};
  // gradsync's, libtorch's and MPI's versions, the backends, CUDA: asked only when --version is given.
  // CLI11 ends the text with its own newline.
  app.set_version_flag("--version", [] {
    auto text = gradsync::describe(gradsync::build_info());
    text.pop_back();
    return text;
  },
                       "print gradsync's, libtorch's and MPI's versions, the backends and CUDA, then exit");
  app.require_subcommand(1);
  int exit_code = 0;
  gradsync::cli::add_launch_command(app, exit_code);
  gradsync::cli::add_train_command(app, exit_code);
  gradsync::cli::add_lab_command(app, exit_code);
  gradsync::cli::add_bench_command(app, exit_code);
  gradsync::cli::add_trace_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    // Library code throws; only the CLI turns an error into an exit status.
    gradsync::cli::print_error(e);
    return 1;
  }
  return exit_code;
}
