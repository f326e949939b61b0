// The GPU backend against the CPU implementation, byte for byte, on random
// data: every dtype of x and mask, sizes 0, 1, odd and large, tails that are
// not a multiple of 16 bytes, misaligned base pointers; documents and a
// layout (padding, CP, a shift, seq_idx) with their Scatter. Without a GPU
// every test is skipped, with the reason.
#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "base/torch_interop.h"
#include "gtest/gtest.h"
#include "kernels/device_runtime.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Rng;

const Device kGpu = testing::FirstGpu();

class GpuPackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<DeviceRuntime*> runtime = Registry::Runtime(kGpu);
    if (!runtime.ok()) {
      GTEST_SKIP() << "no GPU to test on: " << runtime.status().message();
    }
    gpu_ = *runtime;
    // On the fake GPU (tests/fake_gpu), kernels are host loops: sizes stay
    // small there; a real device takes every case.
    fake_ = (*Registry::Get(kGpu))->name() == "fake-gpu";
    absl::StatusOr<Stream> stream = gpu_->AcquireStream(kGpu);
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(*stream);
  }

  // A device copy of `t` at `misalign` bytes past an aligned allocation.
  TensorView Upload(const at::Tensor& t, int misalign) {
    absl::StatusOr<Buffer> buf = gpu_->Allocate(t.nbytes() + 16, kGpu);
    EXPECT_TRUE(buf.ok()) << buf.status();
    char* data = static_cast<char*>(buf->data()) + misalign;
    EXPECT_TRUE(
        gpu_->CopyToDevice(data, t.data_ptr(), t.nbytes(), stream_).ok());
    buffers_.push_back(std::move(*buf));
    TensorView v = AsView(t);
    v.data = data;
    v.device = kGpu;
    return v;
  }

  at::Tensor Download(const TensorView& v) {
    std::vector<int64_t> shape(v.shape.begin(), v.shape.end());
    at::Tensor t =
        at::empty(shape, at::TensorOptions().dtype(ToScalarType(v.dtype)));
    EXPECT_TRUE(
        gpu_->CopyToHost(t.data_ptr(), v.data, t.nbytes(), stream_).ok());
    return t;
  }

  void Check(DType x_dtype, DType mask_dtype, int64_t B, int64_t S,
             std::vector<int64_t> tail, double density, MaskPattern kind,
             int misalign) {
    SCOPED_TRACE(::testing::Message()
                 << DTypeName(x_dtype) << " x [" << B << ", " << S << ", tail "
                 << tail.size() << "], mask " << DTypeName(mask_dtype) << " "
                 << MaskPatternName(kind) << " " << density
                 << ", misaligned by " << misalign);
    int64_t row = ItemSize(x_dtype);
    for (int64_t d : tail) row *= d;
    if (fake_ && B * S * row > (int64_t{16} << 20)) return;
    Rng rng = Rng::Fresh();
    const at::Tensor mask =
        testing::RandomMask(rng, mask_dtype, B, S, density, kind);
    const at::Tensor x =
        testing::RandomTensor(rng, x_dtype, testing::Concat({B, S}, tail));
    const std::vector<TensorView> cpu_inputs = {AsView(x)};
    PackOptions pack_options;
    pack_options.with_position_ids = true;
    absl::StatusOr<PackResult> cpu =
        Pack(cpu_inputs, AsView(mask), pack_options);
    ASSERT_TRUE(cpu.ok()) << cpu.status();

    // Documents: segment ids cut every few tokens, the same on both devices.
    const at::Tensor ids =
        (at::arange(B * S, at::kLong).view({B, S}) / 5 % 3).to(at::kInt);
    PackOptions doc_options = pack_options;
    doc_options.segment_ids = AsView(ids);
    absl::StatusOr<PackResult> cpu_docs =
        Pack(cpu_inputs, AsView(mask), doc_options);
    ASSERT_TRUE(cpu_docs.ok()) << cpu_docs.status();
    const std::vector<TensorView> gpu_inputs = {Upload(x, misalign)};
    doc_options.segment_ids = Upload(ids, 0);
    absl::StatusOr<PackResult> gpu_docs =
        Pack(gpu_inputs, Upload(mask, misalign), doc_options);
    ASSERT_TRUE(gpu_docs.ok()) << gpu_docs.status();
    EXPECT_EQ(gpu_docs->doc_cu_seqlens, cpu_docs->doc_cu_seqlens);
    EXPECT_EQ(gpu_docs->doc_row, cpu_docs->doc_row);
    EXPECT_EQ(gpu_docs->doc_last_index, cpu_docs->doc_last_index);
    EXPECT_EQ(gpu_docs->doc_max_seqlen, cpu_docs->doc_max_seqlen);
    EXPECT_EQ(gpu_docs->position_ids, cpu_docs->position_ids);

    absl::StatusOr<PackResult> gpu =
        Pack(gpu_inputs, Upload(mask, misalign), pack_options);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(gpu->cu_seqlens, cpu->cu_seqlens);
    EXPECT_EQ(gpu->last_index, cpu->last_index);
    EXPECT_EQ(gpu->position_ids, cpu->position_ids);
    EXPECT_EQ(gpu->max_seqlen, cpu->max_seqlen);
    EXPECT_TRUE(
        testing::SameBytes(Download(gpu->packed[0].view), cpu->packed[0].view));

    // Into a caller's output inside a larger buffer of guard bytes: the
    // result lands exactly there and nothing around it changes.
    {
      const TensorView want = cpu->packed[0].view;
      const int64_t bytes = want.nbytes();
      const at::Tensor guard =
          at::full({bytes + 128}, testing::kCanary, at::kByte);
      const TensorView whole = Upload(guard, 0);
      TensorView out = want;
      out.data = static_cast<char*>(whole.data) + 64;
      out.device = kGpu;
      const std::vector<TensorView> outputs = {out};
      PackOptions into = pack_options;
      into.outputs = outputs;
      const absl::StatusOr<PackResult> r =
          Pack(gpu_inputs, Upload(mask, misalign), into);
      ASSERT_TRUE(r.ok()) << r.status();
      at::Tensor expected = guard.clone();
      if (bytes > 0) {
        std::memcpy(static_cast<char*>(expected.data_ptr()) + 64, want.data,
                    bytes);
      }
      EXPECT_TRUE(testing::SameBytes(expected, Download(whole)));
    }

    // A layout (docs/design.md §10): padded to 8 by documents, CP rank 1 of
    // 2, a pad value, a shift and seq_idx; and its Scatter.
    {
      PackOptions laid = doc_options;
      laid.segment_ids = AsView(ids);
      laid.layout.pad_multiple = 8;
      laid.layout.cp_size = 2;
      laid.layout.cp_rank = 1;
      laid.layout.pad_values = {1};
      laid.layout.shifts = {{0, 0}};
      laid.layout.with_seq_idx = true;
      absl::StatusOr<PackResult> cpu_laid =
          Pack(cpu_inputs, AsView(mask), laid);
      ASSERT_TRUE(cpu_laid.ok()) << cpu_laid.status();
      laid.segment_ids = Upload(ids, 0);
      absl::StatusOr<PackResult> gpu_laid =
          Pack(gpu_inputs, Upload(mask, misalign), laid);
      ASSERT_TRUE(gpu_laid.ok()) << gpu_laid.status();
      EXPECT_EQ(gpu_laid->cu_seqlens_padded, cpu_laid->cu_seqlens_padded);
      EXPECT_EQ(gpu_laid->seq_idx, cpu_laid->seq_idx);
      EXPECT_EQ(gpu_laid->position_ids, cpu_laid->position_ids);
      EXPECT_TRUE(testing::SameBytes(Download(gpu_laid->packed[0].view),
                                     cpu_laid->packed[0].view));
      EXPECT_TRUE(testing::SameBytes(Download(gpu_laid->shifted[0].view),
                                     cpu_laid->shifted[0].view));
      ScatterOptions back;
      back.layout.pad_multiple = 8;
      back.layout.cp_size = 2;
      back.layout.cp_rank = 1;
      back.segment_ids = AsView(ids);
      const std::vector<TensorView> cpu_rows = {cpu_laid->packed[0].view};
      absl::StatusOr<ScatterResult> cpu_back =
          Scatter(cpu_rows, AsView(mask), back);
      ASSERT_TRUE(cpu_back.ok()) << cpu_back.status();
      back.segment_ids = Upload(ids, 0);
      const std::vector<TensorView> gpu_rows = {gpu_laid->packed[0].view};
      absl::StatusOr<ScatterResult> gpu_back =
          Scatter(gpu_rows, Upload(mask, misalign), back);
      ASSERT_TRUE(gpu_back.ok()) << gpu_back.status();
      EXPECT_TRUE(testing::SameBytes(Download(gpu_back->dense[0].view),
                                     cpu_back->dense[0].view));
    }

    // Scatter of fresh packed rows.
    const at::Tensor packed = testing::RandomTensor(
        rng, x_dtype, testing::Concat({cpu->total_active}, tail));
    const std::vector<TensorView> cpu_packed = {AsView(packed)};
    absl::StatusOr<ScatterResult> cpu_dense = Scatter(cpu_packed, AsView(mask));
    ASSERT_TRUE(cpu_dense.ok()) << cpu_dense.status();
    const std::vector<TensorView> gpu_packed = {Upload(packed, misalign)};
    absl::StatusOr<ScatterResult> gpu_dense =
        Scatter(gpu_packed, Upload(mask, misalign));
    ASSERT_TRUE(gpu_dense.ok()) << gpu_dense.status();
    EXPECT_TRUE(testing::SameBytes(Download(gpu_dense->dense[0].view),
                                   cpu_dense->dense[0].view));
  }

  DeviceRuntime* gpu_ = nullptr;
  bool fake_ = false;
  Stream stream_;
  std::vector<Buffer> buffers_;
};

