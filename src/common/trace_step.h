// A step on one rank's timeline: the phase "step N" that Tracer::end_step() records bounds it, and its breakdown
// is computed over that phase. Tracer::breakdown() and the "steps" of a trace file both use this, so the figures
// `--log` prints and the ones a trace file holds are the same computation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/trace.h"

namespace gradsync {

std::string step_phase_name(int64_t step);

// The breakdown of `step` from `events` (any events; those of other steps are skipped), or nullopt when its phase
// is not among them (a step that has not ended).
std::optional<StepBreakdown> step_breakdown(const std::vector<TraceEvent>& events, int64_t step);

}  // namespace gradsync
