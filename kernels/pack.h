// Pack and Scatter: the packd operation (DESIGN.md §1). Pack gathers the active
// rows of each [B, S, *tail] input into [total_active, *tail] and describes the
// layout (cu_seqlens, max_seqlen, position_ids, last_index); Scatter puts
// packed rows back into a dense [B, S, *tail] with zeros at inactive positions
// (the unpack, and the backward pass of Pack).
//
//   PACKD_ASSIGN_OR_RETURN(PackResult r, Pack(mask, {hidden, token_ids}));
//   PACKD_ASSIGN_OR_RETURN(ScatterResult g, Scatter(mask, {r.packed[0].view}));
#ifndef PACKD_KERNELS_PACK_H_
#define PACKD_KERNELS_PACK_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/buffer.h"
#include "kernels/tensor_view.h"

namespace packd {

// A result tensor: `view` describes it; `storage` owns it when the library
// allocated it, and is empty when the result was written into a caller's
// output.
struct Tensor {
  TensorView view;
  Buffer storage;
};

// Where a caller wants result `index` (`bytes` bytes on the call's device)
// written, asked after the mask scan when result sizes are known. Returns a
// pointer to at least `bytes` bytes that stay valid until the call returns and
// overlap no input, or an error that the call then returns, having written
// nothing.
using OutputAllocator =
    std::function<absl::StatusOr<void*>(size_t index, int64_t bytes)>;

struct PackOptions {
  // Implementation name ("span", "torch", ...); empty selects the device's
  // default.
  std::string impl;
  // Also return position_ids.
  bool with_position_ids = false;
  // Empty: the library allocates each result. Otherwise exactly one view per
  // input, of shape [total_active, *tail] and the input's dtype and device,
  // overlapping no input and no other output; results are written there.
  absl::Span<const TensorView> outputs;
  // When set and `outputs` is empty, results go where it says; their
  // `storage` stays empty.
  OutputAllocator allocate;
};

struct PackResult {
  std::vector<Tensor> packed;       // packed[i] answers inputs[i]
  std::vector<int64_t> cu_seqlens;  // [B + 1]
  int64_t total_active = 0;
  int64_t max_seqlen = 0;             // 0 when B is 0
  std::vector<int64_t> position_ids;  // [total_active] when asked, else empty
  std::vector<int64_t> last_index;    // [B], -1 for an empty row
};

struct ScatterOptions {
  std::string impl;
  // When set, must equal every packed[i].shape[1:].
  std::optional<Shape> tail_shape;
  // Empty, or one [B, S, *tail] view per packed input (same rules as
  // PackOptions::outputs).
  absl::Span<const TensorView> outputs;
  OutputAllocator allocate;
};

struct ScatterResult {
  std::vector<Tensor> dense;  // dense[i] answers packed[i]
};

// Packs every input with one scan of `mask`. The device is the mask's; every
// tensor must be on it.
//
// Errors (nothing is written when one is returned):
//   INVALID_ARGUMENT: mask not of rank 2; no inputs; an input of rank < 2 or
//   whose shape does not
//     start with the mask's; an invalid dtype; a negative dim or a byte size
//     that overflows int64; a null data pointer for a non-empty tensor; a
//     tensor on another device; outputs of the wrong count, dtype, shape or
//     device, or overlapping an input or each other; an unknown op.
//   NOT_FOUND: options.impl names no implementation on that device.
//   FAILED_PRECONDITION: the device is not built in or not present.
//   RESOURCE_EXHAUSTED: the device cannot hold the results.
//   INTERNAL: a device runtime or libtorch failure, with its message.
absl::StatusOr<PackResult> Pack(const TensorView& mask,
                                absl::Span<const TensorView> inputs,
                                const PackOptions& options = {});

// Scatters every packed tensor ([total_active, *tail]) back to [B, S, *tail].
//
// Errors: as Pack, and INVALID_ARGUMENT when packed[i] has rank 0, when its row
// count differs from the mask's active count, or when tail_shape differs from
// packed[i].shape[1:].
absl::StatusOr<ScatterResult> Scatter(const TensorView& mask,
                                      absl::Span<const TensorView> packed,
                                      const ScatterOptions& options = {});

// The checks Pack and Scatter run before anything else (everything that does
// not need the mask's contents), for callers that must validate before they
// move data, such as the server staging tensors to a GPU. Same errors as Pack
// and Scatter.
absl::Status ValidatePackArgs(const TensorView& mask,
                              absl::Span<const TensorView> inputs);
absl::Status ValidateScatterArgs(const TensorView& mask,
                                 absl::Span<const TensorView> packed,
                                 const std::optional<Shape>& tail_shape);

}  // namespace packd

#endif  // PACKD_KERNELS_PACK_H_
