// Linked into a GPU test suite, runs it on the fake GPU: the fake runtime and
// the "fake-gpu" backend become cuda's before any test starts.
#include "gtest/gtest.h"
#include "kernels/gpu/gpu_backend.h"
#include "kernels/registry.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"

namespace packd {
namespace {

class FakeGpuEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    fakegpu::testing::Config config;
    config.memory_bytes = size_t{16} << 30;  // memfd-backed: only what is used
    fakegpu::testing::Configure(config);
    fake_gpu::RegisterGpuBackends(Registry::Global());
  }
};

::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new FakeGpuEnvironment);

}  // namespace
}  // namespace packd
