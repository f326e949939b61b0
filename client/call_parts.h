// A call of the C++ client in parts (client/client.cc): a large batch sent as
// row ranges on several connections at once, and the parts' results joined
// into the whole batch's. Not API: client.h is. Free functions of their
// arguments: safe from any thread.
//
//   PACKD_ASSIGN_OR_RETURN(std::vector<Part> parts, InParts<Part>(n, call));
//   v1::PackResponse whole = JoinPackResponses(responses, first_rows);
#ifndef PACKD_CLIENT_CALL_PARTS_H_
#define PACKD_CLIENT_CALL_PARTS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <future>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "packd/v1/pack_service.pb.h"
#include "proto/wire.h"

namespace packd::client_internal {

// A tensor header's shape.
inline std::vector<int64_t> ShapeOf(const v1::Tensor& t) {
  return std::vector<int64_t>(t.shape().begin(), t.shape().end());
}

// Runs call(k) for every part k in [0, parts) at once (the last in this
// thread): the parts in order, or the first failure.
template <typename Part>
absl::StatusOr<std::vector<Part>> InParts(
    int parts, const std::function<absl::StatusOr<Part>(int)>& call) {
  std::vector<std::future<absl::StatusOr<Part>>> others;
  for (int k = 0; k + 1 < parts; ++k) {
    others.push_back(std::async(std::launch::async, call, k));
  }
  absl::StatusOr<Part> last = call(parts - 1);
  std::vector<Part> out;
  absl::Status status;
  for (auto& other : others) {
    absl::StatusOr<Part> part = other.get();
    if (part.ok()) {
      out.push_back(*std::move(part));
    } else {
      status.Update(part.status());
    }
  }
  status.Update(last.status());
  PACKD_RETURN_IF_ERROR(status);
  out.push_back(*std::move(last));
  return out;
}

// The first row of part k of `parts` over `rows` rows.
inline int64_t FirstRow(int64_t rows, int parts, int k) {
  return rows * k / parts;
}

// An uninitialised tensor in pooled memory that stays mapped (HostBufferPool,
// base/buffer.h): results of large calls, written once, without the page
// faults of fresh memory.
at::Tensor PooledEmpty(at::IntArrayRef shape, at::TensorOptions options);

// Rows [begin, begin + n) of each [B, ...] tensor; undefined stays undefined.
at::Tensor Rows(const at::Tensor& t, int64_t begin, int64_t n);
std::vector<at::Tensor> Rows(const std::vector<at::Tensor>& tensors,
                             int64_t begin, int64_t n);

// Whether every tensor, and the segment ids if given, is [B, S, ...] like the
// [B, S] mask with B >= 2: then the halves of the rows are two batches whose
// results, joined, are the whole batch's.
bool SplitsByRows(const std::vector<at::Tensor>& tensors,
                  const at::Tensor& mask, const at::Tensor& segment_ids);

// The response of a whole batch from those of its row ranges, which start at
// rows `first_rows`: offsets, maxima and row numbers joined. The packed
// tensors are joined separately.
v1::PackResponse JoinPackResponses(
    const std::vector<const v1::PackResponse*>& parts,
    const std::vector<int64_t>& first_rows);

// One tensor from the results of each part (same dtype and trailing dims),
// joined along dim 0 with one copy out of the received bytes.
absl::StatusOr<at::Tensor> JoinRows(const std::vector<const v1::Tensor*>& heads,
                                    const std::vector<Payload>& payloads);

}  // namespace packd::client_internal

#endif  // PACKD_CLIENT_CALL_PARTS_H_
