#include "kernels/pack_sizes.h"

#include <algorithm>
#include <limits>

namespace packd {

int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t out = 0;
  return CheckedMul(a, b, &out) ? out : std::numeric_limits<int64_t>::max();
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  return CheckedAdd(a, b, &out) ? out : std::numeric_limits<int64_t>::max();
}

int64_t PositionBytes(const TensorView& x) {
  int64_t bytes = ItemSize(x.dtype);
  for (size_t d = 2; d < x.shape.size(); ++d) {
    bytes = SaturatingMul(bytes, std::max<int64_t>(x.shape[d], 0));
  }
  return bytes;
}

HostGather HostGather::Of(const TensorView& mask, const TensorView* segment_ids,
                          absl::Span<const TensorView> inputs) {
  int64_t position = ItemSize(mask.dtype);
  if (segment_ids != nullptr) {
    position = SaturatingAdd(position, ItemSize(segment_ids->dtype));
  }
  for (const TensorView& x : inputs) {
    if (x.device.kind == DeviceKind::kCpu) {
      position = SaturatingAdd(position, PositionBytes(x));
    }
  }
  const int64_t seq = mask.shape.size() >= 2 ? mask.shape[1] : 0;
  return HostGather{SaturatingMul(std::max<int64_t>(seq, 0), position)};
}

int64_t ScatterResultBytes(absl::Span<const TensorView> packed,
                           int64_t positions) {
  int64_t bytes = 0;
  for (const TensorView& t : packed) {
    int64_t row = ItemSize(t.dtype);
    for (size_t d = 1; d < t.shape.size(); ++d) {
      row = SaturatingMul(row, std::max<int64_t>(t.shape[d], 0));
    }
    // A tensor of no rows still scatters into B * S zeroed positions.
    if (t.shape.empty()) continue;
    bytes = SaturatingAdd(bytes, SaturatingMul(positions, row));
  }
  return bytes;
}

PackSizes PackSizes::Of(absl::Span<const TensorView> inputs,
                        const LayoutOptions& layout,
                        const RowMetadata& metadata) {
  PackSizes sizes;
  auto add = [&](const TensorView& x, int64_t* row) {
    *row = SaturatingAdd(*row, PositionBytes(x));
    sizes.result_row_bytes.push_back(PositionBytes(x));
    int64_t bytes = ItemSize(x.dtype);
    for (int64_t d : x.shape) {
      bytes = SaturatingMul(bytes, std::max<int64_t>(d, 0));
    }
    sizes.input_bytes = SaturatingAdd(sizes.input_bytes, bytes);
  };
  for (const TensorView& x : inputs) add(x, &sizes.input_row_bytes);
  for (const Shift& shift : layout.shifts) {
    if (shift.input >= 0 && static_cast<size_t>(shift.input) < inputs.size()) {
      add(inputs[shift.input], &sizes.shift_row_bytes);
    } else {
      sizes.result_row_bytes.push_back(0);
    }
  }
  sizes.row_bytes = SaturatingAdd(sizes.input_row_bytes, sizes.shift_row_bytes);
  if (metadata.position_ids) sizes.metadata_bytes_per_row += 10;
  if (metadata.mrope) sizes.metadata_bytes_per_row += 30;
  if (metadata.token_mask) sizes.metadata_bytes_per_row += 1;
  if (layout.with_seq_idx) sizes.metadata_bytes_per_row += 10;
  sizes.pad_multiple = std::max<int64_t>(layout.pad_multiple, 1);
  sizes.fixed_tokens = std::max<int64_t>(layout.fixed.tokens, 0);
  sizes.cp_size = std::max<int64_t>(layout.cp_size, 1);
  sizes.sp_size = std::max<int64_t>(layout.sp_size, 1);
  return sizes;
}

int64_t PackSizes::MaxRows(int64_t active, int64_t sequences) const {
  if (active < 0) return -1;
  if (fixed_tokens > 0) return std::max(fixed_tokens, active);
  return SaturatingAdd(
      active, SaturatingMul(pad_multiple - 1, std::max<int64_t>(sequences, 0)));
}

int64_t PackSizes::ResultBytes(int64_t rows) const {
  return rows < 0 ? input_bytes : SaturatingMul(rows, row_bytes);
}

int64_t PackSizes::ResultBytes(int64_t rows, int64_t shifted_rows) const {
  if (rows < 0 || shifted_rows < 0) return input_bytes;
  return SaturatingAdd(SaturatingMul(rows, input_row_bytes),
                       SaturatingMul(shifted_rows, shift_row_bytes));
}

int64_t PackSizes::MetadataBytes(int64_t rows, int64_t batch_rows,
                                 int64_t sequences) const {
  return SaturatingAdd(
      SaturatingAdd(64, SaturatingMul(rows, metadata_bytes_per_row)),
      SaturatingAdd(SaturatingMul(kMetadataBytesPerBatchRow,
                                  SaturatingAdd(batch_rows, 1)),
                    SaturatingMul(40, SaturatingAdd(sequences, 1))));
}

int64_t PackSizes::MessageBytes(int64_t rows, int64_t shifted_rows,
                                int64_t batch_rows, int64_t sequences,
                                int64_t entries) const {
  return SaturatingAdd(ResultBytes(rows, shifted_rows),
                       SaturatingAdd(MetadataBytes(rows, batch_rows, sequences),
                                     SaturatingMul(10, entries)));
}

}  // namespace packd
