#include "client/gpu_allocations.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace packd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Optional;
using ::testing::UnorderedElementsAre;

std::string Added(GpuAllocations& a, int device, uintptr_t base,
                  const std::string& handle, const std::string& region) {
  bool added = false;
  std::string got = a.Add(device, base, handle, region, &added);
  EXPECT_TRUE(added) << region;
  return got;
}

// An allocation is found by its memory's identity, on its device only.
TEST(GpuAllocationsTest, FindsAnAllocationByItsIdentityOnItsDevice) {
  GpuAllocations a;
  EXPECT_EQ(a.Find(0, 0x1000, "h1"), std::nullopt);
  Added(a, 0, 0x1000, "h1", "r1");
  Added(a, 1, 0x1000, "h1", "r2");
  EXPECT_THAT(a.Find(0, 0x1000, "h1"), Optional(std::string("r1")));
  EXPECT_THAT(a.Find(1, 0x1000, "h1"), Optional(std::string("r2")));
  EXPECT_THAT(a.TakeFreed(), IsEmpty());
}

// Another allocation at a freed one's address (another handle) frees the
// first's region, once.
TEST(GpuAllocationsTest, AnAddressBackAsAnotherAllocationFreesTheFirst) {
  GpuAllocations a;
  Added(a, 0, 0x1000, "old", "r1");
  Added(a, 0, 0x2000, "other", "r2");
  EXPECT_EQ(a.Find(0, 0x1000, "new"), std::nullopt);
  EXPECT_THAT(a.TakeFreed(), ElementsAre("r1"));
  EXPECT_EQ(a.Find(0, 0x1000, "old"), std::nullopt);
  EXPECT_THAT(a.Find(0, 0x2000, "other"), Optional(std::string("r2")));
  EXPECT_THAT(a.TakeFreed(), IsEmpty());
}

// Two calls registering one allocation at once: the second's region goes.
TEST(GpuAllocationsTest, ARegistrationRacedByAnotherIsFreed) {
  GpuAllocations a;
  Added(a, 0, 0x1000, "h", "first");
  bool added = true;
  EXPECT_EQ(a.Add(0, 0x1000, "h", "second", &added), "first");
  EXPECT_FALSE(added);
  EXPECT_THAT(a.TakeFreed(), ElementsAre("second"));
}

// The device memory's word frees an entry once, and after the allocations
// are gone it changes nothing.
TEST(GpuAllocationsTest, FreedMemoryFreesItsRegionEvenAfterTheClientIsGone) {
  std::function<void()> late;
  {
    GpuAllocations a;
    Added(a, 0, 0x1000, "h1", "r1");
    Added(a, 0, 0x2000, "h2", "r2");
    std::function<void()> freed = a.OnFreed(0, 0x1000, "r1");
    freed();
    freed();
    EXPECT_THAT(a.TakeFreed(), ElementsAre("r1"));
    EXPECT_EQ(a.Find(0, 0x1000, "h1"), std::nullopt);
    late = a.OnFreed(0, 0x2000, "r2");
    EXPECT_THAT(a.TakeFreed(/*all=*/true), UnorderedElementsAre("r2"));
    EXPECT_EQ(a.Find(0, 0x2000, "h2"), std::nullopt);
  }
  late();  // the allocations are gone: nothing to do, nothing touched
}

}  // namespace
}  // namespace packd
