// defines: `gradsync trace plot`, a PNG of the Chrome trace-event JSON that `gradsync train --trace DIR` writes
// (trace.json, every rank's lanes, or one rank's trace-rank-R.json), for a look at a run without Perfetto:
//   trace_plot.cpp      the JSON read into lanes and spans (TraceTable), and the gnuplot picture of them
//   trace_command.cpp   the CLI
// One lane per (rank, thread): tid 0 is the thread that trains (compute, waits, phases), the others one group's
// stream of collectives each (gradsync/trace.h, trace_json()).
#pragma once
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace gradsync::cli {

struct TraceLane {
  int pid;           // the rank
  int tid;           // 0: the training thread; then "comm <group>" lanes
  std::string name;  // "rank 0 compute", "rank 1 comm world": the process's and the thread's names joined
};

struct TraceSpanRow {
  int lane;  // index into TraceTable::lanes
  double begin_ms;
  double end_ms;
  std::string category;  // "compute", "collective", "wait", "phase"; another producer's kept as is, none: "other"
  std::string name;
};

struct TraceTable {
  std::vector<TraceLane> lanes;    // by pid, then tid
  std::vector<TraceSpanRow> spans;  // the "X" events, in the file's order
};

// Parses trace-event JSON: an object with a "traceEvents" array (or, as Chrome also reads it, a bare array of
// events). "X" events become spans, times converted from microseconds to milliseconds; "M" events name the lanes
// (process_name "rank R" and thread_name "compute" give "rank R compute"; without them "rank R tid T"); a lane
// exists for every (pid, tid) an X event or a thread_name names. Other "ph" values are ignored. Throws
// gradsync::ConfigError naming what is wrong (not JSON, no traceEvents array, an event that is no object, an X event
// without a numeric ts or dur or an integer pid or tid, a negative dur: with the event's index and name) when the text
// is not trace-event JSON.
TraceTable read_trace_table(const std::string& json_text);

// Draws `table` into `png` with gnuplot (pngcairo, 1400 x (120 + 40 per lane)): lanes top to bottom as the table
// orders them, x in ms, each span a box coloured by its category, phases as light bands behind the others. Returns
// "" or why it could not (gnuplot missing or failing, nothing to draw).
std::string plot_trace_table(const TraceTable& table, const std::string& png, const std::string& title);

// Reads and parses `trace_file`, then plot_trace_table() with the file's name as the title. Returns "" or why not:
// the file cannot be read, is not trace-event JSON (read_trace_table's message), or gnuplot could not draw it.
// `drawn`, when given, receives the table (for the caller's lane and span counts).
std::string plot_trace(const std::string& trace_file, const std::string& png, TraceTable* drawn = nullptr);

// The PNG `trace plot` writes without -o: FILE with its extension replaced by .png ("run/trace.json" ->
// "run/trace.png"); a FILE that already ends in .png gets .png appended, so the input is never overwritten.
std::string trace_png_path(const std::string& trace_file);

// `gradsync trace plot FILE [-o PNG]`; sets exit_code to 1 when the plot could not be written.
void add_trace_command(CLI::App& root, int& exit_code);

}  // namespace gradsync::cli
