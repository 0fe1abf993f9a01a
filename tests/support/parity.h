// defines: what the parity tests with real PyTorch share (test_parity.cpp, test_sharded_parity.cpp): where the
// reference scripts are, the case files both sides start from, the flags both sides take, their JSONL logs, and the
// comparisons of their results.
#pragma once
#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/subprocess.h"

namespace gradsync::test::parity {

inline const std::string kPython = GRADSYNC_PYTHON;
inline const std::string kReference = std::string(GRADSYNC_SOURCE_DIR) + "/tests/reference";

// make_case.py: DIR/data.pt (samples of the case's loss) and DIR/init.pt (the model's initial state).
template <typename Case>
ProcessResult make_case(const Case& c, const std::string& seed, const std::string& dir, const CommandOptions& o) {
  return run({kPython, kReference + "/make_case.py", "--model", c.model, "--n", std::to_string(c.samples), "--loss",
              c.loss, "--seed", seed, "--data-out", dir + "/data.pt", "--state-out", dir + "/init.pt"},
             o);
}

// The flags `gradsync train` and torch_train.py both take; the run writes DIR/TAG.pt and DIR/TAG.jsonl.
template <typename Case>
std::vector<std::string> train_flags(const Case& c, const std::string& dir, const std::string& tag,
                                     const std::vector<std::string>& extra) {
  std::vector<std::string> flags{"--model", c.model, "--data", dir + "/data.pt", "--loss", c.loss,
                                 "--global-batch", std::to_string(c.global_batch), "--accumulate",
                                 std::to_string(c.accumulate), "--world-size", std::to_string(c.world),
                                 "--init-state", dir + "/init.pt", "--save-state", dir + "/" + tag + ".pt",
                                 "--log", dir + "/" + tag + ".jsonl"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

inline std::vector<nlohmann::json> read_log(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// One check: compare_states.py ("states") or compare_optim_states.py ("optim") with its arguments.
struct Comparison {
  std::string tool;
  std::vector<std::string> args;
};

// Runs every check in one python3 process (compare_many.py, DIR/compare_jobs.json): one import of torch instead of
// one per check. One result per check, in order, as the tool alone would give it (its exit code, its output). A
// check without a line fails with the process's own account; so does every check when the process timed out, was
// killed, or exited otherwise than its lines say (0 exactly when every check passed).
inline std::vector<ProcessResult> compare_all(const std::vector<Comparison>& checks, const std::string& dir,
                                              const CommandOptions& o) {
  nlohmann::json jobs = nlohmann::json::array();
  for (const auto& c : checks) jobs.push_back({{"tool", c.tool}, {"args", c.args}});
  const std::string file = dir + "/compare_jobs.json";
  std::ofstream(file) << jobs.dump();
  auto all = run({kPython, kReference + "/compare_many.py", file}, o);
  std::vector<ProcessResult> results(checks.size());
  std::istringstream lines(all.out);
  std::string line;
  for (auto& r : results) {
    if (!std::getline(lines, line) || line.empty() || line[0] != '{') {
      r.exit_code = -1;
      r.out = "compare_many.py gave no result for this check: " + all.describe();
      continue;
    }
    auto j = nlohmann::json::parse(line);
    r.exit_code = j.at("status").get<int>();
    r.out = j.at("output").get<std::string>();
  }
  const bool every_check_passed = std::all_of(results.begin(), results.end(), [](const ProcessResult& r) { return r.ok(); });
  if (all.timed_out || all.term_signal != 0 || (all.exit_code == 0) != every_check_passed) {
    for (auto& r : results) {
      r.exit_code = -1;
      r.out = "compare_many.py failed as a whole: " + all.describe() + "\n" + r.out;
    }
  }
  return results;
}

}  // namespace gradsync::test::parity
