// The sizes of a Pack, computed once from its inputs' headers (dtype and
// shape: no data is needed) and its options, for whoever must know them
// before the op runs: the server's admission (the bytes a call's inline
// results take), a step's check of each micro-batch's message, and the bound
// a message limit puts on a layout's rows. One struct; nothing else computes
// them.
//
// clang-format off
//   const PackSizes sizes = PackSizes::Of(inputs, options.layout, {options.with_position_ids});
//   const int64_t bytes = sizes.ResultBytes(sizes.MaxRows(active, sequences));
// clang-format on
#ifndef PACKD_KERNELS_PACK_SIZES_H_
#define PACKD_KERNELS_PACK_SIZES_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "base/layout_options.h"
#include "base/tensor_view.h"

namespace packd {

// a * b and a + b for a, b >= 0, INT64_MAX when they overflow.
int64_t SaturatingMul(int64_t a, int64_t b);
int64_t SaturatingAdd(int64_t a, int64_t b);

// Bytes of one [B, S] position of x ([B, S, *tail]): its item size times its
// tail (the item size for a tensor of rank 2 or less).
int64_t PositionBytes(const TensorView& x);

// What a step gathers in host memory for rows of a [B, S] batch: each row's
// S positions of the mask, the segment ids and each input in host memory
// (inputs on a device are gathered there).
struct HostGather {
  // `segment_ids` null: none.
  static HostGather Of(const TensorView& mask, const TensorView* segment_ids,
                       absl::Span<const TensorView> inputs);
  // The bytes `rows` rows take gathered; saturating.
  int64_t Bytes(int64_t rows) const { return SaturatingMul(rows, row_bytes); }
  int64_t row_bytes = 0;
};

// The most entries (a layout's output rows, entries of its prefix arrays, a
// plan's micro-batches) that a response of `max_message_bytes` can hold: each
// costs it at least 8 bytes.
inline int64_t MaxEntriesPerMessage(int64_t max_message_bytes) {
  return max_message_bytes / 8;
}

// A response's bytes per batch row besides its tensors: cu_seqlens and
// last_index, varints of up to 10 bytes each. What a mask's rows cost a
// response (and a plan) before any token: the bound on B a message limit sets.
inline constexpr int64_t kMetadataBytesPerBatchRow = 20;

// What a batch of `batch_rows` rows costs a response before any token
// (kMetadataBytesPerBatchRow per row and one more for cu_seqlens' leading 0):
// reserved out of the message limit while its results are placed.
inline int64_t BatchMetadataBytes(int64_t batch_rows) {
  return kMetadataBytesPerBatchRow * (batch_rows + 1);
}

// The most rows a [B, S] mask may have under `max_message_bytes`: each costs
// the response kMetadataBytesPerBatchRow before any token.
inline int64_t MaxBatchRows(int64_t max_message_bytes) {
  return max_message_bytes / kMetadataBytesPerBatchRow;
}

// A Scatter's result bytes: each packed tensor ([N, *tail]) scattered over
// `positions` positions (B * S), a row of its tail at each.
int64_t ScatterResultBytes(absl::Span<const TensorView> packed,
                           int64_t positions);

// The per-row metadata a Pack is asked for besides its layout's seq_idx.
struct RowMetadata {
  bool position_ids = false;
  bool token_mask = false;
  bool mrope = false;
};

// Plain values; safe to share across threads.
struct PackSizes {
  // Result bytes of one output row: each input's row, then each shift's
  // input's row again (its shifted copy): row_bytes, the sum of the two.
  int64_t row_bytes = 0;
  int64_t input_row_bytes = 0;
  int64_t shift_row_bytes = 0;
  // Each result's bytes of one output row: each input's, then each shift's
  // (0 for a shift naming no input).
  std::vector<int64_t> result_row_bytes;
  // Result bytes over every input and shift when each holds all its
  // positions (what bounds a Pack without a layout whose mask is unknown).
  int64_t input_bytes = 0;
  // Response bytes per output row besides the tensors, when asked for:
  // position ids and seq_idx, each a varint of up to 10 bytes; mrope's three
  // more; the token mask's byte.
  int64_t metadata_bytes_per_row = 0;
  // What bounds the rows: the layout's pad multiple (>= 1), fixed.tokens.
  int64_t pad_multiple = 1;
  int64_t fixed_tokens = 0;
  // The CP and SP sizes (>= 1): how many ranks share a batch's rows.
  int64_t cp_size = 1;
  int64_t sp_size = 1;

  // The sizes of a Pack of inputs with these headers (unchecked: a shift
  // naming no input adds nothing; Pack refuses it later).
  static PackSizes Of(absl::Span<const TensorView> inputs,
                      const LayoutOptions& layout, const RowMetadata& metadata);

  // The most output rows a Pack has for `active` packed tokens in at most
  // `sequences` sequences (rows, or with documents at most `active`):
  // `active` without padding, each sequence padded by at most
  // pad_multiple - 1 rows, fixed.tokens when that is more (a CP or SP rank
  // holds a share of these, the SP ghost pads to fewer than the unpadded
  // sequences would). -1 when `active` is -1 (not known).
  int64_t MaxRows(int64_t active, int64_t sequences) const;
  // The rows a sequence of `length` tokens takes, padded to pad_multiple.
  // Both saturate at int64's end (a pad_multiple or sp_size near it is the
  // caller's to refuse, as the planner refuses sums past 2^53).
  int64_t PaddedRows(int64_t length) const {
    const int64_t blocks =
        length / pad_multiple + (length % pad_multiple != 0 ? 1 : 0);
    return SaturatingMul(blocks, pad_multiple);
  }
  // One CP or SP rank's share of `rows` padded rows: what one GPU holds of
  // them (a CP rank 1 / cp_size of every sequence's, which pad_multiple
  // divides; an SP rank 1 / sp_size of the stream, rounded up).
  int64_t RankRows(int64_t rows) const {
    const int64_t share = rows / cp_size;
    return share / sp_size + (share % sp_size != 0 ? 1 : 0);
  }
  // The results' bytes for `rows` output rows; input_bytes for -1. With a
  // shared stream, whose shifted results have a row per target: `rows` stream
  // rows and `shifted_rows` targets.
  int64_t ResultBytes(int64_t rows) const;
  int64_t ResultBytes(int64_t rows, int64_t shifted_rows) const;
  // Result r's bytes (ResultBytes' r-th tensor) for `rows` of its rows.
  int64_t ResultTensorBytes(size_t r, int64_t rows) const {
    return SaturatingMul(rows, result_row_bytes[r]);
  }
  // A response's bytes besides its tensors for `rows` output rows of a batch
  // of `batch_rows` rows and `sequences` sequences, at most: prefix arrays,
  // last_index, position ids and seq_idx, as varints of up to 10 bytes each
  // (and the rest of the message within a fixed 64).
  int64_t MetadataBytes(int64_t rows, int64_t batch_rows,
                        int64_t sequences) const;
  // A whole message of a Pack's results inline, at most: ResultBytes(rows,
  // shifted_rows) and MetadataBytes, with `entries` more varints of up to 10
  // bytes (a shared stream's per-segment arrays: keys, targets, segments).
  int64_t MessageBytes(int64_t rows, int64_t shifted_rows, int64_t batch_rows,
                       int64_t sequences, int64_t entries) const;
};

}  // namespace packd

#endif  // PACKD_KERNELS_PACK_SIZES_H_
