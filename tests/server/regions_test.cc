// RegionRegistry in-process: every registered mapping is gone from
// /proc/self/maps, and no descriptor is left in /proc/self/fd, after unregister
// and after the registry is destroyed (server shutdown); slices are
// bounds-checked with overflow-safe arithmetic.
#include "server/regions.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include "client/shm_segment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/proto_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::Slice;

std::string SelfMaps() {
  std::ifstream f("/proc/self/maps");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int SelfDescriptors() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// The segment's own mapping in this process must not be mistaken for the
// registry's: count occurrences of the key in the maps.
int Mappings(const std::string& key) {
  const std::string maps = SelfMaps();
  int n = 0;
  for (size_t at = maps.find(key); at != std::string::npos;
       at = maps.find(key, at + 1))
    ++n;
  return n;
}

TEST(RegionRegistry, UnregisterAndDestructionUnmapAndCloseEverything) {
  std::unique_ptr<ShmSegment> a =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 1 << 20).value();
  std::unique_ptr<ShmSegment> b =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 3 << 20).value();
  const int fds_before = SelfDescriptors();
  const int a_before = Mappings(a->key()), b_before = Mappings(b->key());
  {
    RegionRegistry regions({/*enabled=*/true, "/packd_test"});
    ASSERT_TRUE(regions.RegisterSystem("a", a->key(), 4096 + 7, 8192).ok());
    ASSERT_TRUE(regions.RegisterSystem("b", b->key(), 0, 3 << 20).ok());
    EXPECT_EQ(Mappings(a->key()), a_before + 1);
    EXPECT_EQ(Mappings(b->key()), b_before + 1);
    EXPECT_EQ(SelfDescriptors(), fds_before);

    // Bytes written through the registry land at the registered offset.
    absl::StatusOr<ResolvedSlice> s =
        regions.Resolve(Slice("a", 1, 4), "inputs[0]");
    ASSERT_TRUE(s.ok()) << s.status();
    std::memcpy(s->data, "abcd", 4);
    EXPECT_EQ(std::string(a->data() + 4096 + 8, 4), "abcd");

    // A slice held by a call keeps the mapping after unregister.
    ASSERT_TRUE(regions.Unregister("a").ok());
    EXPECT_EQ(Mappings(a->key()), a_before + 1);
    s = absl::StatusOr<ResolvedSlice>(absl::CancelledError());
    EXPECT_EQ(Mappings(a->key()), a_before);
    EXPECT_EQ(regions.Resolve(Slice("a", 0, 1), "x").status().code(),
              absl::StatusCode::kNotFound);
  }
  // "b" was still registered when the registry went away.
  EXPECT_EQ(Mappings(b->key()), b_before);
  EXPECT_EQ(SelfDescriptors(), fds_before);
}

// A client whose register call's reply was lost sends it again: the repeat
// finds its own region and succeeds without a second mapping; any other
// registration under the name is refused and changes nothing.
TEST(RegionRegistry, ARepeatedRegistrationSucceedsAndAClashIsRefused) {
  std::unique_ptr<ShmSegment> a =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 1 << 16).value();
  std::unique_ptr<ShmSegment> b =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 1 << 16).value();
  const int before = Mappings(a->key());
  RegionRegistry regions({true, "/packd_test"});
  ASSERT_TRUE(regions.RegisterSystem("r", a->key(), 0, 1 << 16, 5).ok());
  absl::Status again = regions.RegisterSystem("r", a->key(), 0, 1 << 16, 5);
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_EQ(Mappings(a->key()), before + 1);
  for (const auto& [key, offset, bytes] :
       {std::tuple<std::string, uint64_t, uint64_t>{b->key(), 0, 1 << 16},
        {a->key(), 0, 1 << 15},
        {a->key(), 64, 1 << 15}}) {
    absl::Status clash = regions.RegisterSystem("r", key, offset, bytes);
    EXPECT_EQ(clash.code(), absl::StatusCode::kAlreadyExists)
        << key << " " << offset << " " << bytes;
    EXPECT_THAT(std::string(clash.message()),
                HasSubstr("region \"r\" is already registered"));
  }
  EXPECT_EQ(Mappings(b->key()), 1);  // b's own mapping only
  ASSERT_EQ(regions.List().size(), 1u);
  EXPECT_EQ(regions.List()[0].byte_size(), uint64_t{1} << 16);

  // Device registrations: the same IPC handle, device and size repeat; the
  // registry keeps the first mapping.
  const std::string handle(64, '\x7f');
  const Device gpu{DeviceKind::kCuda, 0};
  char memory[64];
  auto owner = std::make_shared<int>(0);
  ASSERT_TRUE(
      regions
          .RegisterDevice("g", gpu, memory, 64, owner, 0,
                          RegionRegistry::DeviceIdentity(handle, gpu, 64))
          .ok());
  EXPECT_EQ(
      *regions.HeldAs("g", RegionRegistry::DeviceIdentity(handle, gpu, 64)),
      true);
  EXPECT_EQ(regions.HeldAs("g", RegionRegistry::DeviceIdentity(handle, gpu, 32))
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(regions.HeldAs("h", "x").value(), false);
}

