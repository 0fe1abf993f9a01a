// defines: the --backend flag that `launch`, `train`, `lab` and `bench` share: gloo or mpi (CLI11 checks the
// choice), defaulting to GRADSYNC_BACKEND, then to gloo.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "gradsync/runtime.h"

namespace gradsync::cli {

inline CLI::Option* add_backend_flag(CLI::App* cmd, std::string& backend) {
  return cmd
      ->add_option("--backend", backend,
                   "gloo (c10d over TCP, the default) or mpi (Open MPI; ranks started by mpirun); default: "
                   "$GRADSYNC_BACKEND, else gloo")
      ->check(CLI::IsMember({"gloo", "mpi"}))
      ->envname("GRADSYNC_BACKEND");
}

// The flag's value as a Backend ("" -> gloo).
inline Backend backend_of(const std::string& flag) {
  return flag.empty() ? Backend::Gloo : parse_backend(flag, "--backend");
}

}  // namespace gradsync::cli
