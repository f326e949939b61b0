// Every validation error of Pack and Scatter: its status code, what its message
// names, and that nothing was written.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using ::testing::HasSubstr;

void ExpectError(const absl::Status& status, absl::StatusCode code,
                 const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(text));
}

class ValidationTest : public ::testing::Test {
 protected:
  // 5 active positions.
  at::Tensor mask_ =
      at::tensor({1, 0, 1, 1, 0, 0, 1, 1}, at::kInt).to(at::kBool).view({2, 4});
  at::Tensor x_ = at::randn({2, 4, 3});
  absl::Status PackStatus(const TensorView& mask,
                          std::vector<TensorView> inputs,
                          PackOptions options = {}) {
    return Pack(inputs, mask, options).status();
  }
  absl::Status ScatterStatus(const TensorView& mask,
                             std::vector<TensorView> packed,
                             ScatterOptions options = {}) {
    return Scatter(packed, mask, options).status();
  }
};

TEST_F(ValidationTest, MaskMustHaveRankTwo) {
  TensorView mask = AsView(mask_);
  mask.shape = {8};
  ExpectError(PackStatus(mask, {AsView(x_)}),
              absl::StatusCode::kInvalidArgument,
              "mask.shape [8] must have rank 2");
  mask.shape = {2, 2, 2};
  ExpectError(ScatterStatus(mask, {AsView(x_)}),
              absl::StatusCode::kInvalidArgument,
              "mask.shape [2, 2, 2] must have rank 2");
}

TEST_F(ValidationTest, InputsMustBeGiven) {
  ExpectError(PackStatus(AsView(mask_), {}), absl::StatusCode::kInvalidArgument,
              "inputs is empty");
  ExpectError(ScatterStatus(AsView(mask_), {}),
              absl::StatusCode::kInvalidArgument, "packed is empty");
}

TEST_F(ValidationTest, InputShapeMustStartWithMaskShape) {
  at::Tensor mask = at::ones({4, 16}, at::kBool);
  at::Tensor good = at::zeros({4, 16, 8});
  at::Tensor bad = at::zeros({4, 15, 8});
  ExpectError(
      PackStatus(AsView(mask), {AsView(good), AsView(bad)}),
      absl::StatusCode::kInvalidArgument,
      "inputs[1].shape [4, 15, 8] does not start with mask shape [4, 16]");
  at::Tensor rank1 = at::zeros({4});
  ExpectError(PackStatus(AsView(mask), {AsView(rank1)}),
              absl::StatusCode::kInvalidArgument,
              "inputs[0].shape [4] does not start with mask shape [4, 16]");
}

TEST_F(ValidationTest, DtypesMustBeValid) {
  TensorView x = AsView(x_);
  x.dtype = static_cast<DType>(42);
  ExpectError(PackStatus(AsView(mask_), {x}),
              absl::StatusCode::kInvalidArgument,
              "inputs[0].dtype 42 is not a supported dtype");
  TensorView mask = AsView(mask_);
  mask.dtype = DType::kUnspecified;
  ExpectError(PackStatus(mask, {AsView(x_)}),
              absl::StatusCode::kInvalidArgument,
              "mask.dtype 0 is not a supported dtype");
}

TEST_F(ValidationTest, NegativeDimsAndOverflowingSizes) {
  TensorView mask = AsView(mask_);
  mask.shape = {-2, 4};
  ExpectError(PackStatus(mask, {AsView(x_)}),
              absl::StatusCode::kInvalidArgument,
              "mask.shape [-2, 4] has a negative dim at index 0");
  TensorView x = AsView(x_);
  x.shape = {2, 4, int64_t{1} << 61};
  ExpectError(PackStatus(AsView(mask_), {x}),
              absl::StatusCode::kInvalidArgument,
              "inputs[0].shape [2, 4, 2305843009213693952] has more elements "
              "than int64");
  x.shape = {2, 4, int64_t{1} << 59};
  ExpectError(PackStatus(AsView(mask_), {x}),
              absl::StatusCode::kInvalidArgument,
              "of float32 has a byte size that overflows int64");
}

TEST_F(ValidationTest, DataMustBePresent) {
  TensorView x = AsView(x_);
  x.data = nullptr;
  ExpectError(PackStatus(AsView(mask_), {x}),
              absl::StatusCode::kInvalidArgument,
              "inputs[0] has no data for its 96 bytes");
}

TEST_F(ValidationTest, DevicesMustMatchAndExist) {
  TensorView x = AsView(x_);
  x.device = Device{DeviceKind::kCuda, 0};
  ExpectError(PackStatus(AsView(mask_), {x}),
              absl::StatusCode::kInvalidArgument,
              "inputs[0] is on cuda:0 but the mask is on cpu");
  TensorView mask = AsView(mask_);
  mask.device = Device{DeviceKind::kHip, 1};
  x.device = mask.device;
  absl::Status status = PackStatus(mask, {x});
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("hip:1"));
}

TEST_F(ValidationTest, UnknownImplementation) {
  PackOptions options;
  options.impl = "triton";
  ExpectError(PackStatus(AsView(mask_), {AsView(x_)}, options),
              absl::StatusCode::kNotFound,
              "no implementation \"triton\" on cpu; available: span, torch");
  ExpectError(Registry::Get(Device::Cpu(), "triton").status(),
              absl::StatusCode::kNotFound,
              "no implementation \"triton\" on cpu; available: span, torch");
}

