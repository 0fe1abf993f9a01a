// defines: the registration functions of the `gradsync` subcommands (one .cpp per subcommand).
#pragma once
#include <CLI/CLI.hpp>

namespace gradsync::cli {

// Each subcommand adds itself to `root`; its callback stores the process exit status in `exit_code`.
void add_launch_command(CLI::App& root, int& exit_code);
void add_train_command(CLI::App& root, int& exit_code);
void add_lab_command(CLI::App& root, int& exit_code);  // also registers the hidden lab-rank

}  // namespace gradsync::cli
