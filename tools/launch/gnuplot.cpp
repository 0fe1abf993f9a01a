// gnuplot as the tools run it (see gnuplot.h).
#include "launch/gnuplot.h"

#include <sys/wait.h>

#include <filesystem>

#include "launch/spawn.h"

namespace gradsync::cli {

std::string gnuplot_missing() {
  return find_executable("gnuplot", current_environment())
             ? ""
             : "gnuplot is not installed (Debian: gnuplot-nox, see scripts/install-deps.sh)";
}

std::string run_gnuplot(const std::string& dir, const std::string& script, const std::string& png,
                        std::chrono::seconds limit) {
  const std::string log = dir + "/gnuplot.log";
  const auto status = run_logged({"gnuplot", script}, dir, log, limit);
  if (!status) return "gnuplot took over " + std::to_string(limit.count()) + " s and was stopped";
  if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) return "gnuplot failed: " + read_text(log);
  return std::filesystem::exists(png) ? "" : "gnuplot wrote no " + png;
}

}  // namespace gradsync::cli
