#include "kernels/layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/tensor_view.h"

namespace packd {
namespace {

absl::Status NotNegative(int64_t value, absl::string_view field) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", value, " is negative"));
}

// float -> IEEE half, rounding to nearest even (c10::Half's conversion).
uint16_t HalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // inf
  if (abs < 0x38800000u) {
    // A subnormal half (or zero): round abs * 2^24 to an integer.
    float a;
    std::memcpy(&a, &abs, 4);
    const float scaled = a * 16777216.0f;  // exact: a power of two
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));
    return static_cast<uint16_t>(sign | m);
  }
  const uint32_t exp = ((abs >> 23) - 112) << 10;
  uint32_t mant = abs & 0x7fffffu;
  uint32_t half = exp | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

// float -> bfloat16, rounding to nearest even; NaN is 0x7fc0 (c10's).
uint16_t BFloat16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (std::isnan(f)) return 0x7fc0u;
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

template <typename T>
void Put(ElementBytes* out, T value) {
  std::memcpy(out->data(), &value, sizeof(T));
}

// Sequence k of `starts` laid out: where its padded span begins before CP,
// its real and padded lengths.
struct Span {
  int64_t start = 0;  // in the un-split layout
  int64_t length = 0;
  int64_t padded = 0;
  int64_t first_token = 0;  // packed index of its token 0
};

}  // namespace

absl::Status ValidateLayout(const LayoutOptions& o, size_t inputs) {
  PACKD_RETURN_IF_ERROR(NotNegative(o.pad_multiple, "pad_multiple"));
  PACKD_RETURN_IF_ERROR(NotNegative(o.cp_size, "cp_size"));
  PACKD_RETURN_IF_ERROR(NotNegative(o.fixed.tokens, "fixed.tokens"));
  PACKD_RETURN_IF_ERROR(NotNegative(o.fixed.sequences, "fixed.sequences"));
  PACKD_RETURN_IF_ERROR(NotNegative(o.fixed.max_seqlen, "fixed.max_seqlen"));
  if (o.cp_size > 1) {
    if (o.cp_rank < 0 || o.cp_rank >= o.cp_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cp_rank ", o.cp_rank, " is not in [0, cp_size = ", o.cp_size, ")"));
    }
    const int64_t m = std::max<int64_t>(o.pad_multiple, 1);
    if (m % (2 * int64_t{o.cp_size}) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pad_multiple ", o.pad_multiple,
          " is not a multiple of 2 * cp_size = ", 2 * int64_t{o.cp_size},
          ": context parallelism splits every sequence into 2 * cp_size "
          "equal chunks"));
    }
  } else if (o.cp_rank != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cp_rank ", o.cp_rank, " needs cp_size > 1 (cp_size is ",
                     o.cp_size, ")"));
  }
  PACKD_RETURN_IF_ERROR(NotNegative(o.sp_size, "sp_size"));
  if (o.sp_size > 1) {
    if (o.sp_rank < 0 || o.sp_rank >= o.sp_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sp_rank ", o.sp_rank, " is not in [0, sp_size = ", o.sp_size, ")"));
    }
    if (o.cp_size > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sp_size ", o.sp_size, " and cp_size ", o.cp_size,
          " are both set: Ulysses sequence parallelism and context "
          "parallelism split the rows two different ways; give one"));
    }
    if (o.fixed.tokens % o.sp_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fixed.tokens ", o.fixed.tokens, " is not a multiple of sp_size ",
          o.sp_size, ": every SP rank holds fixed.tokens / sp_size rows"));
    }
  } else if (o.sp_rank != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sp_rank ", o.sp_rank, " needs sp_size > 1 (sp_size is ",
                     o.sp_size, ")"));
  }
  if (!o.pad_values.empty() && o.pad_values.size() != inputs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pad_values has ", o.pad_values.size(), " values but there are ",
        inputs, " inputs: give one per input, or none for zeros"));
  }
  for (size_t j = 0; j < o.shifts.size(); ++j) {
    if (o.shifts[j].input < 0 ||
        static_cast<size_t>(o.shifts[j].input) >= inputs) {
      return absl::InvalidArgumentError(
          absl::StrCat("shifts[", j, "].input ", o.shifts[j].input,
                       " names no input (there are ", inputs, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ElementBytes> ValueBytes(DType dtype, double v,
                                        absl::string_view field) {
  ElementBytes out{};
  // An integer dtype T holds v when v is whole and in [min, max]: below
  // 2^digits, which a double holds exactly (max itself may not be).
  auto integer = [&](auto zero) -> absl::StatusOr<ElementBytes> {
    using T = decltype(zero);
    const double upper = std::ldexp(1.0, std::numeric_limits<T>::digits);
    if (!std::isfinite(v) || v != std::trunc(v) ||
        v < static_cast<double>(std::numeric_limits<T>::min()) || v >= upper) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " ", v, " is not a value of ", DTypeName(dtype),
                       " (an integer in [", std::numeric_limits<T>::min(), ", ",
                       std::numeric_limits<T>::max(), "])"));
    }
    Put(&out, static_cast<T>(v));
    return out;
  };
  switch (dtype) {
    case DType::kBool:
      if (v != 0 && v != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " ", v, " is not a value of bool (0 or 1)"));
      }
      out[0] = v != 0;
      return out;
    case DType::kUInt8:
      return integer(uint8_t{0});
    case DType::kInt8:
      return integer(int8_t{0});
    case DType::kInt16:
      return integer(int16_t{0});
    case DType::kInt32:
      return integer(int32_t{0});
    case DType::kInt64:
      return integer(int64_t{0});
    case DType::kFloat16:
      Put(&out, HalfBits(static_cast<float>(v)));
      return out;
    case DType::kBFloat16:
      Put(&out, BFloat16Bits(static_cast<float>(v)));
      return out;
    case DType::kFloat32:
      Put(&out, static_cast<float>(v));
      return out;
    case DType::kFloat64:
      Put(&out, v);
      return out;
    case DType::kUnspecified:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": invalid dtype"));
}

