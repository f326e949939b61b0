// The region RPCs as tests make them: each call with a context of its own,
// carrying a bearer token when one is given (a tenant's, docs/service.md).
//
//   EXPECT_TRUE(RegisterSystemRegion(*stub, "batch", "/packd_test-1", 0,
//   4096).ok()); EXPECT_EQ(UnregisterRegion(*stub, "batch",
//   "other-job-token").error_code(),
//             grpc::StatusCode::NOT_FOUND);
#ifndef PACKD_TESTS_E2E_REGION_CALLS_H_
#define PACKD_TESTS_E2E_REGION_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "packd/v1/pack_service.grpc.pb.h"

namespace packd::testing {

// `context` carrying `token` (none when empty).
inline void WithToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
}

inline grpc::Status RegisterSystemRegion(v1::PackService::Stub& stub,
                                         const std::string& name,
                                         const std::string& key,
                                         uint64_t offset, uint64_t bytes,
                                         const std::string& token = "",
                                         uint32_t lease_seconds = 0) {
  v1::RegisterSystemRegionRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(bytes);
  request.set_lease_seconds(lease_seconds);
  grpc::ClientContext context;
  WithToken(&context, token);
  v1::RegisterRegionResponse response;
  return stub.RegisterSystemRegion(&context, request, &response);
}

inline grpc::Status UnregisterRegion(v1::PackService::Stub& stub,
                                     const std::string& name,
                                     const std::string& token = "") {
  v1::UnregisterRegionRequest request;
  request.set_name(name);
  grpc::ClientContext context;
  WithToken(&context, token);
  v1::UnregisterRegionResponse response;
  return stub.UnregisterRegion(&context, request, &response);
}

// The names ListRegions answers, in its order; `status` gets its status.
inline std::vector<std::string> ListRegionNames(
    v1::PackService::Stub& stub, const std::string& token = "",
    grpc::Status* status = nullptr) {
  grpc::ClientContext context;
  WithToken(&context, token);
  v1::ListRegionsResponse response;
  const grpc::Status got =
      stub.ListRegions(&context, v1::ListRegionsRequest(), &response);
  if (status != nullptr) *status = got;
  std::vector<std::string> names;
  for (const v1::RegionInfo& info : response.regions()) {
    names.push_back(info.name());
  }
  return names;
}

}  // namespace packd::testing

#endif  // PACKD_TESTS_E2E_REGION_CALLS_H_
