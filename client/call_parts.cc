#include "client/call_parts.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/buffer.h"
#include "base/dtype.h"
#include "base/torch_interop.h"

namespace packd::client_internal {
namespace {

void AppendShifted(const google::protobuf::RepeatedField<int64_t>& from,
                   int skip, int64_t shift,
                   google::protobuf::RepeatedField<int64_t>* to) {
  for (int i = skip; i < from.size(); ++i) to->Add(from[i] + shift);
}

}  // namespace

at::Tensor PooledEmpty(at::IntArrayRef shape, at::TensorOptions options) {
  int64_t bytes = static_cast<int64_t>(options.dtype().itemsize());
  for (int64_t d : shape) bytes *= d;
  if (bytes < (int64_t{1} << 16)) return at::empty(shape, options);
  absl::StatusOr<Buffer> buffer =
      HostBufferPool::Global().Acquire(static_cast<size_t>(bytes));
  if (!buffer.ok()) return at::empty(shape, options);
  auto owner = std::make_shared<Buffer>(*std::move(buffer));
  void* data = owner->data();
  return at::from_blob(
      data, shape, [owner](void*) mutable { owner.reset(); }, options);
}

at::Tensor Rows(const at::Tensor& t, int64_t begin, int64_t n) {
  return t.defined() ? t.narrow(0, begin, n) : t;
}
std::vector<at::Tensor> Rows(const std::vector<at::Tensor>& tensors,
                             int64_t begin, int64_t n) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) out.push_back(Rows(t, begin, n));
  return out;
}

bool SplitsByRows(const std::vector<at::Tensor>& tensors,
                  const at::Tensor& mask, const at::Tensor& segment_ids) {
  if (mask.dim() != 2 || mask.size(0) < 2) return false;
  std::vector<at::Tensor> all = tensors;
  if (segment_ids.defined()) all.push_back(segment_ids);
  for (const at::Tensor& t : all) {
    if (t.dim() < 2 || t.size(0) != mask.size(0) || t.size(1) != mask.size(1)) {
      return false;
    }
  }
  return true;
}

v1::PackResponse JoinPackResponses(
    const std::vector<const v1::PackResponse*>& parts,
    const std::vector<int64_t>& first_rows) {
  v1::PackResponse out;
  for (size_t k = 0; k < parts.size(); ++k) {
    const v1::PackResponse& part = *parts[k];
    const int64_t tokens = out.total_active();
    AppendShifted(part.cu_seqlens(), out.cu_seqlens_size() > 0 ? 1 : 0, tokens,
                  out.mutable_cu_seqlens());
    AppendShifted(part.doc_cu_seqlens(), out.doc_cu_seqlens_size() > 0 ? 1 : 0,
                  tokens, out.mutable_doc_cu_seqlens());
    AppendShifted(part.position_ids(), 0, 0, out.mutable_position_ids());
    AppendShifted(part.last_index(), 0, 0, out.mutable_last_index());
    AppendShifted(part.doc_row(), 0, first_rows[k], out.mutable_doc_row());
    AppendShifted(part.doc_last_index(), 0, 0, out.mutable_doc_last_index());
    out.set_total_active(tokens + part.total_active());
    out.set_max_seqlen(std::max(out.max_seqlen(), part.max_seqlen()));
    out.set_doc_max_seqlen(
        std::max(out.doc_max_seqlen(), part.doc_max_seqlen()));
  }
  return out;
}

absl::StatusOr<at::Tensor> JoinRows(const std::vector<const v1::Tensor*>& heads,
                                    const std::vector<Payload>& payloads) {
  const v1::Tensor& first = *heads[0];
  const DType dtype = static_cast<DType>(first.dtype());
  if (!IsValidDType(dtype) || first.shape_size() == 0) {
    return absl::InternalError("server returned a result without rows");
  }
  std::vector<int64_t> shape = ShapeOf(first);
  shape[0] = 0;
  for (size_t k = 0; k < heads.size(); ++k) {
    const bool same =
        heads[k]->dtype() == first.dtype() &&
        heads[k]->shape_size() == first.shape_size() &&
        std::equal(heads[k]->shape().begin() + 1, heads[k]->shape().end(),
                   first.shape().begin() + 1);
    if (!same) {
      return absl::InternalError(absl::StrCat(
          "server returned parts that do not join: part ", k, " of ",
          heads.size(), " is dtype ", heads[k]->dtype(), " shape [",
          absl::StrJoin(heads[k]->shape(), ", "), "], part 0 dtype ",
          first.dtype(), " shape [", absl::StrJoin(first.shape(), ", "), "]"));
    }
    shape[0] += heads[k]->shape(0);
  }
  at::Tensor out =
      PooledEmpty(shape, at::TensorOptions().dtype(ToScalarType(dtype)));
  char* to = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = shape[0] > 0 ? out.nbytes() / shape[0] : 0;
  for (size_t k = 0; k < heads.size(); ++k) {
    const int64_t bytes = heads[k]->shape(0) * row_bytes;
    if (payloads[k].size != bytes) {
      return absl::InternalError("server returned a tensor of the wrong size");
    }
    payloads[k].CopyOut(0, bytes, to);
    to += bytes;
  }
  return out;
}

}  // namespace packd::client_internal