TEST_F(GpuPackTest, EveryDtypeOfXAndMask) {
  for (DType x_dtype : kAllDTypes) {
    for (DType mask_dtype : kAllDTypes) {
      Check(x_dtype, mask_dtype, 5, 37, {3}, 0.5, MaskPattern::kHoles, 0);
    }
  }
}

TEST_F(GpuPackTest, EdgeOddAndLargeSizes) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {0, 0},   {0, 5},    {3, 0},    {1, 1},    {2, 3},
      {7, 257}, {3, 1031}, {1031, 3}, {16, 8192}};
  const std::vector<std::vector<int64_t>> tails = {{},     {1}, {3},   {7},
                                                   {2, 5}, {0}, {4096}};
  int i = 0;
  for (const auto& [B, S] : shapes) {
    for (const auto& tail : tails) {
      for (double density : {0.0, 0.3, 1.0}) {
        ++i;
        DType dtype = kAllDTypes[i % 10];
        if (!tail.empty() && tail[0] == 4096 && B * S > 4096)
          dtype = DType::kBFloat16;
        Check(dtype, kAllDTypes[(i / 10) % 10], B, S, tail, density,
              i % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix, 0);
      }
    }
  }
}

TEST_F(GpuPackTest, MisalignedBasePointersAndTails) {
  for (int misalign : {1, 2, 3, 4, 8, 12, 15}) {
    for (int64_t tail : {1, 3, 5, 8, 24, 129}) {
      Check(DType::kUInt8, DType::kBool, 9, 301, {tail}, 0.4,
            MaskPattern::kHoles, misalign);
      Check(DType::kFloat16, DType::kFloat32, 4, 77, {tail}, 0.6,
            MaskPattern::kPrefix, misalign & ~1);
    }
  }
}

