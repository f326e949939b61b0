// GPU pack kernels: mask scan (tile counts and per-row last index -> two-level
// scan of the tile counts -> cu_seqlens and the row index) and row gather /
// scatter, templated on the copy width (1, 2, 4, 8 or 16 bytes). Built by nvcc
// for CUDA and by hipcc for ROCm from this one source through gpu_runtime.h.
#include <algorithm>

#include "kernels/gpu/gpu_kernels.h"

namespace packd::PACKD_GPU_NS {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kCopyThreads = 256;
int64_t max_blocks = int64_t{1} << 20;

int64_t Blocks(int64_t work, int64_t per_block) {
  return std::max<int64_t>(
      1, std::min(max_blocks, (work + per_block - 1) / per_block));
}

// Whether mask element i is nonzero, read byte by byte so that any alignment
// works. For floats the sign bit (top bit of the last byte, little-endian) does
// not count: -0.0 is inactive.
__device__ __forceinline__ bool IsActive(const unsigned char* mask, int width,
                                         bool is_float, int64_t i) {
  const unsigned char* p = mask + i * width;
  unsigned int acc = 0;
  for (int j = 0; j < width - 1; ++j) acc |= p[j];
  acc |= p[width - 1] & (is_float ? 0x7Fu : 0xFFu);
  return acc != 0;
}

// Block-wide inclusive scan of one value per thread (Hillis-Steele in shared
// memory); every thread gets its inclusive prefix, and `total` the block's sum.
template <int kThreads>
__device__ int64_t BlockInclusiveScan(int64_t v, int64_t* shared,
                                      int64_t* total) {
  const int t = threadIdx.x;
  shared[t] = v;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset <<= 1) {
    const int64_t add = t >= offset ? shared[t - offset] : 0;
    __syncthreads();
    shared[t] += add;
    __syncthreads();
  }
  const int64_t out = shared[t];
  *total = shared[kThreads - 1];
  __syncthreads();
  return out;
}

// One block per tile (kTile positions of one row): its active count, and the
// row's last active s raised by an atomic max. last_index holds s + 1 over
// zeroed memory until RowMetaKernel, so an unsigned max works everywhere.
__global__ void TileCountsKernel(MaskScan scan) {
  __shared__ int64_t shared[kTile];
  const int64_t tiles_per_row = TilesPerRow(scan.seq);
  const int64_t tiles = scan.batch * tiles_per_row;
  const auto* mask = static_cast<const unsigned char*>(scan.mask);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / tiles_per_row;
    const int64_t s = (tile % tiles_per_row) * kTile + threadIdx.x;
    const bool active =
        s < scan.seq &&
        IsActive(mask, scan.width, scan.is_float, b * scan.seq + s);
    int64_t count = 0;
    BlockInclusiveScan<kTile>(active ? 1 : 0, shared, &count);
    // The largest active s: reuse the scan buffer as a max reduction.
    shared[threadIdx.x] = active ? s : -1;
    __syncthreads();
    for (int half = kTile / 2; half > 0; half >>= 1) {
      if (threadIdx.x < half) {
        shared[threadIdx.x] =
            max(shared[threadIdx.x], shared[threadIdx.x + half]);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      scan.tile_counts[tile] = count;
      if (shared[0] >= 0) {
        atomicMax(reinterpret_cast<unsigned long long*>(scan.last_index + b),
                  static_cast<unsigned long long>(shared[0] + 1));
      }
    }
    __syncthreads();
  }
}

// First level of the tile scan, one block per chunk of kScanChunk tiles:
// tile_offsets = exclusive prefix sums within the chunk, chunk_offsets[c] =
// the chunk's total.
__global__ void ScanChunksKernel(MaskScan scan) {
  __shared__ int64_t shared[kScanChunk];
  const int64_t tiles = scan.batch * TilesPerRow(scan.seq);
  const int64_t chunks = ScanChunks(tiles);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t i = c * kScanChunk + threadIdx.x;
    const int64_t v = i < tiles ? scan.tile_counts[i] : 0;
    int64_t total = 0;
    const int64_t inclusive = BlockInclusiveScan<kScanChunk>(v, shared, &total);
    if (i < tiles) scan.tile_offsets[i] = inclusive - v;
    if (threadIdx.x == 0) scan.chunk_offsets[c] = total;
  }
}

