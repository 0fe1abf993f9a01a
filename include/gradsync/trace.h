// defines: Tracer, one rank's timeline: the spans its engine, its collectives and its training loop report
// (forward and backward per FSDP unit, each DDP bucket's all-reduce from launch to completion, all-gathers,
// reduce-scatters, the replicas' all-reduce, waits, the optimizer step, data, checkpoints), what each step's time
// went to (StepBreakdown), and the Chrome trace-event JSON Perfetto and chrome://tracing open (trace_json).
//
//   auto tracer = std::make_shared<gradsync::Tracer>();
//   world->comm().set_tracer(tracer);   // before constructing the engine: its groups and collectives report to it
//   for (int64_t step = 0; ...; ++step) {
//     tracer->begin_step(step);
//     ... accumulate(engine, K, ...); optimizer.step();   // { TraceSpan s(tracer.get(), "optimizer"); ... }
//     tracer->end_step();
//     auto b = tracer->breakdown(step);   // compute, communication, exposed communication, overlap
//   }
//   write_text(trace_json(tracer->events(), {rank, ...}));
//
// Without a tracer nothing is recorded and nothing is timed: every report point tests one pointer.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gradsync {

struct TraceEvent {
  // Compute: forward, backward, optimizer (what the step's compute time is made of). Collective: from launch to
  // completion, on its group's stream. Wait: the calling thread blocked on a collective (exposed communication).
  // Phase: the step itself, data loading, checkpoint writes: on the timeline, in no figure of the breakdown.
  enum class Kind { Compute, Collective, Wait, Phase };
  Kind kind = Kind::Phase;
  std::string name;   // "forward", "backward", "optimizer", "allreduce", "allgather", "reduce_scatter", "wait", ...
  std::string label;  // what it belongs to: "bucket 2", "unit layers.0", "global-mean count", "" for nothing
  int64_t begin_ns = 0;  // Tracer::now_ns(): CLOCK_MONOTONIC, one clock for every process of a host
  int64_t end_ns = 0;
  int64_t step = -1;     // the step it happened in; -1 outside begin_step()/end_step()
  // Collectives (and the waits on them):
  std::string group;      // "world", or the sub-group's name ("shard", "replica", "shard/replica")
  std::string reduction;  // "sum" for the reductions (every scaling happens before, see factor), "" otherwise
  double factor = 1;      // the factor the gradient was multiplied by before the sum (Mean's 1/N, GlobalMean's 1/T)
  int64_t bytes = 0;      // the tensor's bytes (all-gather: the gathered whole; reduce-scatter: the whole input)
  int64_t sent = 0;       // the bytes this rank sends by the ring algorithm, as CommStats counts them
  int64_t sequence = 0;   // the group's operation number (the same on every rank of the group)
};

// What one step's time went to on one rank, from the spans of that step.
struct StepBreakdown {
  double step_seconds = 0;
  double compute_seconds = 0;        // the union of Compute spans, less the waits inside them
  double communication_seconds = 0;  // the union of Collective spans, from launch to completion
  double exposed_seconds = 0;        // the union of Wait spans: communication nothing computed under
  // The share of communication time hidden under other work: 1 - |collectives ∩ waits| / |collectives|; 0 when
  // the step communicated nothing.
  double overlap = 0;
};

class Tracer {
 public:
  static int64_t now_ns();

  // The step whose events follow (a "step N" Phase span from begin to end).
  void begin_step(int64_t step);
  void end_step();
  int64_t step() const;

  void record(TraceEvent event);  // thread-safe; fills in the current step
  std::vector<TraceEvent> events() const;
  StepBreakdown breakdown(int64_t step) const;  // of a step that ended

 private:
  mutable std::mutex mutex_;
  std::vector<TraceEvent> events_;
  int64_t step_ = -1;
  int64_t step_begin_ns_ = 0;
  size_t step_first_event_ = 0;  // events_ index where the current step's begin
  std::vector<std::pair<int64_t, size_t>> step_ranges_;  // per ended step: its first event index
};

// RAII: a span of `tracer` (none when it is null) from construction to destruction.
class TraceSpan {
 public:
  TraceSpan(Tracer* tracer, std::string name, TraceEvent::Kind kind = TraceEvent::Kind::Compute,
            std::string label = {});
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  TraceEvent event_;
};

// RAII: the collectives this thread launches while it lives carry `label` and `factor` (DDP: "bucket 2" with the
// 1/N folded into its copy; FSDP: "unit layers.0"). Labels nest; the innermost wins.
class TraceLabel {
 public:
  TraceLabel(Tracer* tracer, std::string label, double factor = 1.0);
  ~TraceLabel();
  TraceLabel(const TraceLabel&) = delete;
  TraceLabel& operator=(const TraceLabel&) = delete;
  static const TraceLabel* current();  // this thread's innermost, or null
  const std::string& label() const { return label_; }
  double factor() const { return factor_; }

 private:
  bool active_;
  std::string label_;
  double factor_;
  const TraceLabel* outer_;
};

// The breakdown of the events of one step on one rank (any order). Exposed for tests and merged files.
StepBreakdown breakdown_of(const std::vector<TraceEvent>& events, int64_t begin_ns, int64_t end_ns);

struct TraceFileInfo {
  int rank = 0;
  int world_size = 1;
  std::string host;
  int64_t origin_ns = 0;        // this rank's clock at the job's time zero (rank 0's start, moved by the offset)
  int64_t clock_offset_ns = 0;  // rank 0's clock minus this rank's, measured at start (0 on rank 0's host)
};

// One rank's events as Chrome trace-event JSON: {"traceEvents": [...], "otherData": {...}}. pid = rank; tid 0 the
// thread that trains (compute, waits, phases), then one lane per group's stream of collectives (a second lane
// where two of a group overlap). Times are microseconds from the job's time zero; "args" hold label, bytes,
// sent, group, reduction, factor and sequence; "otherData" the rank, host, clock offset and each step's breakdown.
std::string trace_json(const std::vector<TraceEvent>& events, const TraceFileInfo& info);
// Several ranks' trace_json() outputs as one file with a lane set per rank (pid = rank).
std::string merge_trace_json(const std::vector<std::string>& per_rank);

}  // namespace gradsync
