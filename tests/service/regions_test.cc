// RegionRegistry in-process: every registered mapping is gone from
// /proc/self/maps, and no descriptor is left in /proc/self/fd, after unregister
// and after the registry is destroyed (server shutdown); slices are
// bounds-checked with overflow-safe arithmetic.
#include "service/regions.h"

#include <dirent.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include "absl/strings/str_replace.h"
#include "client/shm_mapping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/proto_util.h"

namespace packd {
namespace {

// The tenant of a packd without tokens, certificates or a unix socket.
const Tenant kAnyone;

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
  std::unique_ptr<ShmMapping> a =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 20).value();
  std::unique_ptr<ShmMapping> b =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 3 << 20).value();
  const int fds_before = SelfDescriptors();
  const int a_before = Mappings(a->key()), b_before = Mappings(b->key());
  {
    RegionRegistry regions({/*enabled=*/true, "/packd_test"});
    ASSERT_TRUE(
        regions.RegisterSystem(kAnyone, "a", a->key(), 4096 + 7, 8192).ok());
    ASSERT_TRUE(
        regions.RegisterSystem(kAnyone, "b", b->key(), 0, 3 << 20).ok());
    EXPECT_EQ(Mappings(a->key()), a_before + 1);
    EXPECT_EQ(Mappings(b->key()), b_before + 1);
    EXPECT_EQ(SelfDescriptors(), fds_before);

    // Bytes written through the registry land at the registered offset.
    absl::StatusOr<ResolvedSlice> s =
        regions.Resolve(kAnyone, Slice("a", 1, 4), "inputs[0]");
    ASSERT_TRUE(s.ok()) << s.status();
    std::memcpy(s->data, "abcd", 4);
    EXPECT_EQ(std::string(a->data() + 4096 + 8, 4), "abcd");

    // A slice held by a call keeps the mapping after unregister.
    ASSERT_TRUE(regions.Unregister(kAnyone, "a").ok());
    EXPECT_EQ(Mappings(a->key()), a_before + 1);
    s = absl::StatusOr<ResolvedSlice>(absl::CancelledError());
    EXPECT_EQ(Mappings(a->key()), a_before);
    EXPECT_EQ(regions.Resolve(kAnyone, Slice("a", 0, 1), "x").status().code(),
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
  std::unique_ptr<ShmMapping> a =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 16).value();
  std::unique_ptr<ShmMapping> b =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 16).value();
  const int before = Mappings(a->key());
  RegionRegistry regions({true, "/packd_test"});
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "r", a->key(), 0, 1 << 16, 5).ok());
  absl::Status again =
      regions.RegisterSystem(kAnyone, "r", a->key(), 0, 1 << 16, 5);
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_EQ(Mappings(a->key()), before + 1);
  for (const auto& [key, offset, bytes] :
       {std::tuple<std::string, uint64_t, uint64_t>{b->key(), 0, 1 << 16},
        {a->key(), 0, 1 << 15},
        {a->key(), 64, 1 << 15}}) {
    absl::Status clash =
        regions.RegisterSystem(kAnyone, "r", key, offset, bytes);
    EXPECT_EQ(clash.code(), absl::StatusCode::kAlreadyExists)
        << key << " " << offset << " " << bytes;
    EXPECT_THAT(std::string(clash.message()),
                HasSubstr("region \"r\" is already registered"));
  }
  EXPECT_EQ(Mappings(b->key()), 1);  // b's own mapping only
  ASSERT_EQ(regions.List(kAnyone).size(), 1u);
  EXPECT_EQ(regions.List(kAnyone)[0].byte_size(), uint64_t{1} << 16);

  // Device registrations: the same IPC handle, device and size repeat; the
  // registry keeps the first mapping.
  const std::string handle(64, '\x7f');
  const Device gpu{DeviceKind::kCuda, 0};
  char memory[64];
  auto owner = std::make_shared<int>(0);
  ASSERT_TRUE(
      regions
          .RegisterDevice(kAnyone, "g", gpu, memory, 64, owner, 0,
                          RegionRegistry::DeviceIdentity(handle, gpu, 64))
          .ok());
  EXPECT_EQ(*regions.HeldAs(kAnyone, "g",
                            RegionRegistry::DeviceIdentity(handle, gpu, 64)),
            true);
  EXPECT_EQ(
      regions
          .HeldAs(kAnyone, "g", RegionRegistry::DeviceIdentity(handle, gpu, 32))
          .status()
          .code(),
      absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(regions.HeldAs(kAnyone, "h", "x").value(), false);
}

