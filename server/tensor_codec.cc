#include "server/tensor_codec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace packd {

absl::StatusOr<TensorView> DecodeTensor(
    const v1::Tensor& tensor, absl::string_view field,
    const RegionRegistry* regions, std::vector<std::shared_ptr<Region>>* held) {
  TensorView view;
  view.dtype = static_cast<DType>(tensor.dtype());
  if (!IsValidDType(view.dtype)) {
    const std::string name = v1::DType_IsValid(tensor.dtype())
                                 ? v1::DType_Name(tensor.dtype())
                                 : absl::StrCat(tensor.dtype());
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype ", name, " is not a supported dtype"));
  }
  view.shape.assign(tensor.shape().begin(), tensor.shape().end());
  PACKD_ASSIGN_OR_RETURN(int64_t bytes,
                         ByteSize(view.dtype, view.shape, field));
  if (tensor.storage_case() == v1::Tensor::kRegion) {
    if (regions == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(field,
                       " is a region handle, but this call takes "
                       "only inline tensors"));
    }
    const std::string slice_field = absl::StrCat(field, ".region");
    PACKD_ASSIGN_OR_RETURN(ResolvedSlice slice,
                           regions->Resolve(tensor.region(), slice_field));
    if (slice.byte_size != static_cast<uint64_t>(bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(slice_field, " has ", slice.byte_size,
                       " bytes but shape ", ShapeString(view.shape), " of ",
                       DTypeName(view.dtype), " needs ", bytes));
    }
    view.data = slice.data;
    view.device = slice.region->device();
    held->push_back(std::move(slice.region));
    return view;
  }
  const std::string& data = tensor.data();
  if (static_cast<int64_t>(data.size()) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".data has ", data.size(), " bytes but shape ",
                     ShapeString(view.shape), " of ", DTypeName(view.dtype),
                     " needs ", bytes));
  }
  // The kernels only read inputs; the cast is the usual DLPack-style one.
  view.data = bytes == 0 ? nullptr : const_cast<char*>(data.data());
  return view;
}

void EncodeTensorHeader(const TensorView& view, v1::Tensor* out) {
  out->set_dtype(static_cast<v1::DType>(view.dtype));
  out->mutable_shape()->Assign(view.shape.begin(), view.shape.end());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

}  // namespace packd
