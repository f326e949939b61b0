// Test helpers between at::Tensor and packd.v1 messages: inline tensors, region
// handles and slices, and a byte-for-byte comparison of a returned tensor with
// torch's.
//
//   *request.add_inputs() = ToProto(x);                    // inline bytes
//   *request.add_inputs() = InRegion(x, "w0", offset);     // a handle
//   EXPECT_TRUE(SameTensor(x.index({mask}), response.packed(0)));
#ifndef PACKD_TESTS_E2E_PROTO_UTIL_H_
#define PACKD_TESTS_E2E_PROTO_UTIL_H_

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/torch/torch_interop.h"
#include "packd/v1/pack_service.pb.h"

namespace packd::testing {

// dtype and shape only.
inline v1::Tensor Header(const at::Tensor& t) {
  v1::Tensor out;
  out.set_dtype(static_cast<v1::DType>(FromScalarType(t.scalar_type())));
  for (int64_t d : t.sizes()) out.add_shape(d);
  return out;
}

// With its bytes inline.
inline v1::Tensor ToProto(const at::Tensor& t_in) {
  const at::Tensor t = t_in.contiguous();
  v1::Tensor out = Header(t);
  out.set_data(static_cast<const char*>(t.data_ptr()), t.nbytes());
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

// True when `actual` has expected's dtype, shape and inline bytes.
inline ::testing::AssertionResult SameTensor(const at::Tensor& expected_in,
                                             const v1::Tensor& actual) {
  const at::Tensor expected = expected_in.contiguous();
  if (actual.dtype() !=
      static_cast<int>(FromScalarType(expected.scalar_type()))) {
    return ::testing::AssertionFailure()
           << "dtype " << v1::DType_Name(actual.dtype());
  }
  const std::vector<int64_t> shape(actual.shape().begin(),
                                   actual.shape().end());
  if (shape != expected.sizes().vec()) {
    return ::testing::AssertionFailure()
           << "shape " << ShapeString(shape)
           << " != " << ShapeString(expected.sizes().vec());
  }
  if (actual.data().size() != static_cast<size_t>(expected.nbytes()) ||
      (expected.nbytes() > 0 &&
       std::memcmp(actual.data().data(), expected.data_ptr(),
                   expected.nbytes()) != 0)) {
    return ::testing::AssertionFailure() << "bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// True when the `expected.nbytes()` bytes at `actual` equal expected's.
inline bool BytesEqual(const at::Tensor& expected, const char* actual) {
  return expected.nbytes() == 0 || std::memcmp(expected.contiguous().data_ptr(),
                                               actual, expected.nbytes()) == 0;
}

}  // namespace packd::testing

#endif  // PACKD_TESTS_E2E_PROTO_UTIL_H_
