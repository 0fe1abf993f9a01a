// defines: record_faults(), how each test of the fault suite (ctest label `faults`) reports what it injected and
// what came of it. Records are JSON lines in <build>/faults.jsonl; the suite's last test, Faults.Summary
// (tests/faults_summary.py), prints the one summary line and fails on any hang, orphan, half-written checkpoint,
// unclean error, inexact resume or code run from a file.
#pragma once
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace gradsync::test {

struct FaultRecord {
  int injected = 0;       // faults injected (kills, stops, cut links, bad files, stray clients, ...)
  int clean = 0;          // of those, clean errors naming the right rank, parameter or file (or clean recoveries)
  int hangs = 0;          // runs that outlived their timeout
  int orphans = 0;        // processes left behind
  int half_written = 0;   // checkpoints a resume would take that cannot be loaded
  int resumes = 0;        // resumed runs compared with uninterrupted ones
  int exact_resumes = 0;  // of those, bit-identical
  int code_executed = 0;  // payloads in files that ran
};

inline void record_faults(const FaultRecord& r) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const nlohmann::json line{{"test", std::string(info->test_suite_name()) + "." + info->name()},
                            {"injected", r.injected}, {"clean", r.clean}, {"hangs", r.hangs},
                            {"orphans", r.orphans}, {"half_written", r.half_written}, {"resumes", r.resumes},
                            {"exact_resumes", r.exact_resumes}, {"code_executed", r.code_executed}};
  std::ofstream(std::string(GRADSYNC_BUILD_DIR) + "/faults.jsonl", std::ios::app) << line.dump() << "\n";
}

}  // namespace gradsync::test
