// libFuzzer target: region names, shared-memory keys, slices and tenants. One
// real 64 KiB segment is registered as region "r" of the anonymous tenant at
// start; each input is a RegisterSystemRegionRequest (a name and key to
// register, then unregister) followed by a RegionSlice to resolve against the
// registry, whose bytes are then read end to end (an out-of-bounds slice that
// resolved would be caught by AddressSanitizer). The first byte's top bits
// choose the tenant of each (anonymous or "job-a"): job-a resolving "r" is a
// crash, as another tenant's region must never resolve.
#include <google/protobuf/stubs/logging.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/shm_mapping.h"
#include "packd/v1/pack_service.pb.h"
#include "service/regions.h"

namespace {

struct World {
  std::unique_ptr<packd::ShmMapping> segment;
  std::unique_ptr<packd::RegionRegistry> regions;
};

World& TheWorld() {
  static World* world = [] {
    // Protobuf logs every string that is not UTF-8: quiet.
    google::protobuf::SetLogHandler(nullptr);
    auto* w = new World;
    auto segment = packd::ShmMapping::Create(
        absl::StrCat("/packd_fuzz_", getpid()), 64 << 10);
    if (!segment.ok()) abort();
    w->segment = std::move(*segment);
    packd::RegionOptions options;
    options.enabled = true;
    options.key_prefix = "/packd_fuzz";
    w->regions = std::make_unique<packd::RegionRegistry>(options);
    if (!w->regions
             ->RegisterSystem(packd::Tenant(), "r", w->segment->key(), 0,
                              64 << 10)
             .ok()) {
      abort();
    }
    // Mapped: the name can go now, so that no exit (libFuzzer's ends without
    // destructors) leaves it in /dev/shm.
    w->segment->Unlink();
    return w;
  }();
  return *world;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& world = TheWorld();
  if (size < 1) return 0;
  const size_t cut = data[0] % size;
  const packd::Tenant anyone, job_a = packd::Tenant::Named("job-a", "job-a");
  const packd::Tenant& registering = (data[0] & 0x40) ? job_a : anyone;
  const packd::Tenant& resolving = (data[0] & 0x80) ? job_a : anyone;
  const char* bytes = reinterpret_cast<const char*>(data);
  packd::v1::RegisterSystemRegionRequest reg;
  if (reg.ParseFromArray(bytes + 1, static_cast<int>(cut > 0 ? cut - 1 : 0)) &&
      reg.name() != "r") {
    packd::RegionRegistry::ValidateName(reg.name()).IgnoreError();
    if (world.regions
            ->RegisterSystem(registering, reg.name(), reg.key(), reg.offset(),
                             reg.byte_size())
            .ok()) {
      world.regions->Unregister(registering, reg.name()).IgnoreError();
    }
  }
  packd::v1::RegionSlice slice;
  if (!slice.ParseFromArray(bytes + cut, static_cast<int>(size - cut))) {
    return 0;
  }
  auto resolved = world.regions->Resolve(resolving, slice, "slice");
  if (resolved.ok() && &resolving == &job_a && slice.region() == "r") abort();
  if (resolved.ok() && resolved->byte_size > 0) {
    volatile char sum = 0;
    const char* p = static_cast<const char*>(resolved->data);
    sum += p[0];
    sum += p[resolved->byte_size - 1];
  }
  return 0;
}
