// `gradsync trace plot` (see trace.h): trace-event JSON read into lanes and spans, and their gnuplot timeline.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gradsync/error.h"
#include "launch/gnuplot.h"
#include "launch/spawn.h"
#include "trace/trace.h"

namespace gradsync::cli {
namespace {

// A name of its own: the toolkit compiles in unity batches, where another file's `json` may be ordered_json.
using TraceJson = nlohmann::json;

// What the metadata ("M") events call each rank and each of its threads.
struct LaneNames {
  std::map<int, std::string> process;
  std::map<std::pair<int, int>, std::string> thread;
};

struct RawSpan {
  int pid = 0, tid = 0;
  double ts = 0, dur = 0;  // microseconds
  std::string category, name;
};

std::string string_field(const TraceJson& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::optional<int> int_field(const TraceJson& e, const char* key) {
  auto it = e.find(key);
  if (it == e.end() || !it->is_number_integer()) return std::nullopt;
  const auto v = it->get<int64_t>();
  if (v < INT_MIN || v > INT_MAX) return std::nullopt;
  return static_cast<int>(v);
}

// `traceEvents[3] ("allreduce")`: where a bad event is, for the error.
std::string event_at(const TraceJson& e, size_t index) {
  const std::string name = string_field(e, "name");
  return name.empty() ? fmt::format("traceEvents[{}]", index) : fmt::format("traceEvents[{}] (\"{}\")", index, name);
}

ConfigError not_a_span(const TraceJson& e, size_t index, const std::string& what) {
  return ConfigError(fmt::format("{} is an \"X\" event without {}: a complete event needs numeric \"ts\" and \"dur\" "
                                 "(microseconds) and integer \"pid\" and \"tid\"", event_at(e, index), what));
}

double number_field(const TraceJson& e, size_t index, const char* key) {
  auto it = e.find(key);
  if (it == e.end() || !it->is_number()) throw not_a_span(e, index, fmt::format("a numeric \"{}\"", key));
  return it->get<double>();
}

RawSpan read_span(const TraceJson& e, size_t index) {
  RawSpan s;
  s.ts = number_field(e, index, "ts");
  s.dur = number_field(e, index, "dur");
  if (s.dur < 0) throw ConfigError(fmt::format("{} has a negative \"dur\" ({})", event_at(e, index), s.dur));
  auto pid = int_field(e, "pid"), tid = int_field(e, "tid");
  if (!pid) throw not_a_span(e, index, "an integer \"pid\"");
  if (!tid) throw not_a_span(e, index, "an integer \"tid\"");
  s.pid = *pid;
  s.tid = *tid;
  s.category = string_field(e, "cat");
  if (s.category.empty()) s.category = "other";
  s.name = string_field(e, "name");
  return s;
}

void read_names(const TraceJson& e, LaneNames& names) {
  auto args = e.find("args");
  auto pid = int_field(e, "pid");
  if (args == e.end() || !args->is_object() || !pid) return;
  const std::string label = string_field(*args, "name");
  if (label.empty()) return;
  const std::string kind = string_field(e, "name");
  if (kind == "process_name") names.process[*pid] = label;
  if (kind == "thread_name") {
    if (auto tid = int_field(e, "tid")) names.thread[{*pid, *tid}] = label;
  }
}

const TraceJson& events_of(const TraceJson& doc) {
  if (doc.is_array()) return doc;  // Chrome's other form: the events alone
  auto it = doc.is_object() ? doc.find("traceEvents") : doc.end();
  if (!doc.is_object() || it == doc.end() || !it->is_array()) {
    throw ConfigError("no \"traceEvents\" array: not Chrome trace-event JSON, which `gradsync train --trace DIR` "
                      "writes as {\"traceEvents\": [...]}");
  }
  return *it;
}

std::string lane_name(const LaneNames& names, int pid, int tid) {
  auto process = names.process.find(pid);
  auto thread = names.thread.find({pid, tid});
  return fmt::format("{} {}", process != names.process.end() ? process->second : fmt::format("rank {}", pid),
                     thread != names.thread.end() ? thread->second : fmt::format("tid {}", tid));
}

// A gnuplot single-quoted string: nothing is special in it but the quote, written twice.
std::string gnuplot_quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "''";
    } else {
      out += c == '\n' || c == '\r' ? ' ' : c;  // a line break would end the command
    }
  }
  return out + "'";
}

// Drawn in this order, so the later lie on the earlier: phases behind, waits (inside compute spans) on top.
std::vector<std::string> categories_in_drawing_order(const TraceTable& table) {
  std::vector<std::string> present;
  for (const auto& s : table.spans) {
    if (std::find(present.begin(), present.end(), s.category) == present.end()) present.push_back(s.category);
  }
  auto has = [&](const char* c) { return std::find(present.begin(), present.end(), c) != present.end(); };
  std::vector<std::string> order;
  for (const char* known : {"phase", "compute", "collective"}) {
    if (has(known)) order.push_back(known);
  }
  for (const auto& c : present) {
    if (c != "phase" && c != "compute" && c != "collective" && c != "wait") order.push_back(c);
  }
  if (has("wait")) order.push_back("wait");
  return order;
}

// How one category's boxes look: half their lane's height (a band of 0.9 for phases, 0.4 for waits) and a style.
std::pair<double, std::string> category_style(const std::string& category, size_t index) {
  if (category == "phase") return {0.45, "fs transparent solid 0.5 border lc rgb '#909090' fc rgb '#e4e4e4'"};
  if (category == "wait") return {0.2, "fs solid 1.0 noborder fc rgb '#c44e52'"};
  if (category == "compute") return {0.3, "fs solid 1.0 noborder fc rgb '#4c72b0'"};
  if (category == "collective") return {0.3, "fs solid 1.0 noborder fc rgb '#dd8452'"};
  static const char* const others[] = {"#55a868", "#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd"};
  return {0.3, fmt::format("fs solid 1.0 noborder fc rgb '{}'", others[index % std::size(others)])};
}