TEST_F(GpuPackTest, LargeBatch) {
  Check(DType::kBFloat16, DType::kBool, 16, 1024, {4096}, 0.3,
        MaskPattern::kHoles, 0);
  Check(DType::kInt64, DType::kBool, 64, 4096, {}, 0.5, MaskPattern::kHoles, 0);
}

// The step's batched copy (DeviceRuntime::CopySpans) against the host's:
// rows of odd and vector widths, misaligned ends, runs of rows and of pads,
// spans cut at kMaxSpanBytes.
TEST_F(GpuPackTest, CopySpansGatherRowsAndPadsLikeTheHost) {
  Rng rng = Rng::Fresh();
  for (int64_t row_bytes : {1, 3, 8, 16, 24, 100, 4096, 300000}) {
    for (int misalign : {0, 4, 7}) {
      SCOPED_TRACE(::testing::Message() << row_bytes << "-byte rows, "
                                        << "misaligned by " << misalign);
      const int64_t n = row_bytes > 4096 ? 6 : 200;
      // Rows of the source in runs, and pad runs between them.
      std::vector<int64_t> rows;
      while (static_cast<int64_t>(rows.size()) < n) {
        const int64_t start = static_cast<int64_t>(rng.Next() % n);
        const int64_t count = 1 + static_cast<int64_t>(rng.Next() % 9);
        const bool pad = rng.Next() % 4 == 0;
        for (int64_t j = 0; j < count && start + j < n; ++j) {
          rows.push_back(pad ? -1 : start + j);
        }
      }
      std::vector<CopySpan> spans;
      AppendRowSpans(rows, misalign, row_bytes, &spans);
      std::vector<char> src(n * row_bytes), pattern(row_bytes);
      for (char& c : src) c = static_cast<char>(rng.Next());
      for (char& c : pattern) c = static_cast<char>(rng.Next());
      const int64_t out_bytes = rows.size() * row_bytes + misalign;
      std::vector<char> expected(out_bytes, 0x5a);
      for (size_t j = 0; j < rows.size(); ++j) {
        const char* from =
            rows[j] < 0 ? pattern.data() : src.data() + rows[j] * row_bytes;
        std::memcpy(expected.data() + misalign + j * row_bytes, from,
                    row_bytes);
      }
      std::vector<char> on_host(out_bytes, 0x5a);
      RunCopySpans(on_host.data(), src.data(), spans.data(),
                   static_cast<int64_t>(spans.size()), pattern.data(),
                   row_bytes);
      EXPECT_EQ(on_host, expected);
      if (fake_ && out_bytes > (int64_t{4} << 20)) continue;

      auto upload = [&](const void* data, int64_t bytes) -> char* {
        absl::StatusOr<Buffer> buf = gpu_->Allocate(bytes + 16, kGpu);
        EXPECT_TRUE(buf.ok()) << buf.status();
        char* at = static_cast<char*>(buf->data()) + misalign;
        EXPECT_TRUE(gpu_->CopyToDevice(at, data, bytes, stream_).ok());
        buffers_.push_back(std::move(*buf));
        return at;
      };
      const char* d_src = upload(src.data(), src.size());
      const char* d_pattern = upload(pattern.data(), row_bytes);
      // The spans' own table must be 8-aligned: it has no misalignment.
      absl::StatusOr<Buffer> table =
          gpu_->Allocate(spans.size() * sizeof(CopySpan) + 8, kGpu);
      ASSERT_TRUE(table.ok());
      ASSERT_TRUE(gpu_->CopyToDevice(table->data(), spans.data(),
                                     spans.size() * sizeof(CopySpan), stream_)
                      .ok());
      // The output from an aligned base: the spans start `misalign` in.
      absl::StatusOr<Buffer> out = gpu_->Allocate(out_bytes, kGpu);
      ASSERT_TRUE(out.ok());
      char* d_out = static_cast<char*>(out->data());
      ASSERT_TRUE(
          gpu_->CopyToDevice(d_out, on_host.data(), misalign, stream_).ok());
      ASSERT_TRUE(gpu_->CopySpans(d_out, d_src,
                                  static_cast<const CopySpan*>(table->data()),
                                  static_cast<int64_t>(spans.size()), d_pattern,
                                  row_bytes, stream_)
                      .ok());
      std::vector<char> on_device(out_bytes);
      ASSERT_TRUE(
          gpu_->CopyToHost(on_device.data(), d_out, out_bytes, stream_).ok());
      EXPECT_EQ(on_device, expected);
    }
  }
}

}  // namespace
}  // namespace packd
