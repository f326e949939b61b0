// Multimodal rotary positions (docs/design.md §17) and the token mask: the
// per-row metadata a Pack derives from its tokens. A vision-language family's
// position ids are [3, rows] (temporal, height, width): a text token takes one
// position in all three; a run of image (video) tokens is the next grid,
// laid out t x (h / m) x (w / m) from the sequence's next position, and the
// text after it continues from there plus max(h, w) / m, as transformers'
// get_rope_index computes them for Qwen2-VL, Qwen2.5-VL and Qwen3-VL. Each
// sequence (a row, or a document) starts at 0.
//
// clang-format off
//   PACKD_RETURN_IF_ERROR(ValidateMRope(options.mrope, inputs.size()));
//   PACKD_ASSIGN_OR_RETURN(std::vector<int64_t> dense, MRopePositions(ids, starts, plan.cu_seqlens, options.mrope));
//   result.mrope_position_ids = LayOutMRope(dense, layout.source_runs, layout.position_ids);
// clang-format on
#ifndef PACKD_KERNELS_MROPE_H_
#define PACKD_KERNELS_MROPE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/layout_options.h"
#include "base/mrope_options.h"

namespace packd {

// INVALID_ARGUMENT naming the field for what is wrong before a token is read:
// an input out of range, spatial_merge_size < 1, a grid dimension < 1, equal
// image and video token ids, a negative or non-finite tokens_per_second or
// seconds_per_grid entry.
absl::Status ValidateMRope(const MRopeOptions& options, size_t inputs);

// The positions of packed tokens with ids `ids` (packed order), sequences
// starts[k] .. starts[k + 1]: [3 * ids.size()], the temporal row, then the
// height row, then the width row. `row_starts` (the plan's cu_seqlens) names
// rows in errors. INVALID_ARGUMENT naming the grid and the row whose vision
// tokens do not match (a run of other length than t * (h / m) * (w / m), one
// not after vision_start_token_id, more or fewer runs than grids, more or
// fewer videos than seconds_per_grid).
absl::StatusOr<std::vector<int64_t>> MRopePositions(
    absl::Span<const int64_t> ids, absl::Span<const int64_t> starts,
    absl::Span<const int64_t> row_starts, const MRopeOptions& options);

// How many grids (runs of vision tokens) and videos each row's sequences hold,
// as prefix arrays over the rows ([B + 1] each), for the same arguments as
// MRopePositions (which checks them): what a step hands each micro-batch.
struct GridsByRow {
  std::vector<int64_t> grids;
  std::vector<int64_t> videos;
};
GridsByRow VisionRunsByRow(absl::Span<const int64_t> ids,
                           absl::Span<const int64_t> starts,
                           absl::Span<const int64_t> row_starts,
                           const MRopeOptions& options);
// The options of rows `rows` of the batch, in that order, as a batch of
// their own: their grids and videos' seconds.
MRopeOptions MRopeOfRows(const MRopeOptions& options, const GridsByRow& by_row,
                         absl::Span<const int64_t> rows);

// Positions of packed tokens ([3 * total]) as a layout's rows ([3 * rows]):
// a row of token k takes token k's three; a pad or ghost row its
// position_ids entry in all three.
std::vector<int64_t> LayOutMRope(absl::Span<const int64_t> dense,
                                 absl::Span<const TokenRun> runs,
                                 absl::Span<const int64_t> position_ids);

// One byte per output row of `runs`: 1 for a token, 0 for padding.
std::string TokenMaskOf(absl::Span<const TokenRun> runs);

}  // namespace packd

#endif  // PACKD_KERNELS_MROPE_H_
