#include "kernels/cpu/mask_scan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PACKD_X86 1
#endif

namespace packd {
namespace {

// Eight flags of 1, as one word.
constexpr uint64_t kOnes = 0x0101010101010101ULL;

uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The counts of flags a[i, n), continuing from `prev` (a[i - 1], or the
// row's `before`), added to *count and *runs; eight at a time, where one
// multiply adds a word's bytes into its top byte (at most 8: nothing carries
// out).
void CountPortable(const uint8_t* a, int64_t i, int64_t n, uint8_t prev,
                   int64_t* count, int64_t* runs) {
  uint64_t carry = prev;
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = Load64(a + i);
    const uint64_t previous = (w << 8) | carry;
    *count += (w * kOnes) >> 56;
    *runs += ((w & ~previous & kOnes) * kOnes) >> 56;
    carry = w >> 56;
  }
  prev = static_cast<uint8_t>(carry);
  for (; i < n; ++i) {
    *count += a[i];
    *runs += a[i] & (prev ^ 1);
    prev = a[i];
  }
}

#if PACKD_X86
// Sixteen at a time: psadbw sums a vector's bytes into its two 64-bit halves,
// and a run starts where the flags, shifted up one byte with the previous
// vector's last carried in, are clear. `m` null: `a` holds the flags already;
// else they are computed from the mask bytes m and written to a.
int64_t ScanSse2(const uint8_t* m, uint8_t magnitude, int64_t n, uint8_t before,
                 uint8_t* a, int64_t* starts) {
  const __m128i zero = _mm_setzero_si128();
  const __m128i one = _mm_set1_epi8(1);
  const __m128i bits = _mm_set1_epi8(static_cast<char>(magnitude));
  __m128i counts = zero, runs = zero;
  __m128i carry = _mm_cvtsi32_si128(before);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i w;
    if (m != nullptr) {
      const __m128i v = _mm_and_si128(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i)), bits);
      w = _mm_andnot_si128(_mm_cmpeq_epi8(v, zero), one);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a + i), w);
    } else {
      w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
    }
    const __m128i previous = _mm_or_si128(_mm_slli_si128(w, 1), carry);
    counts = _mm_add_epi64(counts, _mm_sad_epu8(w, zero));
    runs =
        _mm_add_epi64(runs, _mm_sad_epu8(_mm_andnot_si128(previous, w), zero));
    carry = _mm_srli_si128(w, 15);
  }
  int64_t count = _mm_cvtsi128_si64(counts) +
                  _mm_cvtsi128_si64(_mm_unpackhi_epi64(counts, counts));
  int64_t run_count = _mm_cvtsi128_si64(runs) +
                      _mm_cvtsi128_si64(_mm_unpackhi_epi64(runs, runs));
  if (m != nullptr) {
    for (int64_t s = i; s < n; ++s) a[s] = (m[s] & magnitude) != 0;
  }
  CountPortable(a, i, n, i > 0 ? a[i - 1] : before, &count, &run_count);
  *starts = run_count;
  return count;
}

// Thirty-two at a time, the same way; the previous byte of each position comes
// from across the 128-bit lanes (permute, then alignr).
__attribute__((target("avx2"))) int64_t ScanAvx2(const uint8_t* m,
                                                 uint8_t magnitude, int64_t n,
                                                 uint8_t before, uint8_t* a,
                                                 int64_t* starts) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i one = _mm256_set1_epi8(1);
  const __m256i bits = _mm256_set1_epi8(static_cast<char>(magnitude));
  __m256i counts = zero, runs = zero;
  // The previous vector: only its last byte is read (as `before`).
  __m256i last = _mm256_insert_epi8(zero, static_cast<char>(before), 31);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i w;
    if (m != nullptr) {
      const __m256i v = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + i)), bits);
      w = _mm256_andnot_si256(_mm256_cmpeq_epi8(v, zero), one);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i), w);
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    }
    const __m256i previous =
        _mm256_alignr_epi8(w, _mm256_permute2x128_si256(last, w, 0x21), 15);
    counts = _mm256_add_epi64(counts, _mm256_sad_epu8(w, zero));
    runs = _mm256_add_epi64(
        runs, _mm256_sad_epu8(_mm256_andnot_si256(previous, w), zero));
    last = w;
  }
  alignas(32) int64_t c[4], r[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), counts);
  _mm256_store_si256(reinterpret_cast<__m256i*>(r), runs);
  int64_t count = c[0] + c[1] + c[2] + c[3];
  int64_t run_count = r[0] + r[1] + r[2] + r[3];
  if (m != nullptr) {
    for (int64_t s = i; s < n; ++s) a[s] = (m[s] & magnitude) != 0;
  }
  CountPortable(a, i, n, i > 0 ? a[i - 1] : before, &count, &run_count);
  *starts = run_count;
  return count;
}

