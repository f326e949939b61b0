// Test helpers between at::Tensor and packd.v1 messages: inline tensors, region
// handles and slices, and a byte-for-byte comparison of a returned tensor with
// torch's.
//
//   *request.add_inputs() = ToProto(x);                    // inline bytes
//   *request.add_inputs() = InRegion(x, "w0", offset);     // a handle
//   EXPECT_TRUE(SameTensor(ReferencePack(x, mask), response.packed(0)));
#ifndef PACKD_TESTS_E2E_PROTO_UTIL_H_
#define PACKD_TESTS_E2E_PROTO_UTIL_H_

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gtest/gtest.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/tensor_codec.h"
#include "tests/kernels/test_util.h"

namespace packd::testing {

// A tensor's shape as packd's headers hold it.
inline Shape ShapeOf(const at::Tensor& t) {
  return Shape(t.sizes().begin(), t.sizes().end());
}

// dtype and shape only.
inline v1::Tensor Header(const at::Tensor& t) {
  v1::Tensor out;
  EncodeTensorHeader(FromScalarType(t.scalar_type()), t.sizes().vec(), &out);
  return out;
}

// With its bytes inline.
inline v1::Tensor ToProto(const at::Tensor& t_in) {
  const at::Tensor t = t_in.contiguous();
  v1::Tensor out;
  EncodeInlineTensor(FromScalarType(t.scalar_type()), t.sizes().vec(),
                     t.data_ptr(), t.nbytes(), &out);
  return out;
}

inline v1::RegionSlice Slice(const std::string& region, uint64_t offset,
                             uint64_t bytes) {
  v1::RegionSlice s;
  s.set_region(region);
  s.set_offset(offset);
  s.set_byte_size(bytes);
  return s;
}

// As a handle to `region` at `offset`, of exactly its byte size.
inline v1::Tensor InRegion(const at::Tensor& t, const std::string& region,
                           uint64_t offset) {
  v1::Tensor out = Header(t);
  *out.mutable_region() = Slice(region, offset, t.nbytes());
  return out;
}

// Success when `actual` has expected's dtype, shape and inline bytes.
inline ::testing::AssertionResult SameTensor(const at::Tensor& expected,
                                             const v1::Tensor& actual) {
  absl::StatusOr<TensorView> view = DecodeTensorHeader(actual, "actual");
  if (!view.ok()) {
    return ::testing::AssertionFailure() << view.status().message();
  }
  if (static_cast<int64_t>(actual.data().size()) != view->nbytes()) {
    return ::testing::AssertionFailure()
           << actual.data().size() << " data bytes for "
           << ShapeString(view->shape);
  }
  view->data = const_cast<char*>(actual.data().data());
  return SameBytes(expected, *view);
}

}  // namespace packd::testing

#endif  // PACKD_TESTS_E2E_PROTO_UTIL_H_