TEST(RegionRegistry, SlicesAreBoundsCheckedWithoutOverflow) {
  std::unique_ptr<ShmSegment> seg =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 1 << 16).value();
  RegionRegistry regions({true, "/packd_test"});
  ASSERT_TRUE(regions.RegisterSystem("r", seg->key(), 0, 1 << 16).ok());
  EXPECT_TRUE(regions.Resolve(Slice("r", 0, 1 << 16), "f").ok());
  EXPECT_TRUE(regions.Resolve(Slice("r", 1 << 16, 0), "f").ok());
  for (auto [offset, bytes] : {std::pair<uint64_t, uint64_t>{1, 1 << 16},
                               {1 << 16, 1},
                               {UINT64_MAX, 2},
                               {2, UINT64_MAX}}) {
    absl::StatusOr<ResolvedSlice> s =
        regions.Resolve(Slice("r", offset, bytes), "outputs[3]");
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << offset << "+" << bytes;
    EXPECT_THAT(std::string(s.status().message()),
                HasSubstr("outputs[3]: slice"));
  }
  auto list = regions.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].name(), "r");
}

TEST(RegionRegistry, LeasesEndIdleRegionsButNeverOneInUse) {
  std::unique_ptr<ShmSegment> seg =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 1 << 16).value();
  const int before = Mappings(seg->key());
  RegionRegistry regions({true, "/packd_test", absl::Hours(1)});  // by hand
  ASSERT_TRUE(regions.RegisterSystem("leased", seg->key(), 0, 4096, 2).ok());
  ASSERT_TRUE(regions.RegisterSystem("busy", seg->key(), 0, 4096, 1).ok());
  ASSERT_TRUE(regions.RegisterSystem("kept", seg->key(), 0, 4096, 0).ok());
  EXPECT_EQ(Mappings(seg->key()), before + 3);
  EXPECT_EQ(regions.size("system"), 3);
  EXPECT_EQ(regions.size("device"), 0);
  std::vector<v1::RegionInfo> list = regions.List();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].name(), "busy");
  EXPECT_EQ(list[0].lease_seconds(), 1u);
  EXPECT_EQ(list[1].lease_seconds(), 0u);
  EXPECT_EQ(list[2].lease_seconds(), 2u);

  const int64_t now = absl::GetCurrentTimeNanos();
  const int64_t second = 1000000000;
  EXPECT_EQ(regions.ExpireLeases(now + second / 2), 0);
  absl::StatusOr<ResolvedSlice> held =
      regions.Resolve(Slice("busy", 0, 8), "inputs[0]");
  ASSERT_TRUE(held.ok()) << held.status();
  // Long past every lease: "leased" goes, "busy" is in use, "kept" has none.
  EXPECT_EQ(regions.ExpireLeases(now + 100 * second), 1);
  EXPECT_EQ(regions.expired(), 1);
  EXPECT_EQ(regions.Resolve(Slice("leased", 0, 1), "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Mappings(seg->key()), before + 2);
  held = absl::CancelledError();  // the call ends
  EXPECT_EQ(regions.ExpireLeases(now + 100 * second), 1);
  EXPECT_EQ(regions.size(), 1);
  EXPECT_EQ(regions.size("system"), 1);
  EXPECT_EQ(regions.expired(), 2);
  EXPECT_EQ(Mappings(seg->key()), before + 1);
}

TEST(RegionRegistry, CallsNamingARegionRenewItsLease) {
  std::unique_ptr<ShmSegment> seg =
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_test"), 1 << 16).value();
  RegionRegistry regions({true, "/packd_test", absl::Milliseconds(20)});
  ASSERT_TRUE(regions.RegisterSystem("named", seg->key(), 0, 4096, 1).ok());
  ASSERT_TRUE(regions.RegisterSystem("idle", seg->key(), 0, 4096, 1).ok());
  // Named every 100 ms for 1.6 s (past its 1 s lease), "named" stays.
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(regions.Resolve(Slice("named", 0, 1), "x").ok()) << i;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(regions.Resolve(Slice("idle", 0, 1), "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(regions.expired(), 1);
  absl::SleepFor(absl::Milliseconds(1300));
  EXPECT_EQ(regions.size(), 0);
  EXPECT_EQ(regions.expired(), 2);
}

TEST(RegionRegistry, KeysAndNames) {
  EXPECT_TRUE(RegionRegistry::ValidateKey("/packd_a-1.b", "/packd").ok());
  for (const char* bad :
       {"", "/", "packd", "/packd/x", "/packd x", "/.", "/.."}) {
    EXPECT_EQ(RegionRegistry::ValidateKey(bad, "/").code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_THAT(
      std::string(RegionRegistry::ValidateKey("/other", "/packd").message()),
      HasSubstr("--shm_key_prefix"));
  EXPECT_TRUE(RegionRegistry::ValidateName("worker-3/hidden:0").ok());
  EXPECT_FALSE(RegionRegistry::ValidateName("").ok());
  EXPECT_FALSE(RegionRegistry::ValidateName(std::string(257, 'x')).ok());
  EXPECT_FALSE(RegionRegistry::ValidateName("tab\there").ok());
}

TEST(RegionRegistry, DisabledRefusesEverything) {
  RegionRegistry regions({false, "/packd"});
  EXPECT_EQ(regions.RegisterSystem("r", "/packd_x", 0, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(regions.Resolve(Slice("r", 0, 1), "f").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(regions.Unregister("r").code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace packd
