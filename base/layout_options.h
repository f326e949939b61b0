// The options of a layout for parallel attention (docs/design.md §10): what
// a caller asks a Pack to lay its rows out as (padding, context-parallel or
// Ulysses slices, fixed shapes, shifts, seq_idx, a stream of shared prompts:
// §14), and a shared stream's metadata. Plain data, shared by the clients, the
// codec and the op library, which does the arithmetic (kernels/layout.h,
// kernels/shared_prefix.h).
//
//   LayoutOptions layout;
//   layout.pad_multiple = 8; layout.cp_size = 2; layout.cp_rank = rank;
#ifndef PACKD_BASE_LAYOUT_OPTIONS_H_
#define PACKD_BASE_LAYOUT_OPTIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace packd {

// Shapes for CUDA graphs; each 0 = not fixed.
struct FixedLayout {
  int64_t tokens = 0;      // T: output rows, a trailing ghost taking the rest
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

// Shared prompts (docs/design.md §14): GRPO groups packed with their prompt
// once. Rows with equal `groups` share the prompt, the first
// prefix_lengths[b] active positions of the group's first row; each member's
// response is its active positions after those.
struct SharedPrefix {
  std::vector<int64_t> groups;  // [B]: rows with equal ids share a prompt
  std::vector<int64_t> prefix_lengths;  // [B]: each row's prompt length
  std::vector<int32_t> same_inputs;     // inputs whose prompt rows must agree
  bool targets = false;  // Scatter only: packed holds targets, not the stream
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
  // The stream of shared prompts (§14) instead of the rows: with it, shifts
  // are in target space and with_seq_idx gives each row's group.
  std::optional<SharedPrefix> shared_prefix;
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
           !shifts.empty() || shared_prefix.has_value();
  }
};

// A Scatter takes only the layout fields that place rows (pad_multiple,
// cp_size, cp_rank, sp_size, sp_rank, fixed, shared_prefix); pad_values,
// shifts and with_seq_idx are Pack's. The one statement of that rule:
// INVALID_ARGUMENT, saying so, when `layout` sets one of Pack's.
absl::Status CheckScatterFields(const LayoutOptions& layout);
// `layout` less Pack's own fields: what the Scatter of its result takes.
LayoutOptions ScatterFields(LayoutOptions layout);

// An allocator whose vectors grow without zeroing their new elements: for
// arrays filled right after, in parallel (a shared stream's kv_index is
// megabytes, and zeroing it first would double what is written).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using IndexArray = std::vector<int64_t, DefaultInitAllocator<int64_t>>;

// A run of a layout's output rows: `count` rows holding the packed tokens
// token, token + 1, ..., or `count` pad rows when token is -1. A layout as
// runs (a shared stream: one per segment) is gathered with one copy per run
// instead of a read of one int64 per row.
struct TokenRun {
  int64_t token = 0;
  int64_t count = 0;
};

// A stream of shared prompts' attention metadata and targets (docs/design.md
// §14): segment n's queries are stream rows cu_seqlens_q[n] ..
// cu_seqlens_q[n + 1], its keys the stream rows kv_index[cu_seqlens_k[n] ..
// cu_seqlens_k[n + 1]] (a prompt's own rows; a response's group prompt rows,
// then its own); segment_row[n] is its row (a prompt's: its group's first).
// Target t is predicted by stream row pred_index[t]; row b's targets are
// target_cu_seqlens[b] .. target_cu_seqlens[b + 1].
struct SharedLayout {
  std::vector<int64_t> cu_seqlens_q;
  std::vector<int64_t> cu_seqlens_k;
  IndexArray kv_index;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  IndexArray pred_index;
  std::vector<int64_t> target_cu_seqlens;
  std::vector<int64_t> segment_row;
};

}  // namespace packd

#endif  // PACKD_BASE_LAYOUT_OPTIONS_H_
