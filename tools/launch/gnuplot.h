// defines: how gradsync's tools run gnuplot for a PNG (bench --plot, trace plot; the lab checks with
// gnuplot_missing() and renders several PNGs itself): whether it is installed, and one run with its log read back.
#pragma once
#include <chrono>
#include <string>

namespace gradsync::cli {

// "" when gnuplot is on PATH, else what to install.
std::string gnuplot_missing();

// Runs `gnuplot SCRIPT` in `dir` (the script and its data already written there), which must write `png` (an
// absolute path). Returns "" or why not: over `limit`, a failure (with gnuplot's output), or no PNG written.
std::string run_gnuplot(const std::string& dir, const std::string& script, const std::string& png,
                        std::chrono::seconds limit);

}  // namespace gradsync::cli
