// defines: worker scenarios for multi-process tests. A test starts N copies of the test binary itself with
// `--worker NAME ARGS...` (see run_ranks in subprocess.h); each copy runs the scenario registered under NAME as
// one rank and reports through its exit status and output. Real processes, as in production: no fork of a
// process whose torch thread pools are already running.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace gradsync::test {

using WorkerFn = std::function<int(const std::vector<std::string>& args)>;

struct WorkerRegistrar {
  WorkerRegistrar(const char* name, WorkerFn fn);
};

// Runs the scenario named in argv ("--worker NAME ARGS..."); returns its exit status. Exceptions are printed
// and give status 1.
int run_worker(int argc, char** argv);

// argv for starting this test binary as a worker: {"/proc/self/exe" resolved, "--worker", name, args...}.
std::vector<std::string> worker_argv(const std::string& name, const std::vector<std::string>& args = {});

// Fails a worker with a message (exceptions are turned into exit status 1 by run_worker).
#define WORKER_CHECK(cond, ...)                                                                        \
  do {                                                                                                 \
    if (!(cond)) throw std::runtime_error(fmt::format("check failed: {} at {}:{}: {}", #cond, __FILE__, \
                                                      __LINE__, fmt::format(__VA_ARGS__)));             \
  } while (0)

}  // namespace gradsync::test

#define GRADSYNC_WORKER(name)                                                                           \
  static int name##_worker(const std::vector<std::string>& args);                                      \
  static ::gradsync::test::WorkerRegistrar name##_registrar(#name, name##_worker);                      \
  static int name##_worker(const std::vector<std::string>& args)
