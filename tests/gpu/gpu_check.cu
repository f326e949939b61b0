// gpu_check: the GPU kernels alone, for a machine with an NVIDIA GPU and nvcc
// but none of packd's other dependencies. Checks gather and scatter byte for
// byte against a plain C++ reference on random data (every element width, mask
// dtype, odd sizes, tails not a multiple of 16 bytes, misaligned pointers),
// then times pack and scatter against a device-to-device copy of the same
// bytes. Built and run by run_gpu_checks.sh.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -I. tests/gpu/gpu_check.cu
//   kernels/gpu/gpu_kernels.cu
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/gpu/gpu_kernels.h"
#include "workloads/mask_patterns.h"

namespace {

using packd::gpu::MaskScan;

int failures = 0;

#define CHECK_GPU(expr)                                              \
  do {                                                               \
    gpuError_t e_ = (expr);                                          \
    if (e_ != gpuSuccess) {                                          \
      std::printf("FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                  gpuGetErrorString(e_));                            \
      std::exit(2);                                                  \
    }                                                                \
  } while (0)

struct DeviceMem {
  char* p = nullptr;
  explicit DeviceMem(size_t n) {
    CHECK_GPU(gpuMalloc(&p, std::max<size_t>(n, 1) + 64));
  }
  ~DeviceMem() { gpuFree(p); }
};

// Reference: is the mask element active? Floats ignore the sign bit; the rest
// any bit.
constexpr unsigned char kGuard = 0xA5;

// Whether every byte of `buf` outside [at, at + n) still holds the guard.
bool Guarded(const std::vector<unsigned char>& buf, size_t at, size_t n) {
  for (size_t i = 0; i < buf.size(); ++i) {
    if ((i < at || i >= at + n) && buf[i] != kGuard) return false;
  }
  return true;
}

bool RefActive(const std::vector<unsigned char>& mask, int width, bool is_float,
               int64_t i) {
  uint64_t v = 0;
  std::memcpy(&v, mask.data() + i * width, width);
  if (is_float) v &= ~(uint64_t{1} << (8 * width - 1));
  return v != 0;
}

struct Scan {
  DeviceMem work;
  MaskScan scan{};
  std::vector<int64_t> cu, last;
  Scan(const char* d_mask, int64_t B, int64_t S, int width, bool is_float)
      : work(8 * packd::gpu::MaskScanWords(B, S)) {
    scan = packd::gpu::MakeMaskScan(d_mask, B, S, width, is_float,
                                    reinterpret_cast<int64_t*>(work.p));
  }
  // The scan alone, its sizes left on the device (a call that gathers ahead).
  void Launch() { CHECK_GPU(packd::gpu::LaunchMaskScan(scan, 0)); }
  void Run() {
    CHECK_GPU(packd::gpu::LaunchMaskScan(scan, 0));
    cu.resize(scan.batch + 1);
    last.resize(scan.batch);
    CHECK_GPU(gpuMemcpyAsync(cu.data(), scan.cu_seqlens, cu.size() * 8,
                             gpuMemcpyDeviceToHost, 0));
    CHECK_GPU(gpuMemcpyAsync(last.data(), scan.last_index, last.size() * 8,
                             gpuMemcpyDeviceToHost, 0));
    CHECK_GPU(gpuStreamSynchronize(0));
  }
};

void CheckCase(std::mt19937_64& rng, int64_t B, int64_t S, int64_t row_bytes,
               int mask_width, bool mask_float, double density, int misalign) {
  const int64_t N = B * S;
  std::vector<unsigned char> mask(N * mask_width, 0), x(N * row_bytes);
  const std::vector<uint8_t> active =
      packd::MaskActivity(packd::MaskPattern::kHoles, B, S, density, rng);
  for (int64_t i = 0; i < N; ++i) {
    unsigned char* m = mask.data() + i * mask_width;
    if (active[i]) {
      m[rng() % mask_width] = static_cast<unsigned char>(1 + rng() % 255);
    } else if (mask_float && (rng() & 1)) {
      m[mask_width - 1] = 0x80;  // -0.0: inactive
    }
  }
  // Eight random bytes from each draw: the 4.3 GB case fills in seconds.
  for (size_t i = 0; i < x.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(x.data() + i, &v, std::min<size_t>(8, x.size() - i));
  }
  // Reference.
  std::vector<int64_t> cu(B + 1, 0), last(B, -1);
  std::vector<unsigned char> packed;
  for (int64_t b = 0; b < B; ++b) {
    cu[b + 1] = cu[b];
    for (int64_t s = 0; s < S; ++s) {
      if (!RefActive(mask, mask_width, mask_float, b * S + s)) continue;
      ++cu[b + 1];
      last[b] = s;
      packed.insert(packed.end(), x.begin() + (b * S + s) * row_bytes,
                    x.begin() + (b * S + s + 1) * row_bytes);
    }
  }
  const int64_t total = cu[B];
  // Outputs sit inside larger buffers filled with a guard byte, so that a
  // write before or past them is caught.
  DeviceMem d_mask(mask.size()), d_x(x.size()), d_out(packed.size()),
      d_dense(x.size());
  CHECK_GPU(gpuMemsetAsync(d_out.p, kGuard, packed.size() + 64, 0));
  CHECK_GPU(gpuMemsetAsync(d_dense.p, kGuard, x.size() + 64, 0));
  char* mp = d_mask.p + misalign;
  char* xp = d_x.p + misalign;
  char* op = d_out.p + (misalign * 3) % 16;
  char* dp = d_dense.p + misalign;
  CHECK_GPU(
      gpuMemcpyAsync(mp, mask.data(), mask.size(), gpuMemcpyHostToDevice, 0));
  CHECK_GPU(gpuMemcpyAsync(xp, x.data(), x.size(), gpuMemcpyHostToDevice, 0));
  Scan scan(mp, B, S, mask_width, mask_float);
  scan.Run();
  bool ok = scan.cu == cu && scan.last == last;
  CHECK_GPU(
      packd::gpu::LaunchGather(xp, op, scan.scan.index, total, row_bytes, 0));
  std::vector<unsigned char> got(packed.size() + 64);
  CHECK_GPU(gpuMemcpyAsync(got.data(), d_out.p, got.size(),
                           gpuMemcpyDeviceToHost, 0));
  CHECK_GPU(gpuStreamSynchronize(0));
  const size_t out_at = op - d_out.p;
  ok = ok && std::equal(packed.begin(), packed.end(), got.begin() + out_at) &&
       Guarded(got, out_at, packed.size());
  // Gathered ahead (the row count read on the device) into room for every
  // row: the packed rows, and nothing past them.
  {
    DeviceMem d_ahead(x.size());
    CHECK_GPU(gpuMemsetAsync(d_ahead.p, kGuard, x.size() + 64, 0));
    CHECK_GPU(packd::gpu::LaunchGather(xp, d_ahead.p, scan.scan.index, N,
                                       row_bytes, 0, scan.scan.cu_seqlens + B));
    std::vector<unsigned char> ahead(x.size() + 64);
    CHECK_GPU(gpuMemcpyAsync(ahead.data(), d_ahead.p, ahead.size(),
                             gpuMemcpyDeviceToHost, 0));
    CHECK_GPU(gpuStreamSynchronize(0));
    ok = ok && std::equal(packed.begin(), packed.end(), ahead.begin()) &&
         Guarded(ahead, 0, packed.size());
  }
  // The step's batched copy: the packed rows in runs of the source, a pad
  // row (the pattern) after every seventh, into a misaligned place.
  {
    std::vector<int64_t> spans;  // to, from, bytes
    std::vector<unsigned char> want;
    std::vector<unsigned char> pattern(row_bytes);
    for (auto& c : pattern) c = static_cast<unsigned char>(rng());
    std::vector<int64_t> positions;
    for (int64_t i = 0; i < N; ++i) {
      if (RefActive(mask, mask_width, mask_float, i)) positions.push_back(i);
    }
    for (size_t k = 0; k < positions.size(); ++k) {
      const int64_t to = static_cast<int64_t>(want.size());
      const int64_t from = positions[k] * row_bytes;
      if (!spans.empty() && spans[spans.size() - 2] >= 0 &&
          spans[spans.size() - 2] + spans.back() == from) {
        spans.back() += row_bytes;
      } else {
        spans.insert(spans.end(), {to, from, row_bytes});
      }
      want.insert(want.end(), x.begin() + from, x.begin() + from + row_bytes);
      if (k % 7 == 6) {
        spans.insert(spans.end(),
                     {static_cast<int64_t>(want.size()), -1, row_bytes});
        want.insert(want.end(), pattern.begin(), pattern.end());
      }
    }
    const int64_t count = static_cast<int64_t>(spans.size() / 3);
    DeviceMem d_spans(spans.size() * 8), d_pattern(row_bytes),
        d_to(want.size() + 16);
    CHECK_GPU(gpuMemcpyAsync(d_spans.p, spans.data(), spans.size() * 8,
                             gpuMemcpyHostToDevice, 0));
    CHECK_GPU(gpuMemcpyAsync(d_pattern.p, pattern.data(), row_bytes,
                             gpuMemcpyHostToDevice, 0));
    CHECK_GPU(gpuMemsetAsync(d_to.p, kGuard, want.size() + 80, 0));
    const size_t to_at = (misalign * 5) % 16;
    CHECK_GPU(packd::gpu::LaunchCopySpans(
        d_to.p + to_at, xp, reinterpret_cast<const int64_t*>(d_spans.p), count,
        d_pattern.p, row_bytes, 0));
    std::vector<unsigned char> copied(want.size() + 80);
    CHECK_GPU(gpuMemcpyAsync(copied.data(), d_to.p, copied.size(),
                             gpuMemcpyDeviceToHost, 0));
    CHECK_GPU(gpuStreamSynchronize(0));
    ok = ok && std::equal(want.begin(), want.end(), copied.begin() + to_at) &&
         Guarded(copied, to_at, want.size());
  }
  // Scatter the packed rows back: dense must equal x at active rows, zero
  // elsewhere.
  CHECK_GPU(packd::gpu::LaunchZeroInactive(scan.scan, dp, row_bytes, 0));
  CHECK_GPU(packd::gpu::LaunchScatterRows(op, dp, scan.scan.index, total,
                                          row_bytes, 0));
  std::vector<unsigned char> dense_all(x.size() + 64);
  CHECK_GPU(gpuMemcpyAsync(dense_all.data(), d_dense.p, dense_all.size(),
                           gpuMemcpyDeviceToHost, 0));
  CHECK_GPU(gpuStreamSynchronize(0));
  const size_t dense_at = dp - d_dense.p;
  ok = ok && Guarded(dense_all, dense_at, x.size());
  const unsigned char* dense = dense_all.data() + dense_at;
  for (int64_t i = 0; i < N && ok; ++i) {
    const bool a = RefActive(mask, mask_width, mask_float, i);
    for (int64_t j = 0; j < row_bytes; ++j) {
      const unsigned char want = a ? x[i * row_bytes + j] : 0;
      if (dense[i * row_bytes + j] != want) {
        ok = false;
        break;
      }
    }
  }
  if (!ok) {
    ++failures;
    std::printf(
        "FAIL B=%lld S=%lld row=%lld mask=%d%s density=%.2f misalign=%d\n",
        (long long)B, (long long)S, (long long)row_bytes, mask_width,
        mask_float ? "f" : "", density, misalign);
  }
}

// Median of `reps` timings of fn, in ms, with events on stream 0.
template <typename Fn>
float TimeMs(int reps, Fn fn) {
  gpuEvent_t a, b;
  CHECK_GPU(gpuEventCreate(&a));
  CHECK_GPU(gpuEventCreate(&b));
  fn();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_GPU(gpuEventRecord(a, 0));
    fn();
    CHECK_GPU(gpuEventRecord(b, 0));
    CHECK_GPU(gpuEventSynchronize(b));
    float t = 0;
    CHECK_GPU(gpuEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void Bench(std::mt19937_64& rng, int64_t B, int64_t S, int64_t H,
           double density, bool prefix) {
  const int64_t N = B * S, row = H * 2;  // bf16
  const std::vector<uint8_t> mask = packd::MaskActivity(
      prefix ? packd::MaskPattern::kPrefix : packd::MaskPattern::kHoles, B, S,
      density, rng);
  int64_t total = 0;
  for (auto m : mask) total += m;
  DeviceMem d_mask(N), d_x(N * row), d_out(N * row), d_dense(N * row),
      d_copy(N * row);
  CHECK_GPU(gpuMemcpyAsync(d_mask.p, mask.data(), N, gpuMemcpyHostToDevice, 0));
  CHECK_GPU(gpuMemsetAsync(d_x.p, 1, N * row, 0));
  Scan scan(d_mask.p, B, S, 1, false);
  const int64_t packed_bytes = total * row;
  const float copy = TimeMs(20, [&] {
    CHECK_GPU(gpuMemcpyAsync(d_copy.p, d_x.p, packed_bytes,
                             gpuMemcpyDeviceToDevice, 0));
  });
  // Pack as a call does it: scan, one sync for cu_seqlens, gather (a copy when
  // all active).
  const float pack = TimeMs(20, [&] {
    scan.Run();
    if (total == N) {
      CHECK_GPU(gpuMemcpyAsync(d_out.p, d_x.p, packed_bytes,
                               gpuMemcpyDeviceToDevice, 0));
    } else {
      CHECK_GPU(packd::gpu::LaunchGather(d_x.p, d_out.p, scan.scan.index, total,
                                         row, 0));
    }
  });
  // Pack with outputs that hold every row: the scan and the gather, the row
  // count read on the device, and no round trip.
  const float ahead = TimeMs(20, [&] {
    scan.Launch();
    CHECK_GPU(packd::gpu::LaunchGather(d_x.p, d_out.p, scan.scan.index, N, row,
                                       0, scan.scan.cu_seqlens + B));
  });
  const float gather = TimeMs(20, [&] {
    CHECK_GPU(packd::gpu::LaunchGather(d_x.p, d_out.p, scan.scan.index, total,
                                       row, 0));
  });
  const float dense_copy = TimeMs(20, [&] {
    CHECK_GPU(
        gpuMemcpyAsync(d_copy.p, d_x.p, N * row, gpuMemcpyDeviceToDevice, 0));
  });
  const float scatter = TimeMs(20, [&] {
    CHECK_GPU(packd::gpu::LaunchZeroInactive(scan.scan, d_dense.p, row, 0));
    CHECK_GPU(packd::gpu::LaunchScatterRows(d_out.p, d_dense.p, scan.scan.index,
                                            total, row, 0));
  });
  std::printf(
      "%-6s %5lld %6lld %5lld %5.2f %9.3f %9.3f %9.3f %7.2f %7.2f %9.3f "
      "%7.2f %9.3f %7.2f %7.1f\n",
      prefix ? "prefix" : "random", (long long)B, (long long)S, (long long)H,
      density, copy, pack, gather, copy / pack, copy / gather, scatter,
      dense_copy / scatter, ahead, copy / ahead, (pack - gather) * 1e3);
}

}  // namespace

int main() {
  int count = 0;
  if (gpuGetDeviceCount(&count) != gpuSuccess || count == 0) {
    std::printf("SKIPPED: no GPU device\n");
    return 0;
  }
  std::mt19937_64 rng(1234);
  int cases = 0;
  const int64_t shapes[][2] = {{0, 0},    {0, 5},    {3, 0},
                               {1, 1},    {2, 3},    {7, 257},
                               {3, 1031}, {1031, 3}, {16, 2048}};
  const int64_t rows[] = {1, 2, 3, 4, 7, 8, 12, 16, 24, 130, 8192};
  const int widths[] = {1, 2, 4, 8};
  for (auto& sh : shapes) {
    for (int64_t r : rows) {
      for (double d : {0.0, 0.3, 1.0}) {
        const int w = widths[cases % 4];
        CheckCase(rng, sh[0], sh[1], r, w, cases % 3 == 0 && w > 1, d,
                  cases % 16);
        ++cases;
      }
    }
  }
  // Again with every grid capped at 3 blocks, so that each grid-stride loop
  // turns (the scan's chunks and tiles, the row copies) on these sizes.
  packd::gpu::SetMaxBlocksForTesting(3);
  const int first_pass = cases;
  for (auto& sh : shapes) {
    for (int64_t r : {int64_t{1}, int64_t{12}, int64_t{130}}) {
      for (double d : {0.3, 1.0}) {
        CheckCase(rng, sh[0], sh[1], r, 1 << (cases % 4), false, d, 0);
        ++cases;
      }
    }
  }
  // More tiles than one scan chunk holds, with few blocks.
  CheckCase(rng, 3, 300000, 2, 1, false, 0.5, 0);
  ++cases;
  packd::gpu::SetMaxBlocksForTesting(int64_t{1} << 20);
  std::printf("grid capped at 3 blocks: %d cases\n", cases - first_pass);
  // Over 4 GiB of input: 64-bit offsets everywhere (B = 1, S = 2^20 + 3,
  // rows of 2050 bf16).
  if (std::getenv("PACKD_GPU_CHECK_SKIP_LARGE") == nullptr) {
    CheckCase(rng, 1, (int64_t{1} << 20) + 3, 4100, 1, false, 0.5, 0);
    ++cases;
    std::printf("over 4 GiB: 1 case\n");
  }
  std::printf("correctness: %d cases, %d failed\n\n", cases, failures);
  std::printf("%-6s %5s %6s %5s %5s %9s %9s %9s %7s %7s %9s %7s %9s %7s %7s\n",
              "mask", "B", "S", "H", "dens", "copy ms", "pack ms", "gathr ms",
              "pack/cp", "gath/cp", "scat ms", "scat/cp", "ahead ms", "ahd/cp",
              "p-g us");
  for (bool prefix : {true, false}) {
    for (double d : {0.1, 0.3, 1.0}) Bench(rng, 16, 1024, 4096, d, prefix);
  }
  for (double d : {0.1, 0.3, 1.0}) Bench(rng, 16, 8192, 4096, d, false);
  std::printf(
      "\n(pack/cp and gath/cp: device-to-device copy time of the packed bytes "
      "over pack "
      "time, with and without the mask scan; scat/cp: copy of the dense bytes "
      "over "
      "scatter time; ahead: pack into outputs that hold every row, without the "
      "round trip (ahd/cp: K4); p-g us: pack minus gather (K1); 1.0 = copy "
      "speed)\n");
  return failures == 0 ? 0 : 1;
}