TEST(RegionRegistry, SlicesAreBoundsCheckedWithoutOverflow) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 16).value();
  RegionRegistry regions({true, "/packd_test"});
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "r", seg->key(), 0, 1 << 16).ok());
  EXPECT_TRUE(regions.Resolve(kAnyone, Slice("r", 0, 1 << 16), "f").ok());
  EXPECT_TRUE(regions.Resolve(kAnyone, Slice("r", 1 << 16, 0), "f").ok());
  for (auto [offset, bytes] : {std::pair<uint64_t, uint64_t>{1, 1 << 16},
                               {1 << 16, 1},
                               {UINT64_MAX, 2},
                               {2, UINT64_MAX}}) {
    absl::StatusOr<ResolvedSlice> s =
        regions.Resolve(kAnyone, Slice("r", offset, bytes), "outputs[3]");
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << offset << "+" << bytes;
    EXPECT_THAT(std::string(s.status().message()),
                HasSubstr("outputs[3]: slice"));
  }
  auto list = regions.List(kAnyone);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].name(), "r");
}

TEST(RegionRegistry, LeasesEndIdleRegionsButNeverOneInUse) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 16).value();
  const int before = Mappings(seg->key());
  RegionRegistry regions({true, "/packd_test", absl::Hours(1)});  // by hand
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "leased", seg->key(), 0, 4096, 2).ok());
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "busy", seg->key(), 0, 4096, 1).ok());
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "kept", seg->key(), 0, 4096, 0).ok());
  // One object, mapped once however many regions name it.
  EXPECT_EQ(Mappings(seg->key()), before + 1);
  EXPECT_EQ(regions.size("system"), 3);
  EXPECT_EQ(regions.size("device"), 0);
  std::vector<v1::RegionInfo> list = regions.List(kAnyone);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].name(), "busy");
  EXPECT_EQ(list[0].lease_seconds(), 1u);
  EXPECT_EQ(list[1].lease_seconds(), 0u);
  EXPECT_EQ(list[2].lease_seconds(), 2u);

  const int64_t now = absl::GetCurrentTimeNanos();
  const int64_t second = 1000000000;
  EXPECT_EQ(regions.ExpireLeases(now + second / 2), 0);
  absl::StatusOr<ResolvedSlice> held =
      regions.Resolve(kAnyone, Slice("busy", 0, 8), "inputs[0]");
  ASSERT_TRUE(held.ok()) << held.status();
  // Long past every lease: "leased" goes, "busy" is in use, "kept" has none.
  EXPECT_EQ(regions.ExpireLeases(now + 100 * second), 1);
  EXPECT_EQ(regions.expired(), 1);
  EXPECT_EQ(
      regions.Resolve(kAnyone, Slice("leased", 0, 1), "x").status().code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(Mappings(seg->key()), before + 1);
  held = absl::CancelledError();  // the call ends
  EXPECT_EQ(regions.ExpireLeases(now + 100 * second), 1);
  EXPECT_EQ(regions.size(), 1);
  EXPECT_EQ(regions.size("system"), 1);
  EXPECT_EQ(regions.expired(), 2);
  EXPECT_EQ(Mappings(seg->key()), before + 1);
  // The mapping goes with the last region naming it.
  ASSERT_TRUE(regions.Unregister(kAnyone, "kept").ok());
  EXPECT_EQ(Mappings(seg->key()), before);
}