// The eight flags of a word (bytes 0 or 1) as the bits of a mask, bit i from
// byte i: one multiply moves byte i's bit to bit 56 + i, with no carries (every
// partial product is a distinct power of two).
inline uint32_t FlagBits(uint64_t w) {
  return static_cast<uint32_t>(((w & kOnes) * 0x0102040810204080ULL) >> 56);
}

// The flags of kLanes elements (a multiple of 8) as the bits of a mask.
template <int kLanes>
uint32_t VectorFlagBits(const uint8_t* flags) {
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; i += 8) bits |= FlagBits(Load64(flags + i)) << i;
  return bits;
}

// For elements of 4 or 8 bytes: compress into a register and store it whole
// while a whole vector fits in `room` elements (a compress store to memory is
// several times slower), then compress stores.
template <typename T>
__attribute__((target("avx512f,popcnt"))) int64_t CompactAvx512(
    const uint8_t* flags, const T* src, int64_t n, T* out, int64_t room) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a 512-bit vector's lanes");
  constexpr int kLanes = 64 / sizeof(T);
  int64_t k = 0, s = 0;
  for (; s + kLanes <= n && k + kLanes <= room; s += kLanes) {
    const uint32_t bits = VectorFlagBits<kLanes>(flags + s);
    const __m512i v = _mm512_loadu_si512(src + s);
    _mm512_storeu_si512(
        out + k,
        sizeof(T) == 8
            ? _mm512_maskz_compress_epi64(static_cast<__mmask8>(bits), v)
            : _mm512_maskz_compress_epi32(static_cast<__mmask16>(bits), v));
    k += __builtin_popcount(bits);
  }
  for (; s + kLanes <= n; s += kLanes) {
    const uint32_t bits = VectorFlagBits<kLanes>(flags + s);
    const __m512i v = _mm512_loadu_si512(src + s);
    if (sizeof(T) == 8) {
      _mm512_mask_compressstoreu_epi64(out + k, static_cast<__mmask8>(bits), v);
    } else {
      _mm512_mask_compressstoreu_epi32(out + k, static_cast<__mmask16>(bits),
                                       v);
    }
    k += __builtin_popcount(bits);
  }
  // Rows may be unaligned for the element's type (an element is a row of
  // bytes, not necessarily one value): byte copies.
  for (; s < n; ++s) {
    if (flags[s]) std::memcpy(out + k++, src + s, sizeof(*src));
  }
  return k;
}
#endif

// Every element written at the cursor, which only a flagged one advances.
// The last write lands at the final count, one past the result, unless the
// last element is flagged: so the loop stops at the last flagged element.
template <typename T>
int64_t CompactPortable(const uint8_t* flags, const T* src, int64_t n, T* out) {
  while (n > 0 && flags[n - 1] == 0) --n;
  int64_t k = 0;
  for (int64_t s = 0; s < n; ++s) {
    std::memcpy(out + k, src + s, sizeof(T));
    k += flags[s];
  }
  return k;
}

struct Bytes16 {
  unsigned char b[16];
};

// Neighbour changes one element at a time, for word w (elements 64 w to 64 w
// + 63 against their next, those with one).
template <typename T>
uint64_t ChangeWordPortable(const unsigned char* v, int64_t n, int64_t w) {
  uint64_t word = 0;
  const int64_t j0 = 64 * w, j1 = std::min<int64_t>(j0 + 64, n - 1);
  T a;
  std::memcpy(&a, v + j0 * sizeof(T), sizeof(T));
  for (int64_t j = j0; j < j1; ++j) {
    T b;
    std::memcpy(&b, v + (j + 1) * sizeof(T), sizeof(T));
    word |= static_cast<uint64_t>(a != b) << (j - j0);
    a = b;
  }
  return word;
}

template <typename T>
void NeighbourChangesPortable(const void* v, int64_t n, uint64_t* bits) {
  const auto* p = static_cast<const unsigned char*>(v);
  for (int64_t w = 0; 64 * w < n - 1; ++w) {
    bits[w] = ChangeWordPortable<T>(p, n, w);
  }
}

