// Shared prompts (docs/design.md §14) as a gather plan. GRPO groups are
// packed with their prompt once: the stream is, group by group in the order
// of their first rows, the prompt (taken from the group's first row), then
// each member's response. Its attention metadata says which stream rows each
// segment's queries and keys are, and its targets which stream row's output
// predicts each predicted token. The plan is a Layout (kernels/layout.h):
// `source` holds the stream rows' packed tokens and `shifted_source` the
// targets', so every backend gathers it as it gathers any layout.
//
// clang-format off
//   PACKD_RETURN_IF_ERROR(ValidateSharedPrefix(options.layout, B, inputs.size(), false, true));
//   PACKD_ASSIGN_OR_RETURN(Layout stream, MakeSharedLayout(plan.cu_seqlens, options.layout, true));
// clang-format on
#ifndef PACKD_KERNELS_SHARED_PREFIX_H_
#define PACKD_KERNELS_SHARED_PREFIX_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/layout_options.h"
#include "kernels/layout.h"

namespace packd {

// INVALID_ARGUMENT naming the field, and the row, for what is wrong before the
// mask is scanned: groups or prefix_lengths of another length than
// `batch_rows`; a negative prefix length; members of a group with different
// prefix lengths; a same_inputs entry naming no input; shared_prefix with
// segment ids (`documents`), pad_multiple > 1, cp_size > 1, sp_size > 1 or
// fixed (not defined); targets in a Pack (`for_pack`). OK without one.
absl::Status ValidateSharedPrefix(const LayoutOptions& options,
                                  int64_t batch_rows, size_t inputs,
                                  bool documents, bool for_pack);

// The stream of rows whose active tokens are packed tokens
// cu_seqlens[b] .. cu_seqlens[b + 1], for options.shared_prefix (which
// passed ValidateSharedPrefix): `source` and (with_position_ids)
// `position_ids` per stream row, `seq_idx` (each row's group index) with
// options.with_seq_idx, `shifted_source` per target, cu_seqlens and
// max_seqlen the segments' (cu_seqlens_q, max_seqlen_q), and `shared` set.
// INVALID_ARGUMENT naming the row when a prompt is longer than a member's
// active tokens; RESOURCE_EXHAUSTED for more rows or keys than max_rows.
absl::StatusOr<Layout> MakeSharedLayout(const std::vector<int64_t>& cu_seqlens,
                                        const LayoutOptions& options,
                                        bool with_position_ids);

// INVALID_ARGUMENT naming the group, the row and the first position that
// differs when a member's prompt differs from its group's first row's in
// input `input`, given rows of that input (`row_bytes` each, in host memory)
// where row b's prompt starts at row starts[b] (x[mask] and the first B
// entries of cu_seqlens, or the prompts alone). For prompts that passed
// MakeSharedLayout.
absl::Status CheckSamePrompts(const SharedPrefix& shared,
                              const std::vector<int64_t>& starts, int input,
                              const unsigned char* rows, int64_t row_bytes);

// Gathers the rows of `runs` (packed tokens, in order) into host memory at
// `out`, row_bytes each.
using GatherPromptsFn = absl::FunctionRef<absl::Status(
    absl::Span<const TokenRun> runs, unsigned char* out)>;

// The same check with each group's prompts gathered by `gather` (the rows'
// packed tokens from cu_seqlens[b] on): groups of two or more rows a few at
// a time, in parallel, so that no copy of the whole input is made. The
// first difference in group order is the one reported; an error of
// `gather` is returned as it is.
absl::Status CheckSamePromptsBy(const SharedPrefix& shared,
                                const std::vector<int64_t>& cu_seqlens,
                                int input, int64_t row_bytes,
                                GatherPromptsFn gather);

}  // namespace packd

#endif  // PACKD_KERNELS_SHARED_PREFIX_H_