// Second level, one block: chunk_offsets = exclusive prefix sums of the chunk
// totals (in place: each thread reads its own entry before it writes it), and
// the grand total at chunk_offsets[chunks] and tile_offsets[tiles].
__global__ void ScanChunkTotalsKernel(MaskScan scan) {
  __shared__ int64_t shared[kScanThreads];
  const int64_t tiles = scan.batch * TilesPerRow(scan.seq);
  const int64_t chunks = ScanChunks(tiles);
  int64_t carry = 0;
  for (int64_t base = 0; base < chunks; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    const int64_t v = i < chunks ? scan.chunk_offsets[i] : 0;
    int64_t sum = 0;
    const int64_t inclusive = BlockInclusiveScan<kScanThreads>(v, shared, &sum);
    if (i < chunks) scan.chunk_offsets[i] = carry + inclusive - v;
    carry += sum;
  }
  if (threadIdx.x == 0) {
    scan.chunk_offsets[chunks] = carry;
    scan.tile_offsets[tiles] = carry;
  }
}

// tile_offsets become global: each adds its chunk's offset.
__global__ void AddChunkOffsetsKernel(MaskScan scan) {
  const int64_t tiles = scan.batch * TilesPerRow(scan.seq);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < tiles;
       i += int64_t(gridDim.x) * blockDim.x) {
    scan.tile_offsets[i] += scan.chunk_offsets[i / kScanChunk];
  }
}

// cu_seqlens and last_index per row, in constant time each.
__global__ void RowMetaKernel(MaskScan scan) {
  const int64_t tiles_per_row = TilesPerRow(scan.seq);
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
       b <= scan.batch; b += int64_t(gridDim.x) * blockDim.x) {
    scan.cu_seqlens[b] = scan.tile_offsets[b * tiles_per_row];
    if (b < scan.batch) scan.last_index[b] -= 1;  // s + 1 -> s; 0 -> -1
  }
}

// One block per tile: each active position writes its flattened index at its
// packed row.
__global__ void BuildIndexKernel(MaskScan scan) {
  __shared__ int64_t shared[kTile];
  const int64_t tiles_per_row = TilesPerRow(scan.seq);
  const int64_t tiles = scan.batch * tiles_per_row;
  const auto* mask = static_cast<const unsigned char*>(scan.mask);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t b = tile / tiles_per_row;
    const int64_t s = (tile % tiles_per_row) * kTile + threadIdx.x;
    const int64_t p = b * scan.seq + s;
    const bool active =
        s < scan.seq && IsActive(mask, scan.width, scan.is_float, p);
    int64_t total = 0;
    const int64_t inclusive =
        BlockInclusiveScan<kTile>(active ? 1 : 0, shared, &total);
    if (active) scan.index[scan.tile_offsets[tile] + inclusive - 1] = p;
  }
}

// Copies rows of `row_bytes` as `V` vectors; a group of `threads_per_row`
// threads copies one row. Gather: dst row k = src row index[k]. Scatter: dst
// row index[k] = src row k.
template <typename V, bool kGather>
__global__ void RowCopyKernel(const char* src, char* dst, const int64_t* index,
                              int64_t rows, int64_t row_bytes,
                              int threads_per_row, const int64_t* count) {
  if (count != nullptr && *count < rows) rows = *count;
  const int64_t nvec = row_bytes / sizeof(V);
  const int group = threadIdx.x / threads_per_row;
  const int lane = threadIdx.x % threads_per_row;
  const int rows_per_block = blockDim.x / threads_per_row;
  for (int64_t k = int64_t(blockIdx.x) * rows_per_block + group; k < rows;
       k += int64_t(gridDim.x) * rows_per_block) {
    const int64_t from = kGather ? index[k] : k;
    const int64_t to = kGather ? k : index[k];
    const V* s = reinterpret_cast<const V*>(src + from * row_bytes);
    V* d = reinterpret_cast<V*>(dst + to * row_bytes);
    for (int64_t j = lane; j < nvec; j += threads_per_row) d[j] = s[j];
  }
}

