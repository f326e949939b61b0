// GoogleTest main for the kernel tests: four CPU threads even on a two-core
// machine, so that work is split into several pieces and the piece boundaries
// are exercised.
#include "gtest/gtest.h"
#include "kernels/thread_pool.h"

int main(int argc, char** argv) {
  packd::ThreadPool::SetGlobalThreads(4);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
