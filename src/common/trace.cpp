// One rank's timeline (see trace.h): recording, spans and labels, the per-step breakdown (the JSON is trace_json.cpp).
#include "gradsync/trace.h"

#include <time.h>

#include <algorithm>
#include <map>
#include <utility>

#include "common/trace_step.h"

namespace gradsync {

int64_t Tracer::now_ns() {
  // CLOCK_MONOTONIC rather than steady_clock's unspecified epoch: every process of a host reads the same clock, so
  // the ranks of one host line up without an offset.
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

void Tracer::begin_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
  step_begin_ns_ = now_ns();
  step_first_event_ = events_.size();
}

void Tracer::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (step_ < 0) return;
  TraceEvent e;
  e.kind = TraceEvent::Kind::Phase;
  e.name = step_phase_name(step_);
  e.begin_ns = step_begin_ns_;
  e.end_ns = now_ns();
  e.step = step_;
  step_ranges_.emplace_back(step_, step_first_event_);
  events_.push_back(std::move(e));
  step_ = -1;
}

int64_t Tracer::step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return step_;
}

void Tracer::record(TraceEvent event) {
  std::lock_guard<std::mutex> lock(mutex_);
  event.step = step_;
  events_.push_back(std::move(event));
}

std::vector<TraceEvent> Tracer::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

StepBreakdown Tracer::breakdown(int64_t step) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Steps end in order, so the newest range is the usual one; the step's events follow its first index.
  for (auto it = step_ranges_.rbegin(); it != step_ranges_.rend(); ++it) {
    if (it->first != step) continue;
    const std::vector<TraceEvent> since(events_.begin() + static_cast<std::ptrdiff_t>(it->second), events_.end());
    return step_breakdown(since, step).value_or(StepBreakdown{});
  }
  return {};
}

// ---- spans and labels ----------------------------------------------------------------------------------------

TraceSpan::TraceSpan(Tracer* tracer, std::string name, TraceEvent::Kind kind, std::string label) : tracer_(tracer) {
  if (!tracer_) return;
  event_.kind = kind;
  event_.name = std::move(name);
  event_.label = std::move(label);
  event_.begin_ns = Tracer::now_ns();
}

TraceSpan::~TraceSpan() {
  if (!tracer_) return;
  event_.end_ns = Tracer::now_ns();
  tracer_->record(std::move(event_));
}

namespace {
thread_local const TraceLabel* innermost_label = nullptr;
}

TraceLabel::TraceLabel(Tracer* tracer, std::string label, double factor)
    : active_(tracer != nullptr), factor_(factor), outer_(innermost_label) {
  if (!active_) return;
  label_ = std::move(label);
  innermost_label = this;
}

TraceLabel::~TraceLabel() {
  if (active_) innermost_label = outer_;
}

const TraceLabel* TraceLabel::current() { return innermost_label; }

// ---- the breakdown ---------------------------------------------------------------------------------------------

namespace {

using Intervals = std::vector<std::pair<int64_t, int64_t>>;

// Sorted, disjoint, clipped to [lo, hi].
Intervals union_of(Intervals v, int64_t lo, int64_t hi) {
  for (auto& [b, e] : v) b = std::max(b, lo), e = std::min(e, hi);
  v.erase(std::remove_if(v.begin(), v.end(), [](const auto& i) { return i.second <= i.first; }), v.end());
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& i : v) {
    if (!out.empty() && i.first <= out.back().second) {
      out.back().second = std::max(out.back().second, i.second);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

int64_t length(const Intervals& v) {
  int64_t n = 0;
  for (const auto& [b, e] : v) n += e - b;
  return n;
}

// |a ∩ b| of two sorted disjoint sets.
int64_t overlap_length(const Intervals& a, const Intervals& b) {
  int64_t n = 0;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    n += std::max<int64_t>(0, std::min(a[i].second, b[j].second) - std::max(a[i].first, b[j].first));
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return n;
}

}  // namespace

StepBreakdown breakdown_of(const std::vector<TraceEvent>& events, int64_t begin_ns, int64_t end_ns) {
  std::map<TraceEvent::Kind, Intervals> spans;
  for (const auto& e : events) spans[e.kind].emplace_back(e.begin_ns, e.end_ns);
  const auto compute = union_of(spans[TraceEvent::Kind::Compute], begin_ns, end_ns);
  const auto comm = union_of(spans[TraceEvent::Kind::Collective], begin_ns, end_ns);
  const auto waits = union_of(spans[TraceEvent::Kind::Wait], begin_ns, end_ns);
  StepBreakdown b;
  b.step_seconds = 1e-9 * static_cast<double>(end_ns - begin_ns);
  b.compute_seconds = 1e-9 * static_cast<double>(length(compute) - overlap_length(compute, waits));
  b.communication_seconds = 1e-9 * static_cast<double>(length(comm));
  b.exposed_seconds = 1e-9 * static_cast<double>(length(waits));
  const int64_t comm_ns = length(comm);
  b.overlap = comm_ns == 0 ? 0.0 : 1.0 - static_cast<double>(overlap_length(comm, waits)) / comm_ns;
  return b;
}

std::string step_phase_name(int64_t step) { return "step " + std::to_string(step); }

std::optional<StepBreakdown> step_breakdown(const std::vector<TraceEvent>& events, int64_t step) {
  std::vector<TraceEvent> mine;
  const TraceEvent* phase = nullptr;
  const std::string name = step_phase_name(step);
  for (const auto& e : events) {
    if (e.step != step) continue;
    if (e.kind == TraceEvent::Kind::Phase && e.name == name) phase = &e;
    mine.push_back(e);
  }
  if (!phase) return std::nullopt;
  return breakdown_of(mine, phase->begin_ns, phase->end_ns);
}

}  // namespace gradsync