template <typename V>
__global__ void ZeroInactiveKernel(MaskScan scan, char* dense,
                                   int64_t row_bytes, int threads_per_row) {
  const int64_t nvec = row_bytes / sizeof(V);
  const int64_t positions = scan.batch * scan.seq;
  const int group = threadIdx.x / threads_per_row;
  const int lane = threadIdx.x % threads_per_row;
  const int rows_per_block = blockDim.x / threads_per_row;
  const auto* mask = static_cast<const unsigned char*>(scan.mask);
  for (int64_t p = int64_t(blockIdx.x) * rows_per_block + group; p < positions;
       p += int64_t(gridDim.x) * rows_per_block) {
    if (IsActive(mask, scan.width, scan.is_float, p)) continue;
    V* d = reinterpret_cast<V*>(dense + p * row_bytes);
    for (int64_t j = lane; j < nvec; j += threads_per_row) d[j] = V{};
  }
}

// The widest vector (16, 8, 4, 2 or 1 bytes) that divides the row and both base
// addresses.
int VectorBytes(const void* a, const void* b, int64_t row_bytes) {
  const uint64_t bits = reinterpret_cast<uint64_t>(a) |
                        reinterpret_cast<uint64_t>(b) |
                        static_cast<uint64_t>(row_bytes);
  for (int v = 16; v > 1; v /= 2) {
    if (bits % v == 0) return v;
  }
  return 1;
}

// Threads per row: enough to cover the row's vectors, at most a block, a power
// of two.
int ThreadsPerRow(int64_t nvec) {
  int t = 1;
  while (t < kCopyThreads && t < nvec) t *= 2;
  return t;
}

// Launches Kernel<V> for the vector width that fits, over `rows` rows.
template <template <typename> class Launch, typename... Args>
gpuError_t LaunchRows(int vector_bytes, int64_t rows, int64_t row_bytes,
                      gpuStream_t stream, Args... args) {
  const int64_t nvec = row_bytes / vector_bytes;
  const int threads_per_row = ThreadsPerRow(nvec);
  const int64_t blocks = Blocks(rows, kCopyThreads / threads_per_row);
  CountKernel();
  switch (vector_bytes) {
    case 16:
      Launch<uint4>::Run(blocks, stream, args..., threads_per_row);
      break;
    case 8:
      Launch<uint2>::Run(blocks, stream, args..., threads_per_row);
      break;
    case 4:
      Launch<unsigned int>::Run(blocks, stream, args..., threads_per_row);
      break;
    case 2:
      Launch<unsigned short>::Run(blocks, stream, args..., threads_per_row);
      break;
    default:
      Launch<unsigned char>::Run(blocks, stream, args..., threads_per_row);
      break;
  }
  return gpuGetLastError();
}

template <bool kGather>
struct RowCopy {
  template <typename V>
  struct Launch {
    static void Run(int64_t blocks, gpuStream_t stream, const char* src,
                    char* dst, const int64_t* index, int64_t rows,
                    int64_t row_bytes, const int64_t* count, int tpr) {
      RowCopyKernel<V, kGather><<<blocks, kCopyThreads, 0, stream>>>(
          src, dst, index, rows, row_bytes, tpr, count);
    }
  };
};
template <typename V>
struct ZeroLaunch {
  static void Run(int64_t blocks, gpuStream_t stream, MaskScan scan,
                  char* dense, int64_t row_bytes, int tpr) {
    ZeroInactiveKernel<V>
        <<<blocks, kCopyThreads, 0, stream>>>(scan, dense, row_bytes, tpr);
  }
};

// Span by span, a block each: vectors of 16 or 4 bytes where the span's two
// ends and length allow, else bytes; a pad span byte by byte from its pattern.
__global__ void CopySpansKernel(char* dst, const char* src,
                                const int64_t* spans, int64_t count,
                                const char* pattern, int64_t pattern_bytes) {
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t to = spans[3 * i], from = spans[3 * i + 1];
    const int64_t bytes = spans[3 * i + 2];
    char* d = dst + to;
    if (from < 0) {
      for (int64_t j = threadIdx.x; j < bytes; j += blockDim.x) {
        d[j] = pattern[j % pattern_bytes];
      }
      continue;
    }
    const char* s = src + from;
    const uint64_t bits = reinterpret_cast<uint64_t>(d) |
                          reinterpret_cast<uint64_t>(s) |
                          static_cast<uint64_t>(bytes);
    if (bits % 16 == 0) {
      uint4* dv = reinterpret_cast<uint4*>(d);
      const uint4* sv = reinterpret_cast<const uint4*>(s);
      for (int64_t j = threadIdx.x; j < bytes / 16; j += blockDim.x) {
        dv[j] = sv[j];
      }
    } else if (bits % 4 == 0) {
      unsigned int* dv = reinterpret_cast<unsigned int*>(d);
      const unsigned int* sv = reinterpret_cast<const unsigned int*>(s);
      for (int64_t j = threadIdx.x; j < bytes / 4; j += blockDim.x) {
        dv[j] = sv[j];
      }
    } else {
      for (int64_t j = threadIdx.x; j < bytes; j += blockDim.x) d[j] = s[j];
    }
  }
}

}  // namespace

