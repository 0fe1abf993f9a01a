// The `gradsync` command line: registers one subcommand per folder (launch/, train/, lab/, bench/).
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "bench/bench.h"
#include "lab/lab.h"
#include "launch/launch.h"
#include "train/train.h"

int main(int argc, char** argv) {
  CLI::App app{"gradsync: data-parallel training for libtorch with declared gradient semantics"};
  app.set_version_flag("--version", std::string("gradsync ") + GRADSYNC_VERSION);
  app.require_subcommand(1);
  int exit_code = 0;
  gradsync::cli::add_launch_command(app, exit_code);
  gradsync::cli::add_train_command(app, exit_code);
  gradsync::cli::add_lab_command(app, exit_code);
  gradsync::cli::add_bench_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const c10::Error& e) {
    // libtorch's own errors carry a C++ backtrace that helps nobody running the CLI.
    fmt::print(stderr, "gradsync: error: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    // Library code throws; only the CLI turns an error into an exit status.
    fmt::print(stderr, "gradsync: error: {}\n", e.what());
    return 1;
  }
  return exit_code;
}