#if PACKD_X86
// Whole words (every element with a next one) by Word, a vector function of
// the word's first element; the last word, if partial, one at a time.
template <typename T, uint64_t (*Word)(const unsigned char*)>
void NeighbourChangesWith(const void* v, int64_t n, uint64_t* bits) {
  const auto* p = static_cast<const unsigned char*>(v);
  int64_t w = 0;
  for (; 64 * w + 65 <= n; ++w) bits[w] = Word(p + 64 * w * sizeof(T));
  for (; 64 * w < n - 1; ++w) bits[w] = ChangeWordPortable<T>(p, n, w);
}

// For elements of 4 or 8 bytes: a word of changes (bit j: element j differs
// from element j + 1), a 512-bit vector at a time.
template <typename T>
__attribute__((target("avx512f"))) uint64_t ChangeWordAvx512(
    const unsigned char* p) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a 512-bit vector's lanes");
  constexpr int kLanes = 64 / sizeof(T);
  uint64_t word = 0;
  for (int i = 0; i < 64 / kLanes; ++i) {
    const unsigned char* q = p + 64 * i;
    const __m512i a = _mm512_loadu_si512(q);
    const __m512i b = _mm512_loadu_si512(q + sizeof(T));
    const uint64_t m = sizeof(T) == 8 ? _mm512_cmpneq_epi64_mask(a, b)
                                      : _mm512_cmpneq_epi32_mask(a, b);
    word |= m << (kLanes * i);
  }
  return word;
}

// AVX2: equal lanes compared, their sign bits gathered, inverted.
#define PACKD_LOAD256(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))

__attribute__((target("avx2"))) uint64_t ChangeWordAvx2_8(
    const unsigned char* p) {
  uint64_t word = 0;
  for (int i = 0; i < 2; ++i) {
    const unsigned char* q = p + 32 * i;
    const uint32_t eq = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(PACKD_LOAD256(q), PACKD_LOAD256(q + 1))));
    word |= static_cast<uint64_t>(~eq) << (32 * i);
  }
  return word;
}

__attribute__((target("avx2"))) uint64_t ChangeWordAvx2_16(
    const unsigned char* p) {
  uint64_t word = 0;
  for (int i = 0; i < 2; ++i) {
    const unsigned char* q = p + 64 * i;
    const __m256i lo =
        _mm256_cmpeq_epi16(PACKD_LOAD256(q), PACKD_LOAD256(q + 2));
    const __m256i hi =
        _mm256_cmpeq_epi16(PACKD_LOAD256(q + 32), PACKD_LOAD256(q + 34));
    // packs works within 128-bit lanes: put the four quarters in order.
    const __m256i bytes =
        _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xd8);
    const uint32_t eq = static_cast<uint32_t>(_mm256_movemask_epi8(bytes));
    word |= static_cast<uint64_t>(~eq) << (32 * i);
  }
  return word;
}

// For elements of 4 or 8 bytes: each lane's sign bits, as a float's or a
// double's, are its equality.
template <typename T>
__attribute__((target("avx2"))) uint64_t ChangeWordAvx2Wide(
    const unsigned char* p) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a 256-bit vector's lanes");
  constexpr int kLanes = 32 / sizeof(T);
  uint64_t word = 0;
  for (int i = 0; i < 64 / kLanes; ++i) {
    const unsigned char* q = p + 32 * i;
    const __m256i a = PACKD_LOAD256(q), b = PACKD_LOAD256(q + sizeof(T));
    const uint32_t eq =
        sizeof(T) == 8
            ? _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(a, b)))
            : _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)));
    word |= static_cast<uint64_t>(~eq & ((1u << kLanes) - 1)) << (kLanes * i);
  }
  return word;
}
#undef PACKD_LOAD256
#endif

}  // namespace

void NeighbourChanges(const void* v, int64_t n, int width, uint64_t* bits,
                      VectorPath path) {
  if (n < 2) return;
#if PACKD_X86
  if (path == VectorPath::kAvx512 && width == 4) {
    return NeighbourChangesWith<uint32_t, ChangeWordAvx512<uint32_t>>(v, n,
                                                                      bits);
  }
  if (path == VectorPath::kAvx512 && width == 8) {
    return NeighbourChangesWith<uint64_t, ChangeWordAvx512<uint64_t>>(v, n,
                                                                      bits);
  }
  if (path >= VectorPath::kAvx2) {
    switch (width) {
      case 1:
        return NeighbourChangesWith<uint8_t, ChangeWordAvx2_8>(v, n, bits);
      case 2:
        return NeighbourChangesWith<uint16_t, ChangeWordAvx2_16>(v, n, bits);
      case 4:
        return NeighbourChangesWith<uint32_t, ChangeWordAvx2Wide<uint32_t>>(
            v, n, bits);
      default:
        return NeighbourChangesWith<uint64_t, ChangeWordAvx2Wide<uint64_t>>(
            v, n, bits);
    }
  }
#endif
  switch (width) {
    case 1:
      return NeighbourChangesPortable<uint8_t>(v, n, bits);
    case 2:
      return NeighbourChangesPortable<uint16_t>(v, n, bits);
    case 4:
      return NeighbourChangesPortable<uint32_t>(v, n, bits);
    default:
      return NeighbourChangesPortable<uint64_t>(v, n, bits);
  }
}

