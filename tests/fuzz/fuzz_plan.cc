// libFuzzer target: a PlanMicroBatches request, bytes in (cost models, costs,
// groups, padding and pipeline order included), through the
// service's planner entry point (the message-size guard, the planner and its
// own checks, the response).
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>

#include "server/pack_service.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* service = [] {
    // Protobuf logs every string that is not UTF-8: quiet.
    google::protobuf::SetLogHandler(nullptr);
    packd::ServiceOptions options;
    options.default_device = packd::Device::Cpu();
    options.max_message_bytes = 1 << 20;
    return new packd::PackServiceImpl(options);
  }();
  packd::v1::PlanRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  packd::v1::PlanResponse response;
  service->core().DoPlan(request, &response).IgnoreError();
  return 0;
}
