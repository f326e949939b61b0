// Device code of the GPU backend, behind plain host launchers (no Abseil, so
// that nvcc and hipcc see only this and the runtime). Each launcher enqueues
// work on `stream` and returns the launch error (gpuSuccess when fine); none
// synchronises. Sizes are 64-bit; pointers may have any alignment (vector width
// is chosen per call).
//
//   MaskScan scan{mask, B, S, width, is_float, tile_counts, ...};
//   if (gpuError_t err = LaunchMaskScan(scan, stream); err != gpuSuccess) ...
#ifndef PACKD_KERNELS_GPU_GPU_KERNELS_H_
#define PACKD_KERNELS_GPU_GPU_KERNELS_H_

#include <cstdint>

#include "kernels/gpu/gpu_runtime.h"

namespace packd::PACKD_GPU_NS {

// Positions per tile of the mask scan: a tile is one thread block's share of a
// row.
constexpr int64_t kTile = 256;

PACKD_HOST_DEVICE inline int64_t TilesPerRow(int64_t S) {
  return (S + kTile - 1) / kTile;
}

// Tiles per block of the first level of the two-level tile scan.
constexpr int64_t kScanChunk = 1024;

PACKD_HOST_DEVICE inline int64_t ScanChunks(int64_t tiles) {
  return (tiles + kScanChunk - 1) / kScanChunk;
}

// Device buffers of one mask scan. The mask is [B, S] of `width`-byte elements;
// an element is active when any of its bits is set, ignoring the sign bit of
// floats (`is_float`).
struct MaskScan {
  const void* mask;
  int64_t batch, seq;
  int width;
  bool is_float;
  // [B * TilesPerRow(S)]: active positions in each tile.
  int64_t* tile_counts;
  // [B * TilesPerRow(S) + 1]: exclusive prefix sums; the last is the total.
  int64_t* tile_offsets;
  // [ScanChunks(tiles) + 1]: exclusive prefix sums of the chunks' totals.
  int64_t* chunk_offsets;
  int64_t* cu_seqlens;  // [B + 1]
  int64_t* last_index;  // [B]
  // [B * S]: the flattened dense position of packed row k, for k < total.
  int64_t* index;
};

// The int64 words of device memory one scan of a [B, S] mask needs.
inline int64_t MaskScanWords(int64_t B, int64_t S) {
  const int64_t tiles = B * TilesPerRow(S);
  return tiles + (tiles + 1) + (ScanChunks(tiles) + 1) + (B + 1) + B + B * S;
}

// A scan of `mask` with its arrays laid out in `work` (MaskScanWords(B, S)
// words of device memory).
inline MaskScan MakeMaskScan(const void* mask, int64_t B, int64_t S, int width,
                             bool is_float, int64_t* work) {
  const int64_t tiles = B * TilesPerRow(S);
  MaskScan scan{};
  scan.mask = mask;
  scan.batch = B;
  scan.seq = S;
  scan.width = width;
  scan.is_float = is_float;
  scan.tile_counts = work;
  scan.tile_offsets = scan.tile_counts + tiles;
  scan.chunk_offsets = scan.tile_offsets + tiles + 1;
  scan.cu_seqlens = scan.chunk_offsets + ScanChunks(tiles) + 1;
  scan.last_index = scan.cu_seqlens + B + 1;
  scan.index = scan.last_index + B;
  return scan;
}

// For tests: caps every grid at `blocks` blocks (default 2^20), so that the
// grid-stride loops turn on small inputs. Not thread-safe.
void SetMaxBlocksForTesting(int64_t blocks);

// Counts, scans and indexes the mask: fills every array of `scan`.
gpuError_t LaunchMaskScan(const MaskScan& scan, gpuStream_t stream);

// dst row k = src row index[k], for k < rows; rows of `row_bytes`. With
// `count` (device memory), only k < min(rows, *count): a count the host has
// not read yet (a scan's total).
gpuError_t LaunchGather(const void* src, void* dst, const int64_t* index,
                        int64_t rows, int64_t row_bytes, gpuStream_t stream,
                        const int64_t* count = nullptr);

// dst row index[k] = src row k, for k < rows.
gpuError_t LaunchScatterRows(const void* src, void* dst, const int64_t* index,
                             int64_t rows, int64_t row_bytes,
                             gpuStream_t stream);

// Zeroes each dense row whose mask element is inactive, for the B * S positions
// of `scan`.
gpuError_t LaunchZeroInactive(const MaskScan& scan, void* dense,
                              int64_t row_bytes, gpuStream_t stream);

// A batched copy (DeviceRuntime::CopySpans): `spans` holds `count` spans of
// three int64 each (to, from, bytes; CopySpan's layout), in device memory.
// Span i copies `bytes` bytes to dst + to from src + from, or where from is
// -1 fills them with `pattern` (`pattern_bytes` bytes) repeated. One kernel, a
// block per span at a time.
gpuError_t LaunchCopySpans(char* dst, const char* src, const int64_t* spans,
                           int64_t count, const char* pattern,
                           int64_t pattern_bytes, gpuStream_t stream);

}  // namespace packd::PACKD_GPU_NS

#endif  // PACKD_KERNELS_GPU_GPU_KERNELS_H_