TEST_F(ValidationTest, OutputsAreCheckedAndNothingIsWrittenOnError) {
  at::Tensor out0 = at::empty({5, 3});
  testing::FillCanary(out0);
  const at::Tensor canary = out0.clone();
  auto expect_untouched = [&] {
    EXPECT_TRUE(at::equal(out0.view(at::kByte), canary.view(at::kByte)));
  };
  at::Tensor ids = at::zeros({2, 4}, at::kLong);
  PackOptions options;

  std::vector<TensorView> one = {AsView(out0)};
  options.outputs = one;
  ExpectError(PackStatus(AsView(mask_), {AsView(x_), AsView(ids)}, options),
              absl::StatusCode::kInvalidArgument,
              "outputs has 1 entries but there are 2 inputs");
  expect_untouched();

  at::Tensor wrong_dtype = at::empty({5}, at::kInt);
  std::vector<TensorView> two = {AsView(out0), AsView(wrong_dtype)};
  options.outputs = two;
  ExpectError(PackStatus(AsView(mask_), {AsView(x_), AsView(ids)}, options),
              absl::StatusCode::kInvalidArgument,
              "outputs[1].dtype is int32 but the result is int64");
  expect_untouched();

  at::Tensor wrong_shape = at::empty({4}, at::kLong);
  two = {AsView(out0), AsView(wrong_shape)};
  options.outputs = two;
  ExpectError(PackStatus(AsView(mask_), {AsView(x_), AsView(ids)}, options),
              absl::StatusCode::kInvalidArgument,
              "outputs[1].shape is [4] but the result is [5]");
  expect_untouched();

  // An output inside an input, and two outputs sharing memory.
  at::Tensor big = at::zeros({2, 4, 3});
  TensorView inside = AsView(big);
  inside.shape = {5, 3};
  one = {inside};
  options.outputs = one;
  ExpectError(PackStatus(AsView(mask_), {AsView(big)}, options),
              absl::StatusCode::kInvalidArgument,
              "outputs[0] overlaps input 0");
  two = {AsView(out0), AsView(out0)};
  options.outputs = two;
  ExpectError(PackStatus(AsView(mask_), {AsView(x_), AsView(x_)}, options),
              absl::StatusCode::kInvalidArgument,
              "outputs[1] overlaps outputs[0]");
  expect_untouched();
}

TEST_F(ValidationTest, ScatterRowsAndTailShape) {
  at::Tensor packed = at::zeros({4, 3});
  ExpectError(
      ScatterStatus(AsView(mask_), {AsView(packed)}),
      absl::StatusCode::kInvalidArgument,
      "packed[0].shape [4, 3] has 4 rows but the mask has 5 active positions");
  at::Tensor good = at::zeros({5, 3});
  ScatterOptions options;
  options.tail_shape = Shape{4};
  ExpectError(ScatterStatus(AsView(mask_), {AsView(good)}, options),
              absl::StatusCode::kInvalidArgument,
              "tail_shape [4] does not match packed[0].shape[1:] [3]");
  TensorView scalar = AsView(good);
  scalar.shape = {};
  ExpectError(ScatterStatus(AsView(mask_), {scalar}),
              absl::StatusCode::kInvalidArgument,
              "packed[0].shape [] must have rank 1 or more");
  at::Tensor dense = at::empty({2, 4, 2});
  std::vector<TensorView> outputs = {AsView(dense)};
  ScatterOptions into;
  into.outputs = outputs;
  ExpectError(ScatterStatus(AsView(mask_), {AsView(good)}, into),
              absl::StatusCode::kInvalidArgument,
              "outputs[0].shape is [2, 4, 2] but the result is [2, 4, 3]");
}

TEST(ParseDevice, AcceptsTheThreeKindsAndRejectsTheRest) {
  EXPECT_EQ(ParseDevice("cpu").value(), Device::Cpu());
  EXPECT_EQ(ParseDevice("cuda:3").value(), (Device{DeviceKind::kCuda, 3}));
  EXPECT_EQ(ParseDevice("hip:0").value(), (Device{DeviceKind::kHip, 0}));
  EXPECT_EQ(ParseDevice("cuda").value(), (Device{DeviceKind::kCuda, 0}));
  for (const char* bad : {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1:2",
                          "cpu:0", "cuda:99999", " cpu", "CUDA:0"}) {
    absl::StatusOr<Device> d = ParseDevice(bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    if (!d.ok()) {
      EXPECT_THAT(std::string(d.status().message()),
                  HasSubstr("is not a device"))
          << bad;
    }
  }
}

TEST(DeviceUuid, FormatsAsNvidiaSmiAndCanonicalisesWhatClientsSend) {
  const unsigned char bytes[16] = {0x8f, 0x3c, 0x1a, 0x2b, 0x00, 0x01,
                                   0xab, 0xcd, 0xef, 0x10, 0x20, 0x30,
                                   0x40, 0x50, 0x60, 0x7f};
  EXPECT_EQ(FormatDeviceUuid(bytes),
            "GPU-8f3c1a2b-0001-abcd-ef10-20304050607f");
  EXPECT_EQ(CanonicalDeviceUuid("GPU-8F3C1A2B-0001-ABCD-EF10-20304050607F"),
            "GPU-8f3c1a2b-0001-abcd-ef10-20304050607f");
  // torch's get_device_properties(i).uuid prints without the prefix.
  EXPECT_EQ(CanonicalDeviceUuid("8f3c1a2b-0001-abcd-ef10-20304050607f"),
            "GPU-8f3c1a2b-0001-abcd-ef10-20304050607f");
  EXPECT_EQ(CanonicalDeviceUuid("gpu-8f3c"), "GPU-8f3c");
}

}  // namespace
}  // namespace packd