// One data file per category (so the key names them) and the plot command drawing them, x center, y lane, xdelta,
// ydelta (`with boxxyerror`).
std::string write_category_files(const TraceTable& table, const TempDir& dir) {
  std::string plot;
  const auto categories = categories_in_drawing_order(table);
  for (size_t i = 0; i < categories.size(); ++i) {
    const auto [half_height, style] = category_style(categories[i], i);
    const std::string file = fmt::format("category-{}.dat", i);
    std::ofstream out(dir.file(file));
    for (const auto& s : table.spans) {
      if (s.category != categories[i]) continue;
      out << fmt::format("{} {} {} {}\n", 0.5 * (s.begin_ms + s.end_ms), s.lane, 0.5 * (s.end_ms - s.begin_ms),
                         half_height);
    }
    plot += fmt::format("{}'{}' using 1:2:3:4 with boxxyerror {} title {}", i == 0 ? "plot " : ", \\\n     ", file,
                        style, gnuplot_quoted(categories[i]));
  }
  return plot + "\n";
}

std::string gnuplot_script(const TraceTable& table, const std::string& target, const std::string& title,
                           const std::string& plot) {
  std::string ytics;
  for (size_t i = 0; i < table.lanes.size(); ++i) {
    ytics += fmt::format("{}{} {}", i == 0 ? "" : ", ", gnuplot_quoted(table.lanes[i].name), i);
  }
  // noenhanced: span and lane names are shown as they are ("reduce_scatter" is no subscript).
  return fmt::format("set terminal pngcairo noenhanced size 1400,{}\nset output {}\nset title {}\nset xlabel 'ms'\n"
                     "set yrange [{}:-0.5]\nset ytics nomirror ({})\nset grid xtics\n"
                     "set key outside top center horizontal\nset autoscale xfix\n{}",
                     120 + 40 * table.lanes.size(), gnuplot_quoted(target), gnuplot_quoted(title),
                     static_cast<double>(table.lanes.size()) - 0.5, ytics, plot);
}

}  // namespace

TraceTable read_trace_table(const std::string& json_text) {
  TraceJson doc;
  try {
    doc = TraceJson::parse(json_text);
  } catch (const TraceJson::parse_error& e) {
    throw ConfigError(fmt::format("not JSON ({}); a trace is Chrome trace-event JSON, as `gradsync train --trace DIR` "
                                  "writes it", e.what()));
  }
  const TraceJson& events = events_of(doc);
  LaneNames names;
  std::vector<RawSpan> raw;
  for (size_t i = 0; i < events.size(); ++i) {
    const TraceJson& e = events[i];
    if (!e.is_object()) throw ConfigError(fmt::format("traceEvents[{}] is {}, not an event object", i, e.type_name()));
    const std::string ph = string_field(e, "ph");
    if (ph == "X") raw.push_back(read_span(e, i));
    if (ph == "M") read_names(e, names);
  }
  std::set<std::pair<int, int>> keys;  // ordered: by pid, then tid
  for (const auto& s : raw) keys.insert({s.pid, s.tid});
  for (const auto& named : names.thread) keys.insert(named.first);
  TraceTable table;
  std::map<std::pair<int, int>, int> lane_of;
  for (const auto& [pid, tid] : keys) {
    lane_of[{pid, tid}] = static_cast<int>(table.lanes.size());
    table.lanes.push_back({pid, tid, lane_name(names, pid, tid)});
  }
  for (auto& s : raw) {
    table.spans.push_back({lane_of.at({s.pid, s.tid}), s.ts / 1e3, (s.ts + s.dur) / 1e3, std::move(s.category),
                           std::move(s.name)});
  }
  return table;
}

std::string plot_trace_table(const TraceTable& table, const std::string& png, const std::string& title) {
  if (table.spans.empty()) return "nothing to draw: the trace holds no spans (\"ph\": \"X\" events)";
  if (auto missing = gnuplot_missing(); !missing.empty()) return missing;
  TempDir dir("gradsync-trace-plot-");
  const std::string target = std::filesystem::absolute(png).string();
  std::ofstream(dir.file("plot.gp")) << gnuplot_script(table, target, title, write_category_files(table, dir));
  return run_gnuplot(dir.path(), "plot.gp", target, std::chrono::minutes(1));
}

std::string plot_trace(const std::string& trace_file, const std::string& png, TraceTable* drawn) {
  std::error_code ec;
  if (std::filesystem::is_directory(trace_file, ec)) return trace_file + " is a directory, not a trace file";
  std::ifstream in(trace_file, std::ios::binary);
  if (!in) return fmt::format("cannot read {}: {}", trace_file, std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return fmt::format("cannot read {}: {}", trace_file, std::strerror(errno));
  TraceTable table;
  try {
    table = read_trace_table(text.str());
  } catch (const ConfigError& e) {
    return fmt::format("{}: {}", trace_file, e.what());
  }
  const std::string title = fmt::format("{}: {} lanes, {} spans", std::filesystem::path(trace_file).filename().string(),
                                        table.lanes.size(), table.spans.size());
  std::string why = plot_trace_table(table, png, title);
  if (why.empty() && drawn) *drawn = std::move(table);
  return why;
}

std::string trace_png_path(const std::string& trace_file) {
  std::filesystem::path path(trace_file);
  if (path.extension() == ".png") return trace_file + ".png";
  return path.replace_extension(".png").string();
}

}  // namespace gradsync::cli