absl::StatusOr<LayoutValues> CheckLayout(const LayoutOptions& options,
                                         absl::Span<const DType> dtypes) {
  PACKD_RETURN_IF_ERROR(ValidateLayout(options, dtypes.size()));
  LayoutValues values;
  values.pads.resize(dtypes.size());
  for (size_t i = 0; i < options.pad_values.size(); ++i) {
    PACKD_ASSIGN_OR_RETURN(values.pads[i],
                           ValueBytes(dtypes[i], options.pad_values[i],
                                      absl::StrCat("pad_values[", i, "]")));
  }
  for (size_t j = 0; j < options.shifts.size(); ++j) {
    const Shift& shift = options.shifts[j];
    PACKD_ASSIGN_OR_RETURN(ElementBytes fill,
                           ValueBytes(dtypes[shift.input], shift.fill,
                                      absl::StrCat("shifts[", j, "].fill")));
    values.fills.push_back(fill);
  }
  return values;
}

int64_t Layout::RowsOf(const std::vector<TokenRun>& runs) {
  int64_t n = 0;
  for (const TokenRun& run : runs) n += run.count;
  return n;
}

void Layout::ExpandRuns() {
  if (expanded_) return;
  expanded_ = true;
  for (const auto& [runs, rows] :
       {std::pair{&source_runs, &source}, {&shifted_runs, &shifted_source}}) {
    rows->clear();
    rows->reserve(RowsOf(*runs));
    for (const TokenRun& run : *runs) {
      for (int64_t i = 0; i < run.count; ++i) {
        rows->push_back(run.token < 0 ? -1 : run.token + i);
      }
    }
  }
}