int64_t CompactFlags(const uint8_t* flags, const void* src, int64_t n,
                     int width, void* out, int64_t room, VectorPath path) {
#if PACKD_X86
  if (path == VectorPath::kAvx512 && width == 8) {
    return CompactAvx512(flags, static_cast<const uint64_t*>(src), n,
                         static_cast<uint64_t*>(out), room);
  }
  if (path == VectorPath::kAvx512 && width == 4) {
    return CompactAvx512(flags, static_cast<const uint32_t*>(src), n,
                         static_cast<uint32_t*>(out), room);
  }
#endif
  switch (width) {
    case 1:
      return CompactPortable(flags, static_cast<const uint8_t*>(src), n,
                             static_cast<uint8_t*>(out));
    case 2:
      return CompactPortable(flags, static_cast<const uint16_t*>(src), n,
                             static_cast<uint16_t*>(out));
    case 4:
      return CompactPortable(flags, static_cast<const uint32_t*>(src), n,
                             static_cast<uint32_t*>(out));
    case 8:
      return CompactPortable(flags, static_cast<const uint64_t*>(src), n,
                             static_cast<uint64_t*>(out));
    default:
      return CompactPortable(flags, static_cast<const Bytes16*>(src), n,
                             static_cast<Bytes16*>(out));
  }
}

bool CanRun(VectorPath path) {
  switch (path) {
    case VectorPath::kPortable:
      return true;
#if PACKD_X86
    case VectorPath::kSse2:
      return __builtin_cpu_supports("sse2");
    case VectorPath::kAvx2:
      return __builtin_cpu_supports("avx2");
    case VectorPath::kAvx512:
      return __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("popcnt");
#endif
    default:
      return false;
  }
}

VectorPath ChosenVectorPath() {
  static const VectorPath path = [] {
    const char* env = std::getenv("PACKD_CPU_VECTORS");
    if (env != nullptr && std::strcmp(env, "off") == 0) {
      return VectorPath::kPortable;
    }
    for (VectorPath p :
         {VectorPath::kAvx512, VectorPath::kAvx2, VectorPath::kSse2}) {
      if (CanRun(p)) return p;
    }
    return VectorPath::kPortable;
  }();
  return path;
}

absl::string_view VectorPathName(VectorPath path) {
  switch (path) {
    case VectorPath::kAvx512:
      return "avx512";
    case VectorPath::kAvx2:
      return "avx2";
    case VectorPath::kSse2:
      return "sse2";
    default:
      return "portable";
  }
}

int64_t ScanByteRow(const uint8_t* m, uint8_t magnitude, int64_t n,
                    uint8_t before, uint8_t* flags, int64_t* starts,
                    VectorPath path) {
#if PACKD_X86
  if (path >= VectorPath::kAvx2) {
    return ScanAvx2(m, magnitude, n, before, flags, starts);
  }
  if (path == VectorPath::kSse2) {
    return ScanSse2(m, magnitude, n, before, flags, starts);
  }
#endif
  for (int64_t s = 0; s < n; ++s) flags[s] = (m[s] & magnitude) != 0;
  return CountFlags(flags, n, before, starts, VectorPath::kPortable);
}

int64_t CountFlags(const uint8_t* flags, int64_t n, uint8_t before,
                   int64_t* starts, VectorPath path) {
#if PACKD_X86
  // The flags are only read: a null mask says so.
  uint8_t* a = const_cast<uint8_t*>(flags);
  if (path >= VectorPath::kAvx2)
    return ScanAvx2(nullptr, 0, n, before, a, starts);
  if (path == VectorPath::kSse2)
    return ScanSse2(nullptr, 0, n, before, a, starts);
#endif
  int64_t count = 0, runs = 0;
  CountPortable(flags, 0, n, before, &count, &runs);
  *starts = runs;
  return count;
}

}  // namespace packd