TEST(RegionRegistry, CallsNamingARegionRenewItsLease) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 1 << 16).value();
  RegionRegistry regions({true, "/packd_test", absl::Milliseconds(20)});
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "named", seg->key(), 0, 4096, 1).ok());
  ASSERT_TRUE(
      regions.RegisterSystem(kAnyone, "idle", seg->key(), 0, 4096, 1).ok());
  // Named every 100 ms for 1.6 s (past its 1 s lease), "named" stays.
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(regions.Resolve(kAnyone, Slice("named", 0, 1), "x").ok()) << i;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(regions.Resolve(kAnyone, Slice("idle", 0, 1), "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(regions.expired(), 1);
  absl::SleepFor(absl::Milliseconds(1300));
  EXPECT_EQ(regions.size(), 0);
  EXPECT_EQ(regions.expired(), 2);
}

// Tenants (docs/design.md §15): two may use one name; each sees, resolves,
// renews and unregisters its own only, and another's region is NOT_FOUND in
// the very words of an absent one.
TEST(RegionRegistry, ATenantSeesAndTouchesItsOwnRegionsOnly) {
  std::unique_ptr<ShmMapping> a_seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_testjob-a."), 4096)
          .value();
  std::unique_ptr<ShmMapping> b_seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_testjob-b."), 4096)
          .value();
  const Tenant a = Tenant::Named("job-a", "job-a");
  const Tenant b = Tenant::Named("job-b", "job-b");
  RegionRegistry regions({true, "/packd_test", absl::Hours(1)});
  EXPECT_EQ(regions.KeyPrefix(a), "/packd_testjob-a.");
  EXPECT_EQ(regions.KeyPrefix(kAnyone), "/packd_test");
  ASSERT_TRUE(
      regions.RegisterSystem(a, "batch", a_seg->key(), 0, 4096, 1).ok());
  ASSERT_TRUE(regions.RegisterSystem(b, "batch", b_seg->key(), 0, 4096).ok());
  ASSERT_TRUE(regions.RegisterSystem(a, "only-a", a_seg->key(), 0, 64).ok());
  std::memcpy(a_seg->data(), "AAAA", 4);
  std::memcpy(b_seg->data(), "BBBB", 4);
  absl::StatusOr<ResolvedSlice> got =
      regions.Resolve(b, Slice("batch", 0, 4), "inputs[0]");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(got->data, 4), "BBBB");

  const absl::Status absent =
      regions.Resolve(b, Slice("never", 0, 4), "inputs[0]").status();
  const absl::Status other =
      regions.Resolve(b, Slice("only-a", 0, 4), "inputs[0]").status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other.message(),
            absl::StrReplaceAll(absent.message(), {{"never", "only-a"}}));
  EXPECT_EQ(regions.Unregister(b, "only-a").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(regions.HeldAs(b, "only-a", "x").value(), false);
  ASSERT_EQ(regions.List(b).size(), 1u);
  EXPECT_EQ(regions.List(a).size(), 2u);
  EXPECT_TRUE(regions.List(kAnyone).empty());

  // B naming A's leased region renews nothing: it ends with its lease.
  const int64_t now = absl::GetCurrentTimeNanos();
  for (int i = 0; i < 3; ++i) {
    (void)regions.Resolve(b, Slice("batch", 0, 1), "x");
  }
  EXPECT_EQ(regions.ExpireLeases(now + 2'000'000'000), 1);
  EXPECT_EQ(regions.Resolve(a, Slice("batch", 0, 1), "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(a_seg->data(), 4), "AAAA");
  EXPECT_TRUE(regions.Resolve(b, Slice("batch", 0, 1), "x").ok());
}

// A named tenant's keys carry its prefix: inside --shm_key_prefix but
// outside its own is PERMISSION_DENIED naming both; outside
// --shm_key_prefix stays INVALID_ARGUMENT. A unix-socket peer may name only
// its own objects (root any).
TEST(RegionRegistry, KeysAreTheTenantsOwn) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_testjob-a."), 4096)
          .value();
  const Tenant a = Tenant::Named("job-a", "job-a");
  const Tenant b = Tenant::Named("job-b", "job-b");
  RegionRegistry regions({true, "/packd_test", absl::Hours(1)});
  const absl::Status denied =
      regions.RegisterSystem(b, "stolen", seg->key(), 0, 4096);
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(denied.message()),
              HasSubstr("is outside the key prefix \"/packd_testjob-b.\""));
  EXPECT_THAT(std::string(denied.message()), HasSubstr(seg->key()));
  EXPECT_EQ(regions.RegisterSystem(b, "x", "/elsewhere", 0, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(regions.RegisterSystem(a, "mine", seg->key(), 0, 4096).ok());
  // The anonymous tenant keeps the bare prefix.
  EXPECT_TRUE(regions.RegisterSystem(kAnyone, "any", seg->key(), 0, 64).ok());

  Tenant peer = Tenant::Named("uid:12345", "");
  peer.uid = 12345;
  const absl::Status foreign =
      regions.RegisterSystem(peer, "theirs", seg->key(), 0, 64);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(foreign.message()),
              HasSubstr("not of this caller (uid 12345)"));
  Tenant root = Tenant::Named("uid:0", "");
  root.uid = 0;
  EXPECT_TRUE(regions.RegisterSystem(root, "any", seg->key(), 0, 64).ok());
}

// --max_regions_per_tenant bounds each tenant alone, and a flood of
// registrations naming one object costs no new mapping.
TEST(RegionRegistry, ATenantsRegionsAreBoundedAndOneObjectIsMappedOnce) {
  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_test"), 4096).value();
  const int before = Mappings(seg->key());
  RegionOptions options{true, "/packd_test", absl::Hours(1)};
  options.max_regions_per_tenant = 100;
  RegionRegistry regions(options);
  const Tenant a = Tenant::Named("job-a", "");
  const Tenant b = Tenant::Named("job-b", "");
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(
        regions.RegisterSystem(a, absl::StrCat("r", i), seg->key(), i, 8).ok());
  }
  EXPECT_EQ(Mappings(seg->key()), before + 1);
  const absl::Status full = regions.RegisterSystem(a, "r100", seg->key(), 0, 8);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()),
              HasSubstr("--max_regions_per_tenant=100"));
  EXPECT_TRUE(regions.RegisterSystem(b, "r0", seg->key(), 0, 8).ok());
  ASSERT_TRUE(regions.Unregister(a, "r0").ok());
  EXPECT_TRUE(regions.RegisterSystem(a, "r100", seg->key(), 0, 8).ok());
  EXPECT_EQ(Mappings(seg->key()), before + 1);
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
  EXPECT_EQ(regions.RegisterSystem(kAnyone, "r", "/packd_x", 0, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(regions.Resolve(kAnyone, Slice("r", 0, 1), "f").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(regions.Unregister(kAnyone, "r").code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace packd
