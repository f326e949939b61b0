// The one way rows of a [B, S, ...] tensor are gathered up to each row's
// extent (one past its last active position): what a host Pack reads of them
// (Backend::Gather reads active positions only). The request decoder gathers
// split inline tensors so, the step each micro-batch's rows.
//
// clang-format off
//   GatherRowPrefixes(rows.size(), [&](int64_t j) { return rows[j]; }, &extents, row_bytes,
//                     position_bytes, dst,
//                     [&](int64_t from, int64_t n, char* to) { std::memcpy(to, src + from, n); });
// clang-format on
#ifndef PACKD_SERVICE_ROW_PREFIXES_H_
#define PACKD_SERVICE_ROW_PREFIXES_H_

#include <cstdint>
#include <vector>

namespace packd {

// Row j < `count` of `dst` (row_bytes each) gets source row b = row_of(j)'s
// first extents[b] positions (position_bytes each), or all of it when
// `extents` is null, by read(source offset, bytes, destination); the rest of
// each destination row is left as it was.
template <typename RowOf, typename Read>
void GatherRowPrefixes(int64_t count, RowOf row_of,
                       const std::vector<int64_t>* extents, int64_t row_bytes,
                       int64_t position_bytes, char* dst, Read read) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t b = row_of(j);
    const int64_t n =
        extents != nullptr ? (*extents)[b] * position_bytes : row_bytes;
    read(b * row_bytes, n, dst + j * row_bytes);
  }
}

}  // namespace packd

#endif  // PACKD_SERVICE_ROW_PREFIXES_H_
