// Worker scenario registry (see worker.h).
#include "support/worker.h"

#include <cstdio>
#include <map>

#include "launch/spawn.h"

namespace gradsync::test {
namespace {

std::map<std::string, WorkerFn>& registry() {
  static std::map<std::string, WorkerFn> workers;
  return workers;
}

}  // namespace

WorkerRegistrar::WorkerRegistrar(const char* name, WorkerFn fn) { registry()[name] = std::move(fn); }

int run_worker(int argc, char** argv) {
  if (argc < 3) return 2;
  auto it = registry().find(argv[2]);
  if (it == registry().end()) {
    std::fprintf(stderr, "unknown worker scenario '%s'\n", argv[2]);
    return 2;
  }
  std::vector<std::string> args(argv + 3, argv + argc);
  try {
    int status = it->second(args);
    std::fflush(stdout);
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker %s failed: %s\n", argv[2], e.what());
    return 1;
  }
}

std::vector<std::string> worker_argv(const std::string& name, const std::vector<std::string>& args) {
  std::vector<std::string> argv{cli::self_executable(), "--worker", name};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

}  // namespace gradsync::test
