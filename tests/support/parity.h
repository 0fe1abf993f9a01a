// defines: what the parity tests with real PyTorch share (test_parity.cpp, test_sharded_parity.cpp): where the
// reference scripts are, the case files both sides start from, the flags both sides take, and their JSONL logs.
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/subprocess.h"

namespace gradsync::test::parity {

inline const std::string kPython = "/usr/bin/python3";
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

}  // namespace gradsync::test::parity
