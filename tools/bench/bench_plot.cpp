// --plot of `gradsync bench` (see bench.h): every measured step of both sides, in run order, as one PNG.
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "bench/bench.h"
#include "launch/gnuplot.h"
#include "launch/spawn.h"

namespace gradsync::cli {

std::string plot_step_times(const std::string& png, const StepStats& gradsync, const StepStats& pytorch,
                            const BenchConfig& c) {
  if (auto missing = gnuplot_missing(); !missing.empty()) return missing;
  TempDir dir("gradsync-bench-plot-");
  auto write_data = [&](const char* name, const StepStats& s) {
    std::ofstream out(dir.file(name));
    for (size_t i = 0; i < s.step_seconds.size(); ++i) out << i << ' ' << 1e3 * s.step_seconds[i] << '\n';
  };
  write_data("gradsync.dat", gradsync);
  write_data("pytorch.dat", pytorch);
  const std::string target = std::filesystem::absolute(png).string();
  std::ofstream(dir.file("plot.gp")) << fmt::format(
      "set terminal pngcairo size 900,500\nset output '{}'\nset title 'step time: {} x{} ranks, {} per rank, {} "
      "thread(s), {} on {}'\nset xlabel 'measured step (runs in order)'\nset ylabel 'ms'\nset yrange [0:*]\n"
      "set key top right\nplot 'gradsync.dat' with linespoints title 'gradsync'{}\n",
      target, c.model, c.strategy == "local" ? 1 : c.world_size, c.per_rank_batch, c.threads, c.strategy, c.backend,
      pytorch.step_seconds.empty() ? "" : ", 'pytorch.dat' with linespoints title 'PyTorch DDP (gloo)'");
  return run_gnuplot(dir.path(), "plot.gp", target, std::chrono::minutes(1));
}

}  // namespace gradsync::cli
