// Layouts for parallel attention (docs/design.md §10): padding every sequence
// to a multiple, context-parallel (CP) slices, Ulysses sequence-parallel (SP)
// slices, fixed shapes with a ghost sequence, next-token shifts and seq_idx. A
// layout is a gather plan: for each output row, the packed token it holds or
// padding. It is built once per call, on the host, from the mask scan (and the
// document cut), and every tensor of the call uses it: inputs, shifted inputs
// (the same plan, one token further within the sequence), and position ids and
// seq_idx derived from it.
//
// clang-format off
//   PACKD_RETURN_IF_ERROR(ValidateLayout(options.layout, inputs.size()));
//   PACKD_ASSIGN_OR_RETURN(Layout layout, MakeLayout(sequence_starts, options.layout));
//   // output rows are layout.source_runs: runs of packed tokens, or of padding (-1)
// clang-format on
#ifndef PACKD_KERNELS_LAYOUT_H_
#define PACKD_KERNELS_LAYOUT_H_

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "base/layout_options.h"

namespace packd {

// INVALID_ARGUMENT naming the field for what is wrong whatever the batch: a
// negative pad_multiple, cp_size, sp_size or fixed field; a cp_rank outside
// [0, cp_size) or an sp_rank outside [0, sp_size); a pad_multiple that is not
// a multiple of 2 * cp_size; cp_size and sp_size both above 1; a fixed.tokens
// that is not a multiple of sp_size; a count of pad_values other than
// `inputs`; a shift naming no input.
absl::Status ValidateLayout(const LayoutOptions& options, size_t inputs);

// One element's bytes, little-endian (the first ItemSize of them).
using ElementBytes = std::array<unsigned char, 8>;

// INVALID_ARGUMENT when `value` (a pad value or fill of `field`) is not one
// `dtype` holds exactly: out of range or a fraction for an integer, not 0 or 1
// for bool. Floating dtypes take any value (rounded as torch converts).
// Otherwise the value's bytes in `dtype`, little-endian, ItemSize(dtype) of
// them.
absl::StatusOr<ElementBytes> ValueBytes(DType dtype, double value,
                                        absl::string_view field);

// A layout's values in its inputs' dtypes: pads[i] is input i's pad value
// (zero bytes without pad_values), fills[j] shift j's fill.
struct LayoutValues {
  std::vector<ElementBytes> pads;
  std::vector<ElementBytes> fills;
};

// Everything Pack checks of a layout before it scans a mask: ValidateLayout
// for inputs of `dtypes`, and every pad value and fill a value of its input's
// dtype (ValueBytes). INVALID_ARGUMENT naming the field; otherwise the values.
absl::StatusOr<LayoutValues> CheckLayout(const LayoutOptions& options,
                                         absl::Span<const DType> dtypes);

struct Layout {
  // The sequences' real prefix array, extended for `fixed` (the ghost's and
  // zero-length ghosts' entries repeat the last value); its maximum length
  // (M when fixed.max_seqlen is set).
  std::vector<int64_t> cu_seqlens;
  int64_t max_seqlen = 0;
  // [K + 1] (more with `fixed`, or with an SP ghost), and the largest padded
  // length, ghost included (M when fixed); empty and 0 unless the options
  // reshape.
  std::vector<int64_t> cu_seqlens_padded;
  int64_t max_seqlen_padded = 0;
  // The output rows, in output order (this CP or SP rank's rows), as runs:
  // the packed tokens each holds (a run of token -1: padding), and the
  // packed tokens its shifted rows hold (-1: fill). A sequence is a run or
  // two (its tokens, its padding), and runs that continue each other are
  // one, so a backend gathers with a copy per run (Backend::GatherRuns).
  std::vector<TokenRun> source_runs;
  std::vector<TokenRun> shifted_runs;
  // The same, one entry per row: empty until ExpandRuns(), which a backend
  // that gathers by rows needs.
  std::vector<int64_t> source;
  std::vector<int64_t> shifted_source;
  // Per output row: its position id; its sequence.
  std::vector<int64_t> position_ids;
  std::vector<int64_t> seq_idx;
  // A stream of shared prompts (kernels/shared_prefix.h): then the rows are
  // the stream's, the shifted ones its targets', and seq_idx each row's group.
  std::optional<SharedLayout> shared;

  int64_t rows() const { return RowsOf(source_runs); }
  int64_t shifted_rows() const { return RowsOf(shifted_runs); }
  // Fills source and shifted_source from the runs (once).
  void ExpandRuns();

 private:
  static int64_t RowsOf(const std::vector<TokenRun>& runs);
  bool expanded_ = false;
};

// The layout of a batch whose sequences (rows, or documents) are packed
// tokens starts[k] .. starts[k + 1] (starts[0] = 0, K + 1 entries), for
// options that passed ValidateLayout. Fills shifted_runs only when
// options.shifts is set, seq_idx only with with_seq_idx, position_ids only
// with `with_position_ids`. INVALID_ARGUMENT naming the field, its value and
// what the batch needs when `fixed` does not hold the batch; sizes are
// checked for overflow; RESOURCE_EXHAUSTED for more rows than max_rows.
absl::StatusOr<Layout> MakeLayout(const std::vector<int64_t>& starts,
                                  const LayoutOptions& options,
                                  bool with_position_ids = true);

}  // namespace packd

#endif  // PACKD_KERNELS_LAYOUT_H_
