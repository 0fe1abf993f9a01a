// Test entry point: GoogleTest, or one rank of a multi-process scenario when started with --worker.
#include <cstring>

#include <gtest/gtest.h>

#include "support/worker.h"

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--worker") == 0) return gradsync::test::run_worker(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
