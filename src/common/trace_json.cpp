// A rank's timeline as Chrome trace-event JSON, and the merge of every rank's into one file (see trace.h).
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradsync/trace.h"

#include "common/trace_step.h"

namespace gradsync {
namespace {

using nlohmann::json;

const char* category(TraceEvent::Kind kind) {
  switch (kind) {
    case TraceEvent::Kind::Compute: return "compute";
    case TraceEvent::Kind::Collective: return "collective";
    case TraceEvent::Kind::Wait: return "wait";
    case TraceEvent::Kind::Phase: return "phase";
  }
  return "phase";
}

json args_of(const TraceEvent& e) {
  json args = json::object();
  if (!e.label.empty()) args["label"] = e.label;
  if (e.step >= 0) args["step"] = e.step;
  if (e.kind == TraceEvent::Kind::Collective || e.kind == TraceEvent::Kind::Wait) {
    args["group"] = e.group;
    args["bytes"] = e.bytes;
    args["sent"] = e.sent;
    args["sequence"] = e.sequence;
    if (!e.reduction.empty()) args["reduction"] = e.reduction;
    if (!e.reduction.empty() || e.factor != 1) args["factor"] = e.factor;
  }
  return args;
}

// Collectives of one group may be in flight together (Gloo runs several at once); spans in one lane must nest, so a
// collective that starts before the lane's last one ended takes the group's next lane.
struct Lanes {
  std::map<std::string, std::vector<int64_t>> ends;  // group -> each of its lanes' last end
  std::map<std::pair<std::string, size_t>, int> tids;
  std::vector<std::string> names{"compute"};         // by tid

  int assign(const TraceEvent& e) {
    auto& lanes = ends[e.group];
    size_t lane = 0;
    while (lane < lanes.size() && lanes[lane] > e.begin_ns) ++lane;
    if (lane == lanes.size()) lanes.push_back(0);
    lanes[lane] = e.end_ns;
    auto [it, fresh] = tids.try_emplace({e.group, lane}, static_cast<int>(names.size()));
    if (fresh) names.push_back(lane == 0 ? "comm " + e.group : "comm " + e.group + " " + std::to_string(lane + 1));
    return it->second;
  }
};

json breakdown_json(const StepBreakdown& b, int64_t step) {
  return {{"step", step}, {"step_seconds", b.step_seconds}, {"compute_seconds", b.compute_seconds},
          {"communication_seconds", b.communication_seconds}, {"exposed_seconds", b.exposed_seconds},
          {"overlap", b.overlap}};
}

json steps_json(const std::vector<TraceEvent>& events) {
  std::map<int64_t, std::vector<TraceEvent>> by_step;
  for (const auto& e : events) {
    if (e.step >= 0) by_step[e.step].push_back(e);
  }
  json steps = json::array();
  for (const auto& [step, mine] : by_step) {
    if (const auto b = step_breakdown(mine, step)) steps.push_back(breakdown_json(*b, step));
  }
  return steps;
}

}  // namespace

std::string trace_json(const std::vector<TraceEvent>& events, const TraceFileInfo& info) {
  std::vector<const TraceEvent*> order;
  for (const auto& e : events) order.push_back(&e);
  // By start, and the longer first where two start together: a viewer then sees parents before children.
  std::stable_sort(order.begin(), order.end(), [](const TraceEvent* a, const TraceEvent* b) {
    return a->begin_ns != b->begin_ns ? a->begin_ns < b->begin_ns : a->end_ns > b->end_ns;
  });
  Lanes lanes;
  json out = json::array();
  for (const TraceEvent* e : order) {
    const int tid = e->kind == TraceEvent::Kind::Collective ? lanes.assign(*e) : 0;
    // A phase's label (a checkpoint's step) stays in args; anything else is named with what it belongs to.
    const bool plain = e->label.empty() || e->kind == TraceEvent::Kind::Phase;
    const std::string name = plain ? e->name : e->name + " " + e->label;
    out.push_back({{"ph", "X"}, {"name", name}, {"cat", category(e->kind)}, {"pid", info.rank}, {"tid", tid},
                   {"ts", 1e-3 * static_cast<double>(e->begin_ns - info.origin_ns)},
                   {"dur", 1e-3 * static_cast<double>(e->end_ns - e->begin_ns)}, {"args", args_of(*e)}});
  }
  out.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", info.rank},
                 {"args", {{"name", "rank " + std::to_string(info.rank)}}}});
  for (size_t tid = 0; tid < lanes.names.size(); ++tid) {
    out.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", info.rank}, {"tid", tid},
                   {"args", {{"name", lanes.names[tid]}}}});
  }
  json other{{"rank", info.rank}, {"world_size", info.world_size}, {"host", info.host},
             {"clock_offset_ns", info.clock_offset_ns}, {"steps", steps_json(events)}};
  return json{{"traceEvents", out}, {"displayTimeUnit", "ms"}, {"otherData", other}}.dump();
}

std::string merge_trace_json(const std::vector<std::string>& per_rank) {
  json events = json::array();
  json ranks = json::array();
  for (const auto& text : per_rank) {
    auto one = json::parse(text);
    for (auto& e : one["traceEvents"]) events.push_back(std::move(e));
    ranks.push_back(one["otherData"]);
  }
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", {{"ranks", ranks}}}}.dump();
}

}  // namespace gradsync
