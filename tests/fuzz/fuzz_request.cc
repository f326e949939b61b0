// libFuzzer target: a whole Pack, Scatter or PackMicroBatches request, bytes
// in, through what the server does with it: the wire parser (split into two
// chunks where the first byte says), the request decoder, the op on the host
// (a step: measured, planned, each micro-batch packed) and the reply's
// encoding. Any crash, leak or sanitizer report is a bug; statuses are fine.
// The first byte: bit 0 Scatter, else bit 7 PackMicroBatches, else Pack.
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "proto/wire.h"
#include "server/pack_service.h"

namespace {

packd::ServiceCore& Service() {
  static auto* service = [] {
    // Protobuf logs every string that is not UTF-8: quiet.
    google::protobuf::SetLogHandler(nullptr);
    packd::ServiceOptions options;
    options.default_device = packd::Device::Cpu();
    options.max_message_bytes = 1 << 20;
    options.regions.enabled = true;
    options.regions.key_prefix = "/packd_fuzz";
    return new packd::PackServiceImpl(options);
  }();
  return service->core();
}

// Parses `chunks` as a `Request` and, when that works, runs it through
// `op` as protobuf would have parsed it.
template <typename Request, typename Response, typename Impl>
void Run(absl::Span<const absl::string_view> chunks,
         absl::Status (Impl::*op)(const Request&, Response*)) {
  packd::Wire<Request> request;
  if (!request.Parse(chunks).ok()) return;
  request.CopyPayloadsIntoData();
  Response response;
  (Service().*op)(request.message(), &response).IgnoreError();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool scatter = data[0] & 1;
  const size_t cut = size > 1 ? (data[0] >> 1) % size : 0;
  const absl::string_view bytes(reinterpret_cast<const char*>(data) + 1,
                                size - 1);
  const std::vector<absl::string_view> chunks = {
      bytes.substr(0, std::min(cut, bytes.size())),
      bytes.substr(std::min(cut, bytes.size()))};
  if (scatter) {
    Run(chunks, &packd::ServiceCore::DoScatter);
  } else if (data[0] & 0x80) {
    Run(chunks, &packd::ServiceCore::TEST_PackMicroBatches);
  } else {
    Run(chunks, &packd::ServiceCore::DoPack);
  }
  return 0;
}
