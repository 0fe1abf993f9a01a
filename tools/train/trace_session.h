// defines: TraceSession, `gradsync train --trace DIR`: one rank's Tracer (trace.h) set on the world before the
// engine exists, the clocks of the ranks aligned at start, each step's breakdown into its StepRecord, and at the end
// DIR/trace-rank-R.json on every rank, DIR/trace.json (every rank's lanes) and the time summary on rank 0.
#pragma once
#include <memory>
#include <string>

#include "gradsync/engine.h"
#include "gradsync/runtime.h"
#include "gradsync/trace.h"
#include "train/train.h"

namespace gradsync::cli {

class TraceSession {
 public:
  // Collective when `dir` is given (one barrier and one allgather: the clock offsets); nothing otherwise.
  TraceSession(const std::string& dir, const std::shared_ptr<World>& world);
  Tracer* tracer() const { return tracer_.get(); }
  void begin_step(int64_t step);
  void end_step(StepRecord& record);  // the step's compute, communication, exposed time and overlap
  // Collective: writes the files; rank 0 prints each rank's median step breakdown unless `quiet`.
  void finish(const Engine& engine, bool quiet);

 private:
  std::string dir_;
  std::shared_ptr<World> world_;
  std::shared_ptr<Tracer> tracer_;
  TraceFileInfo info_;
};

}  // namespace gradsync::cli
