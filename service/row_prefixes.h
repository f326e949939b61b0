// The one way rows of a [B, S, ...] tensor are gathered up to each row's
// extent (one past its last active position): what a host Pack reads of them
// (Backend::Gather reads active positions only). The request decoder gathers
// split inline tensors so, the step each micro-batch's rows.
//
// clang-format off
//   GatherRowPrefixes(rows, &extents, row_bytes, position_bytes, dst,
//                     [&](int64_t from, int64_t n, char* to) { std::memcpy(to, src + from, n); });
// clang-format on
#ifndef PACKD_SERVICE_ROW_PREFIXES_H_
#define PACKD_SERVICE_ROW_PREFIXES_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace packd {

// Row j of `dst` (row_bytes each) gets source row rows[j]'s first
// extents[rows[j]] positions (position_bytes each), or all of it when
// `extents` is null, by read(source offset, bytes, destination); the rest of
// each destination row is left as it was.
template <typename Read>
void GatherRowPrefixes(absl::Span<const int64_t> rows,
                       const std::vector<int64_t>* extents, int64_t row_bytes,
                       int64_t position_bytes, char* dst, Read read) {
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t n =
        extents != nullptr ? (*extents)[rows[j]] * position_bytes : row_bytes;
    read(rows[j] * row_bytes, n, dst + static_cast<int64_t>(j) * row_bytes);
  }
}

}  // namespace packd

#endif  // PACKD_SERVICE_ROW_PREFIXES_H_
