// `gradsync trace plot FILE [-o PNG]`: flags (CLI11 checks that FILE exists) -> trace.h, and the one line it prints.
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "trace/trace.h"

namespace gradsync::cli {
namespace {

struct TracePlotOptions {
  std::string file;
  std::string png;  // "" = trace_png_path(file)
};

int run_trace_plot(const TracePlotOptions& o) {
  const std::string png = o.png.empty() ? trace_png_path(o.file) : o.png;
  TraceTable table;
  std::string why;
  try {
    why = plot_trace(o.file, png, &table);
  } catch (const std::exception& e) {  // the temp dir or gnuplot's log could not be made
    why = e.what();
  }
  if (!why.empty()) {
    fmt::print(stderr, "gradsync trace plot: {}\n", why);
    return 1;
  }
  fmt::print("gradsync trace plot: wrote {} ({} lanes, {} spans)\n", png, table.lanes.size(), table.spans.size());
  return 0;
}

}  // namespace

void add_trace_command(CLI::App& root, int& exit_code) {
  auto* cmd = root.add_subcommand(
      "trace", "Look at the trace-event JSON that `gradsync train --trace DIR` writes; `trace plot` draws it as a PNG");
  cmd->require_subcommand(1);
  auto o = std::make_shared<TracePlotOptions>();
  auto* plot = cmd->add_subcommand(
      "plot", "Draw a trace (DIR/trace.json, or one rank's trace-rank-R.json) as a PNG timeline with gnuplot: one "
              "lane per rank and thread, each span a box coloured by its category (compute, collective, wait; "
              "phases as light bands behind)");
  plot->add_option("FILE", o->file, "the trace-event JSON")->required()->check(CLI::ExistingFile);
  plot->add_option("-o,--output", o->png, "the PNG to write (default: FILE with its extension replaced by .png)");
  plot->callback([o, &exit_code] { exit_code = run_trace_plot(*o); });
}

}  // namespace gradsync::cli
