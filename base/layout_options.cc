#include "base/layout_options.h"

namespace packd {

absl::Status CheckScatterFields(const LayoutOptions& layout) {
  if (!layout.pad_values.empty() || !layout.shifts.empty() ||
      layout.with_seq_idx) {
    return absl::InvalidArgumentError(
        "Scatter takes the layout's pad_multiple, cp_size, cp_rank, sp_size, "
        "sp_rank, fixed and shared_prefix; pad_values, shifts and "
        "with_seq_idx are Pack's");
  }
  return absl::OkStatus();
}

LayoutOptions ScatterFields(LayoutOptions layout) {
  layout.pad_values.clear();
  layout.shifts.clear();
  layout.with_seq_idx = false;
  return layout;
}

}  // namespace packd
