// The launchers of kernels/gpu/gpu_kernels.h for the fake GPU: the same
// results computed on the host, queued on the stream like kernels, with every
// device access checked so that an out-of-bounds read or write faults the
// device (a sticky error) instead of touching host memory. Each counts the
// stream operations the real launcher queues (gpu_kernels.cu), so that the
// fake GPU's counters are the budgets a device sees.
#include <algorithm>
#include <cstring>

#include "kernels/device_runtime.h"
#include "kernels/gpu/gpu_kernels.h"

namespace packd::fake_gpu {
namespace {

bool Active(const MaskScan& scan, int64_t i) {
  const auto* p = static_cast<const unsigned char*>(scan.mask) + i * scan.width;
  unsigned acc = 0;
  for (int j = 0; j < scan.width - 1; ++j) acc |= p[j];
  acc |= p[scan.width - 1] & (scan.is_float ? 0x7Fu : 0xFFu);
  return acc != 0;
}

size_t Words(int64_t n) { return static_cast<size_t>(n) * sizeof(int64_t); }

}  // namespace

void SetMaxBlocksForTesting(int64_t) {}

gpuError_t LaunchMaskScan(const MaskScan& scan, gpuStream_t stream) {
  // The real scan: a memset of last_index, then six kernels (two without
  // tiles).
  const bool tiles = scan.batch * TilesPerRow(scan.seq) > 0;
  if (scan.batch > 0) GpuCounters().Operation(DeviceOp::kMemset);
  for (int k = 0; k < (tiles ? 6 : 2); ++k) CountKernel();
  return fakegpu::Launch(stream, [scan](const fakegpu::Accessible& ok) {
    const int64_t B = scan.batch, S = scan.seq;
    const int64_t tiles = B * TilesPerRow(S);
    if (!ok(scan.mask, static_cast<size_t>(B * S * scan.width)) ||
        !ok(scan.tile_counts, Words(tiles)) ||
        !ok(scan.tile_offsets, Words(tiles + 1)) ||
        !ok(scan.chunk_offsets, Words(ScanChunks(tiles) + 1)) ||
        !ok(scan.cu_seqlens, Words(B + 1)) || !ok(scan.last_index, Words(B)) ||
        !ok(scan.index, Words(B * S))) {
      return fakegpu::kErrorIllegalAddress;
    }
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      scan.cu_seqlens[b] = total;
      scan.last_index[b] = -1;
      for (int64_t s = 0; s < S; ++s) {
        if (!Active(scan, b * S + s)) continue;
        scan.index[total++] = b * S + s;
        scan.last_index[b] = s;
      }
    }
    scan.cu_seqlens[B] = total;
    return fakegpu::kSuccess;
  });
}

namespace {

gpuError_t CopyRows(const void* src, void* dst, const int64_t* index,
                    int64_t rows, int64_t row_bytes, bool gather,
                    gpuStream_t stream, const int64_t* count = nullptr) {
  if (rows == 0 || row_bytes == 0) return gpuSuccess;
  CountKernel();
  return fakegpu::Launch(stream, [=](const fakegpu::Accessible& ok) mutable {
    if (count != nullptr) {
      if (!ok(count, Words(1))) return fakegpu::kErrorIllegalAddress;
      rows = std::min(rows, *count);
    }
    if (!ok(index, Words(rows))) return fakegpu::kErrorIllegalAddress;
    const size_t n = static_cast<size_t>(row_bytes);
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t from = gather ? index[k] : k;
      const int64_t to = gather ? k : index[k];
      const char* s = static_cast<const char*>(src) + from * row_bytes;
      char* d = static_cast<char*>(dst) + to * row_bytes;
      if (!ok(s, n) || !ok(d, n)) return fakegpu::kErrorIllegalAddress;
      std::memcpy(d, s, n);
    }
    return fakegpu::kSuccess;
  });
}

}  // namespace

gpuError_t LaunchGather(const void* src, void* dst, const int64_t* index,
                        int64_t rows, int64_t row_bytes, gpuStream_t stream,
                        const int64_t* count) {
  return CopyRows(src, dst, index, rows, row_bytes, /*gather=*/true, stream,
                  count);
}

gpuError_t LaunchScatterRows(const void* src, void* dst, const int64_t* index,
                             int64_t rows, int64_t row_bytes,
                             gpuStream_t stream) {
  return CopyRows(src, dst, index, rows, row_bytes, /*gather=*/false, stream);
}

gpuError_t LaunchZeroInactive(const MaskScan& scan, void* dense,
                              int64_t row_bytes, gpuStream_t stream) {
  const int64_t positions = scan.batch * scan.seq;
  if (positions == 0 || row_bytes == 0) return gpuSuccess;
  CountKernel();
  return fakegpu::Launch(stream, [=](const fakegpu::Accessible& ok) {
    if (!ok(scan.mask, static_cast<size_t>(positions * scan.width))) {
      return fakegpu::kErrorIllegalAddress;
    }
    for (int64_t p = 0; p < positions; ++p) {
      if (Active(scan, p)) continue;
      char* d = static_cast<char*>(dense) + p * row_bytes;
      if (!ok(d, static_cast<size_t>(row_bytes))) {
        return fakegpu::kErrorIllegalAddress;
      }
      std::memset(d, 0, static_cast<size_t>(row_bytes));
    }
    return fakegpu::kSuccess;
  });
}

gpuError_t LaunchCopySpans(char* dst, const char* src, const int64_t* spans,
                           int64_t count, const char* pattern,
                           int64_t pattern_bytes, gpuStream_t stream) {
  if (count == 0) return gpuSuccess;
  CountKernel();
  return fakegpu::Launch(stream, [=](const fakegpu::Accessible& ok) {
    if (!ok(spans, Words(3 * count))) return fakegpu::kErrorIllegalAddress;
    const auto* all = reinterpret_cast<const CopySpan*>(spans);
    for (int64_t i = 0; i < count; ++i) {
      const CopySpan& span = all[i];
      const size_t n = static_cast<size_t>(span.bytes);
      if (!ok(dst + span.to, n) ||
          (span.from >= 0 ? !ok(src + span.from, n)
                          : !ok(pattern, static_cast<size_t>(pattern_bytes)))) {
        return fakegpu::kErrorIllegalAddress;
      }
      RunCopySpans(dst, src, &span, 1, pattern, pattern_bytes);
    }
    return fakegpu::kSuccess;
  });
}

}  // namespace packd::fake_gpu