void SetMaxBlocksForTesting(int64_t blocks) { max_blocks = blocks; }

gpuError_t LaunchMaskScan(const MaskScan& scan, gpuStream_t stream) {
  const int64_t tiles = scan.batch * TilesPerRow(scan.seq);
  if (scan.batch > 0) {
    const gpuError_t err =
        CountedMemset(scan.last_index, 0, scan.batch * sizeof(int64_t), stream);
    if (err != gpuSuccess) return err;
  }
  if (tiles > 0) {
    CountKernel();
    TileCountsKernel<<<Blocks(tiles, 1), kTile, 0, stream>>>(scan);
    if (gpuError_t err = gpuGetLastError(); err != gpuSuccess) return err;
    CountKernel();
    ScanChunksKernel<<<Blocks(ScanChunks(tiles), 1),
                       static_cast<int>(kScanChunk), 0, stream>>>(scan);
    if (gpuError_t err = gpuGetLastError(); err != gpuSuccess) return err;
  }
  CountKernel();
  ScanChunkTotalsKernel<<<1, kScanThreads, 0, stream>>>(scan);
  if (gpuError_t err = gpuGetLastError(); err != gpuSuccess) return err;
  if (tiles > 0) {
    CountKernel();
    AddChunkOffsetsKernel<<<Blocks(tiles, 256), 256, 0, stream>>>(scan);
    if (gpuError_t err = gpuGetLastError(); err != gpuSuccess) return err;
  }
  CountKernel();
  RowMetaKernel<<<Blocks(scan.batch + 1, 256), 256, 0, stream>>>(scan);
  if (gpuError_t err = gpuGetLastError(); err != gpuSuccess) return err;
  if (tiles > 0) {
    CountKernel();
    BuildIndexKernel<<<Blocks(tiles, 1), kTile, 0, stream>>>(scan);
    if (gpuError_t err = gpuGetLastError(); err != gpuSuccess) return err;
  }
  return gpuSuccess;
}

gpuError_t LaunchGather(const void* src, void* dst, const int64_t* index,
                        int64_t rows, int64_t row_bytes, gpuStream_t stream,
                        const int64_t* count) {
  if (rows == 0 || row_bytes == 0) return gpuSuccess;
  return LaunchRows<RowCopy<true>::Launch>(
      VectorBytes(src, dst, row_bytes), rows, row_bytes, stream,
      static_cast<const char*>(src), static_cast<char*>(dst), index, rows,
      row_bytes, count);
}

gpuError_t LaunchScatterRows(const void* src, void* dst, const int64_t* index,
                             int64_t rows, int64_t row_bytes,
                             gpuStream_t stream) {
  if (rows == 0 || row_bytes == 0) return gpuSuccess;
  return LaunchRows<RowCopy<false>::Launch>(
      VectorBytes(src, dst, row_bytes), rows, row_bytes, stream,
      static_cast<const char*>(src), static_cast<char*>(dst), index, rows,
      row_bytes, static_cast<const int64_t*>(nullptr));
}

gpuError_t LaunchZeroInactive(const MaskScan& scan, void* dense,
                              int64_t row_bytes, gpuStream_t stream) {
  const int64_t positions = scan.batch * scan.seq;
  if (positions == 0 || row_bytes == 0) return gpuSuccess;
  return LaunchRows<ZeroLaunch>(VectorBytes(dense, dense, row_bytes), positions,
                                row_bytes, stream, scan,
                                static_cast<char*>(dense), row_bytes);
}

gpuError_t LaunchCopySpans(char* dst, const char* src, const int64_t* spans,
                           int64_t count, const char* pattern,
                           int64_t pattern_bytes, gpuStream_t stream) {
  if (count == 0) return gpuSuccess;
  CountKernel();
  CopySpansKernel<<<Blocks(count, 1), kCopyThreads, 0, stream>>>(
      dst, src, spans, count, pattern, pattern_bytes);
  return gpuGetLastError();
}

}  // namespace packd::PACKD_GPU_NS