absl::StatusOr<Layout> MakeLayout(const std::vector<int64_t>& starts,
                                  const LayoutOptions& options,
                                  bool with_position_ids) {
  const int64_t m = std::max<int64_t>(options.pad_multiple, 1);
  const int64_t K = static_cast<int64_t>(starts.size()) - 1;
  const FixedLayout& fixed = options.fixed;
  auto overflow = [] {
    return absl::InvalidArgumentError(
        "the padded layout has more rows than int64 can count");
  };

  // Every sequence's span in the un-split layout.
  std::vector<Span> spans;
  spans.reserve(K + 1);
  int64_t total = 0, longest = 0, longest_padded = 0;
  for (int64_t k = 0; k < K; ++k) {
    Span s;
    s.first_token = starts[k];
    s.length = starts[k + 1] - starts[k];
    int64_t padded = 0;
    if (!CheckedAdd(s.length, m - 1, &padded)) return overflow();
    s.padded = padded / m * m;
    s.start = total;
    if (!CheckedAdd(total, s.padded, &total)) return overflow();
    longest = std::max(longest, s.length);
    longest_padded = std::max(longest_padded, s.padded);
    spans.push_back(s);
  }
  const int64_t batch_padded = total;
  // The trailing ghost sequence of `fixed.tokens`.
  bool ghost = false;
  if (fixed.tokens > 0) {
    if (fixed.tokens < batch_padded) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fixed.tokens ", fixed.tokens, " is less than the ", batch_padded,
          options.reshapes() && m > 1 ? " padded" : "",
          " tokens of this batch"));
    }
    const int64_t rest = fixed.tokens - batch_padded;
    if (rest % m != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fixed.tokens ", fixed.tokens, " leaves ", rest,
          " rows after the batch's ", batch_padded,
          " padded tokens, which is not a multiple of pad_multiple ", m));
    }
    if (rest > 0) {
      ghost = true;
      Span g;
      g.start = batch_padded;
      g.padded = rest;
      g.first_token = starts.back();
      spans.push_back(g);
      longest_padded = std::max(longest_padded, rest);
      total = fixed.tokens;
    }
  }
  // Ulysses: the rows padded to a multiple of sp_size by the same trailing
  // ghost (a fixed.tokens is a multiple already: ValidateLayout).
  const int64_t u = options.sp_size > 1 ? options.sp_size : 1;
  if (total % u != 0) {
    ghost = true;
    Span g;
    g.start = total;
    g.padded = u - total % u;
    g.first_token = starts.back();
    spans.push_back(g);
    longest_padded = std::max(longest_padded, g.padded);
    if (!CheckedAdd(total, g.padded, &total)) return overflow();
  }
  const int64_t sequences = K + (ghost ? 1 : 0);
  if (fixed.sequences > 0 && fixed.sequences < sequences) {
    return absl::InvalidArgumentError(
        absl::StrCat("fixed.sequences ", fixed.sequences, " is less than the ",
                     sequences, " sequences of this batch",
                     ghost ? " (its trailing ghost included)" : ""));
  }
  if (fixed.max_seqlen > 0 && fixed.max_seqlen < longest_padded) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fixed.max_seqlen ", fixed.max_seqlen, " is less than ", longest_padded,
        ", the longest padded sequence of this batch",
        ghost ? " (its trailing ghost included)" : ""));
  }

  if (options.max_rows > 0 && fixed.sequences > options.max_rows) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fixed.sequences ", fixed.sequences,
        " asks for prefix arrays of more than the ", options.max_rows,
        " entries this call may have (what its response can "
        "carry)"));
  }
  if (fixed.sequences == std::numeric_limits<int64_t>::max()) {
    return absl::InvalidArgumentError(
        "fixed.sequences is too large: its prefix arrays have sequences + 1 "
        "entries");
  }
  Layout out;
  out.cu_seqlens = starts;
  if (ghost) out.cu_seqlens.push_back(starts.back());
  out.max_seqlen = fixed.max_seqlen > 0 ? fixed.max_seqlen : longest;
  if (options.reshapes()) {
    out.cu_seqlens_padded.reserve(spans.size() + 1);
    out.cu_seqlens_padded.push_back(0);
    for (const Span& s : spans) {
      out.cu_seqlens_padded.push_back(s.start + s.padded);
    }
    out.max_seqlen_padded =
        fixed.max_seqlen > 0 ? fixed.max_seqlen : longest_padded;
  }
  if (fixed.sequences > 0 && options.max_rows == 0 &&
      fixed.sequences > (int64_t{1} << 40)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("fixed.sequences ", fixed.sequences,
                     " asks for prefix arrays too "
                     "large for memory"));
  }
  if (fixed.sequences > 0) {
    out.cu_seqlens.resize(fixed.sequences + 1, out.cu_seqlens.back());
    if (options.reshapes()) {
      out.cu_seqlens_padded.resize(fixed.sequences + 1,
                                   out.cu_seqlens_padded.back());
    }
  }

  // The rows, sequence by sequence: all of them; or with CP this rank's two
  // chunks of each (TransformerEngine's get_batch_on_this_cp_rank); or with
  // SP this rank's contiguous 1 / u of the rows (verl's
  // ulysses_pad_and_slice_inputs). Each array is filled by tight loops over
  // runs of real rows and of padding.
  const int64_t c = options.cp_size > 1 ? options.cp_size : 1;
  const int64_t r = c > 1 ? options.cp_rank : 0;
  const bool shifts = !options.shifts.empty();
  const int64_t rows = total / c / u;
  if (options.max_rows > 0 && rows > options.max_rows) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the layout has ", rows, " rows (pad_multiple ", options.pad_multiple,
        ", fixed.tokens ", fixed.tokens, "), more than the ", options.max_rows,
        " this call may have (what its response can carry)"));
  }
  try {
    if (with_position_ids) out.position_ids.resize(rows);
    if (options.with_seq_idx) out.seq_idx.resize(rows);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the layout's ", rows, " rows do not fit in this process's memory"));
  }
  // The rows as runs (a sequence's tokens, its padding, the next one's
  // tokens...), each run joined to the one before when it continues it, so
  // that a layout that pads nothing is one run.
  auto append = [](std::vector<TokenRun>& runs, int64_t token, int64_t count) {
    if (count <= 0) return;
    if (!runs.empty()) {
      TokenRun& last = runs.back();
      if (token < 0 ? last.token < 0
                    : last.token >= 0 && last.token + last.count == token) {
        last.count += count;
        return;
      }
    }
    runs.push_back(TokenRun{token, count});
  };
  int64_t j = 0;
  auto add = [&](int64_t k, const Span& s, int64_t from, int64_t to) {
    const int64_t end = std::clamp(s.length, from, to);
    append(out.source_runs, s.first_token + from, end - from);
    append(out.source_runs, -1, to - end);
    if (shifts) {  // token i + 1 of the sequence, where there is one
      const int64_t shifted_end = std::clamp(s.length - 1, from, to);
      append(out.shifted_runs, s.first_token + 1 + from, shifted_end - from);
      append(out.shifted_runs, -1, to - shifted_end);
    }
    if (with_position_ids) {
      std::iota(out.position_ids.begin() + j,
                out.position_ids.begin() + j + (to - from), from);
    }
    if (options.with_seq_idx) {
      std::fill(out.seq_idx.begin() + j, out.seq_idx.begin() + j + (to - from),
                k);
    }
    j += to - from;
  };
  // This SP rank's rows of the un-split layout (all of them without SP).
  const int64_t window_begin = u > 1 ? options.sp_rank * rows : 0;
  const int64_t window_end = window_begin + (u > 1 ? rows : total);
  for (size_t k = 0; k < spans.size(); ++k) {
    const Span& s = spans[k];
    if (c > 1) {
      const int64_t h = s.padded / (2 * c);
      add(k, s, r * h, (r + 1) * h);
      add(k, s, (2 * c - 1 - r) * h, (2 * c - r) * h);
      continue;
    }
    const int64_t from = std::max<int64_t>(window_begin - s.start, 0);
    const int64_t to = std::min<int64_t>(window_end - s.start, s.padded);
    if (from < to) add(k, s, from, to);
  }
  return out;
}

}  // namespace packd
