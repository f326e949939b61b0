// The options of a layout for parallel attention (docs/design.md §10): what
// a caller asks a Pack to lay its rows out as (padding, context-parallel or
// Ulysses slices, fixed shapes, shifts, seq_idx). Plain data, shared by the
// clients, the codec and the op library, which does the arithmetic
// (kernels/layout.h).
//
//   LayoutOptions layout;
//   layout.pad_multiple = 8; layout.cp_size = 2; layout.cp_rank = rank;
#ifndef PACKD_BASE_LAYOUT_OPTIONS_H_
#define PACKD_BASE_LAYOUT_OPTIONS_H_

#include <cstdint>
#include <vector>

namespace packd {

// Shapes for CUDA graphs; each 0 = not fixed.
struct FixedLayout {
  int64_t tokens =
      0;  // T: output rows, a trailing ghost sequence taking the rest
  int64_t sequences = 0;   // N: prefix arrays extended to N + 1 entries
  int64_t max_seqlen = 0;  // M: the maxima reported

  bool any() const { return tokens != 0 || sequences != 0 || max_seqlen != 0; }
};

// A next-token view of input `input`: its row of token i + 1 of the same
// sequence, `fill` at each sequence's last token and at every pad row.
struct Shift {
  int input = 0;
  double fill = 0;
};

struct LayoutOptions {
  int64_t pad_multiple = 0;        // 0 or 1: no padding
  std::vector<double> pad_values;  // empty: zero pad rows; else one per input
  int32_t cp_size = 0;             // 0 or 1: no context parallelism
  int32_t cp_rank = 0;
  // Ulysses sequence parallelism (0 or 1: none): the rows padded to a
  // multiple of sp_size by a trailing ghost, and sp_rank's contiguous
  // 1 / sp_size of them. Not with cp_size > 1.
  int32_t sp_size = 0;
  int32_t sp_rank = 0;
  bool with_seq_idx = false;
  std::vector<Shift> shifts;
  FixedLayout fixed;
  // Output rows a layout may have at most (0: no limit): MakeLayout refuses
  // more with RESOURCE_EXHAUSTED before it allocates anything for them. A
  // server sets it from its message limit (each row costs at least 8 bytes).
  int64_t max_rows = 0;

  // Whether the call's rows differ from x[mask]'s (padding, CP, SP or
  // fixed): then cu_seqlens_padded and max_seqlen_padded are returned.
  bool reshapes() const {
    return pad_multiple > 1 || cp_size > 1 || sp_size > 1 || fixed.any();
  }
  // Whether any layout field is set, even to a value that changes no row
  // (pad_multiple 1) or that ValidateLayout refuses (a negative one).
  bool any() const {
    return pad_multiple != 0 || cp_size != 0 || cp_rank != 0 || sp_size != 0 ||
           sp_rank != 0 || fixed.any() || !pad_values.empty() || with_seq_idx ||
           !shifts.empty();
  }
};

}  // namespace packd

#endif  // PACKD_BASE_LAYOUT_OPTIONS_H_
