// Pack and Scatter: the packd operation (docs/design.md §1). Pack gathers the
// active rows of each [B, S, *tail] input into [total_active, *tail] and
// describes the layout (cu_seqlens, max_seqlen, position_ids, last_index);
// Scatter puts packed rows back into a dense [B, S, *tail] with zeros at
// inactive positions (the unpack, and the backward pass of Pack). Both run on
// one device and do all of a call's work there: validation first, then the
// tensors in host memory staged to the device, the mask scanned once, every
// tensor gathered or scattered, host-bound results copied back.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(PackResult r, Pack({hidden, token_ids}, mask));
//   PACKD_ASSIGN_OR_RETURN(ScatterResult g, Scatter({r.packed[0].view}, mask));
// clang-format on
#ifndef PACKD_KERNELS_PACK_H_
#define PACKD_KERNELS_PACK_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/buffer.h"
#include "base/mrope_options.h"
#include "base/tensor_view.h"
#include "kernels/layout.h"

namespace packd {

// A result tensor: `view` describes it; `storage` owns it when the library
// allocated it, and is empty when the result was written into a caller's
// output. A call's value, moved to its caller; not shared across threads.
struct ResultTensor {
  TensorView view;
  Buffer storage;
};

// Memory a caller gives for a result: `data` on `device` (host memory is
// Device::Cpu()). A plain value.
struct OutputPlace {
  void* data = nullptr;
  Device device;
};

// Where a caller wants result `index` (`bytes` bytes) written, asked after the
// mask scan when result sizes are known. Returns memory of at least `bytes`
// bytes, on the call's device or in host memory, that stays valid until the
// call returns and overlaps no input; or an error that the call then returns,
// having written nothing.
using OutputAllocator =
    std::function<absl::StatusOr<OutputPlace>(size_t index, int64_t bytes)>;

// Where a result will go and how many bytes it may take there, when both are
// known before the call's sizes are (a region slice of the caller's).
struct FixedPlace {
  OutputPlace place;
  int64_t capacity = 0;
};

// What Pack and Scatter share: where the call runs and where results go.
// Options are plain values, read by one call (`allocate` is called on its
// thread only).
struct CallOptions {
  // Implementation name ("span", "torch", ...); empty selects the device's
  // default.
  std::string impl;
  // The device the call runs on. Unset: the mask's device, and every tensor
  // must be there. Set to a GPU: tensors in host memory (inputs, mask, outputs)
  // are staged through the device; every other tensor must be on it.
  std::optional<Device> device;
  // Empty: results go where `allocate` says or, without it, into memory the
  // library allocates on the call's device. Otherwise exactly one view per
  // input, of the result's shape and the input's dtype, overlapping no input
  // and no other output; results are written there.
  absl::Span<const TensorView> outputs;
  // When set and `outputs` is empty, results go where it says; their `storage`
  // stays empty.
  OutputAllocator allocate;
  // With `allocate`: result i's place and room when they do not depend on its
  // size, the place `allocate` gives for any size that fits. A Pack without
  // layout, documents or mrope on a GPU whose every place is on the device,
  // overlaps nothing and holds all B * S rows of its input gathers in place
  // without waiting for its sizes (Backend::ScanAhead): one synchronisation
  // instead of two.
  std::function<FixedPlace(size_t index)> fixed_place;
};

struct PackOptions : CallOptions {
  // Also return position_ids.
  bool with_position_ids = false;
  // Documents within rows (docs/design.md §8): [B, S] of an integer dtype;
  // the active tokens of a row are cut into documents wherever it changes
  // from one active token to the next, and every row starts one. Inactive
  // positions are never read. When set, position_ids restart at every
  // document and the doc_* results are filled.
  std::optional<TensorView> segment_ids;
  // Layouts for parallel attention (docs/design.md §10): padding, CP slices,
  // fixed shapes, shifts, seq_idx. Sequences are the documents with
  // segment_ids, else the rows. With shifts, `outputs` (when given) holds one
  // view per input and then one per shift.
  LayoutOptions layout;
  // Also return token_mask: 1 for each output row holding a token, 0 for
  // padding and ghosts (docs/design.md §17).
  bool with_token_mask = false;
  // Multimodal rotary positions from the token ids in inputs[mrope->input]
  // (kernels/mrope.h): mrope_position_ids.
  std::optional<MRopeOptions> mrope;
};

// A call's results, owned by its caller; not shared across threads.
struct PackResult {
  std::vector<ResultTensor> packed;  // packed[i] answers inputs[i]
  std::vector<int64_t> cu_seqlens;   // [B + 1]
  int64_t total_active = 0;
  int64_t max_seqlen = 0;             // 0 when B is 0
  std::vector<int64_t> position_ids;  // [total_active] when asked, else empty
  std::vector<int64_t> last_index;    // [B], -1 for an empty row
  // With segment_ids (else empty, and doc_max_seqlen 0): documents in packed
  // order; document d is packed rows doc_cu_seqlens[d] .. doc_cu_seqlens[d+1].
  std::vector<int64_t> doc_cu_seqlens;  // [D + 1]
  int64_t doc_max_seqlen = 0;
  std::vector<int64_t> doc_row;         // [D]: the row of each document
  std::vector<int64_t> doc_last_index;  // [D]: dense s of its last token
  // With a layout (docs/design.md §10): packed and position_ids hold the
  // layout's rows, cu_seqlens (doc_cu_seqlens with documents) and the maxima
  // are extended for `fixed`, and these are set when it reshapes (padding, CP
  // or fixed) / asks for them.
  std::vector<int64_t> cu_seqlens_padded;
  int64_t max_seqlen_padded = 0;
  std::vector<int64_t> seq_idx;       // one per output row, with_seq_idx
  std::vector<ResultTensor> shifted;  // shifted[j] answers layout.shifts[j]
  // With layout.shared_prefix (docs/design.md §14): packed holds the stream
  // (total_active its rows, cu_seqlens and max_seqlen its segments'),
  // shifted[j] one row per target, and this the attention metadata.
  std::optional<SharedLayout> shared;
  // With with_token_mask: one byte per output row, 1 for a token, 0 for pad
  // and ghost rows.
  std::string token_mask;
  // With mrope: [3 * rows], the temporal, height and width rows in turn; a
  // pad or ghost row holds its position id in all three.
  std::vector<int64_t> mrope_position_ids;
};

struct ScatterOptions : CallOptions {
  // When set, must equal every packed[i].shape[1:].
  std::optional<Shape> tail_shape;
  // The layout of the Pack this is the gradient of (docs/design.md §10):
  // pad_multiple, cp_size / cp_rank, sp_size / sp_rank and fixed; packed[i]
  // holds its rows, and pad rows, ghost rows and other ranks' positions are
  // dropped. Documents are sequences when segment_ids is set.
  std::optional<TensorView> segment_ids;
  LayoutOptions layout;
};

// A call's results, owned by its caller; not shared across threads.
struct ScatterResult {
  std::vector<ResultTensor> dense;  // dense[i] answers packed[i]
};

// Packs every input with one scan of `mask`, on the call's device (see
// CallOptions::device). Safe to call from many threads at once: each call has
// its own plan, stream and results.
//
// Errors (nothing is written when one is returned):
//   INVALID_ARGUMENT: mask not of rank 2; segment_ids not of the mask's shape
//     or not of an integer dtype; no inputs; an input of rank < 2 or
//     whose shape does not start with the mask's; an invalid dtype; a negative
//     dim or a byte size that overflows int64; a null data pointer for a
//     non-empty tensor; a tensor (or an output place) on another device than
//     the call's; outputs of the wrong count, dtype or shape, overlapping an
//     input or each other.
//   NOT_FOUND: options.impl names no implementation on that device.
//   FAILED_PRECONDITION: the device is not built in or not present.
//   RESOURCE_EXHAUSTED: the device cannot hold the results or the staging.
//   INTERNAL: a device runtime or libtorch failure, with its message.
absl::StatusOr<PackResult> Pack(absl::Span<const TensorView> inputs,
                                const TensorView& mask,
                                const PackOptions& options = {});

// Scatters every packed tensor ([total_active, *tail]) back to [B, S, *tail].
//
// Errors: as Pack, and INVALID_ARGUMENT when packed[i] has rank 0, when its row
// count differs from the mask's active count, or when tail_shape differs from
// packed[i].shape[1:].
absl::StatusOr<ScatterResult> Scatter(absl::Span<const TensorView> packed,
                                      const TensorView& mask,
                                      const ScatterOptions& options = {});

// Pack's check of an input's shape, for callers that gather an input's rows
// before Pack sees it: INVALID_ARGUMENT unless `x` has rank >= 2 and its shape
// starts with the mask's [B, S]; the message names `field` and `mask_field`.
absl::Status CheckStartsWithMask(const TensorView& x, const TensorView& mask,
                                 absl::string_view field,
                                 absl::string_view mask_field = "mask");

}  // namespace packd

#endif  // PACKD_KERNELS_PACK_H_
