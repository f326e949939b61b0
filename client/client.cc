#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/dtype.h"
#include "kernels/status_macros.h"
#include "kernels/torch/torch_interop.h"
#include "proto/address.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

std::vector<int64_t> ShapeOf(const v1::Tensor& t) {
  return std::vector<int64_t>(t.shape().begin(), t.shape().end());
}

// Adds one output slice per result size in `segment`, or none: returns false
// (and leaves `outputs` empty) when a size is unknown (0) or does not fit.
bool AddOutputSlices(
    SharedMemory& segment, const std::vector<int64_t>& sizes,
    google::protobuf::RepeatedPtrField<v1::RegionSlice>* outputs) {
  for (int64_t n : sizes) {
    char* p = n > 0 ? segment.Allocate(n) : nullptr;
    if (p == nullptr) {
      outputs->Clear();
      return false;
    }
    segment.Contains(p, n, outputs->Add());
  }
  return true;
}

// Shared-memory room a call needs, rounded up so that slightly larger batches
// reuse the segment: a quarter more, plus 1 MiB. (The Python client's rule is
// the same: python/packd/client.py, _scratch_for.)
int64_t ScratchBytes(int64_t bytes) { return bytes + bytes / 4 + (1 << 20); }

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError(
        "address is empty: give HOST:PORT or unix:PATH");
  }
  return std::unique_ptr<Client>(new Client(std::move(options)));
}

Client::Client(ClientOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments args;
  const int limit = static_cast<int>(
      std::min<int64_t>(options_.max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  channel_ = grpc::CreateCustomChannel(
      options_.address, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::PackService::NewStub(channel_);
}

Client::~Client() = default;

template <typename Rpc>
absl::Status Client::Call(Rpc&& rpc) {
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.deadline));
    const grpc::Status status = rpc(&context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        attempt >= options_.max_attempts) {
      return FromGrpcStatus(status);
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::StatusOr<v1::RegionSlice> DeviceSlice(const std::string& region,
                                            const void* allocation_base,
                                            const void* data, uint64_t bytes) {
  const auto base = reinterpret_cast<uintptr_t>(allocation_base);
  const auto at = reinterpret_cast<uintptr_t>(data);
  if (at < base) {
    return absl::InvalidArgumentError(
        "the tensor's data lies before the allocation's base");
  }
  v1::RegionSlice slice;
  slice.set_region(region);
  slice.set_offset(at - base);
  slice.set_byte_size(bytes);
  return slice;
}

absl::Status Client::RegisterDeviceMemory(const std::string& name,
                                          const std::string& ipc_handle,
                                          const std::string& device,
                                          uint64_t byte_size) {
  v1::RegisterDeviceRegionRequest request;
  request.set_name(name);
  request.set_ipc_handle(ipc_handle);
  request.set_device(device);
  request.set_byte_size(byte_size);
  v1::RegisterRegionResponse response;
  return Call([&](grpc::ClientContext* c) {
    return stub_->RegisterDeviceRegion(c, request, &response);
  });
}

absl::StatusOr<v1::PlanResponse> Client::PlanMicroBatches(
    const std::vector<int64_t>& lengths, int64_t max_tokens_per_micro_batch,
    int32_t num_ranks, int32_t micro_batch_multiple,
    const std::vector<int64_t>& loss_tokens) {
  v1::PlanRequest request;
  request.mutable_lengths()->Assign(lengths.begin(), lengths.end());
  request.mutable_loss_tokens()->Assign(loss_tokens.begin(), loss_tokens.end());
  request.set_max_tokens_per_micro_batch(max_tokens_per_micro_batch);
  request.set_num_ranks(num_ranks);
  request.set_micro_batch_multiple(micro_batch_multiple);
  v1::PlanResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->PlanMicroBatches(c, request, &response);
  }));
  return response;
}

absl::StatusOr<v1::ServerInfo> Client::Info() {
  v1::ServerInfo info;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->GetServerInfo(c, v1::GetServerInfoRequest(), &info);
  }));
  return info;
}

absl::StatusOr<std::string> Client::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return health->Check(c, request, &response);
  }));
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      response.status());
}

absl::StatusOr<std::unique_ptr<SharedMemory>> Client::CreateSharedMemory(
    int64_t bytes) {
  static std::atomic<int> counter{0};
  const int n = counter++;
  const std::string key =
      absl::StrCat(options_.shm_key_prefix, "_client_", getpid(), "_", n);
  const std::string region = absl::StrCat("client-", getpid(), "-", n);
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<SharedMemory> shm,
      SharedMemory::Create(key, region, bytes, [this, region] {
        {
          absl::MutexLock lock(&mu_);
          segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                         [&](SharedMemory* s) {
                                           return s->region() == region;
                                         }),
                          segments_.end());
        }
        v1::UnregisterRegionRequest request;
        request.set_name(region);
        v1::UnregisterRegionResponse response;
        Call([&](grpc::ClientContext* c) {
          return stub_->UnregisterRegion(c, request, &response);
        }).IgnoreError();
      }));
  v1::RegisterSystemRegionRequest request;
  request.set_name(region);
  request.set_key(key);
  request.set_byte_size(static_cast<uint64_t>(bytes));
  v1::RegisterRegionResponse response;
  absl::Status status = Call([&](grpc::ClientContext* c) {
    return stub_->RegisterSystemRegion(c, request, &response);
  });
  if (!status.ok()) {
    shm.reset();  // unlinks; the unregister it sends finds nothing, harmlessly
    return status;
  }
  absl::MutexLock lock(&mu_);
  segments_.push_back(shm.get());
  return shm;
}

absl::StatusOr<SharedMemory*> Client::ScratchFor(int64_t bytes) {
  if (options_.shared_memory_threshold_bytes <= 0 ||
      bytes < options_.shared_memory_threshold_bytes ||
      !IsNodeLocal(options_.address)) {
    return nullptr;
  }
  if (!server_allows_shm_.has_value()) {
    absl::StatusOr<v1::ServerInfo> info = Info();
    if (!info.ok()) return info.status();
    server_allows_shm_ = info->shared_memory_enabled();
  }
  if (!*server_allows_shm_) return nullptr;
  if (scratch_ == nullptr || scratch_->size() < bytes) {
    scratch_.reset();
    PACKD_ASSIGN_OR_RETURN(scratch_, CreateSharedMemory(ScratchBytes(bytes)));
  }
  scratch_->Reset();
  return scratch_.get();
}

absl::Status Client::EncodeTensor(const at::Tensor& t_in, SharedMemory* scratch,
                                  v1::Tensor* out) {
  const DType dtype = FromScalarType(t_in.scalar_type());
  if (dtype == DType::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", c10::toString(t_in.scalar_type()),
                     " is not one packd carries"));
  }
  if (!t_in.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensors must be in host memory, not on ", t_in.device().str()));
  }
  const at::Tensor t = t_in.contiguous();
  EncodeTensorHeader(dtype, t.sizes().vec(), out);
  const int64_t bytes = t.nbytes();
  {
    absl::MutexLock lock(&mu_);
    for (SharedMemory* s : segments_) {
      if (bytes > 0 &&
          s->Contains(t.data_ptr(), bytes, out->mutable_region())) {
        return absl::OkStatus();
      }
    }
  }
  if (scratch != nullptr && bytes > 0) {
    if (char* p = scratch->Allocate(bytes)) {
      std::memcpy(p, t.data_ptr(), bytes);
      scratch->Contains(p, bytes, out->mutable_region());
      return absl::OkStatus();
    }
  }
  out->set_data(static_cast<const char*>(t.data_ptr()), bytes);
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> Client::DecodeResult(const v1::Tensor& t,
                                                bool copy_out) {
  const DType dtype = static_cast<DType>(t.dtype());
  if (!IsValidDType(dtype)) {
    return absl::InternalError(
        absl::StrCat("server returned dtype ", t.dtype()));
  }
  const auto options = at::TensorOptions().dtype(ToScalarType(dtype));
  at::Tensor out;
  if (t.has_region()) {
    SharedMemory* segment = nullptr;
    {
      absl::MutexLock lock(&mu_);
      for (SharedMemory* s : segments_) {
        if (s->region() == t.region().region()) segment = s;
      }
    }
    if (segment == nullptr) {
      return absl::InternalError(absl::StrCat(
          "server wrote to unknown region \"", t.region().region(), "\""));
    }
    out = at::from_blob(segment->At(t.region().offset()), ShapeOf(t), options);
    return copy_out ? out.clone() : out;
  }
  out = at::empty(ShapeOf(t), options);
  if (static_cast<int64_t>(t.data().size()) != out.nbytes()) {
    return absl::InternalError("server returned a tensor of the wrong size");
  }
  if (out.nbytes() > 0) {
    std::memcpy(out.data_ptr(), t.data().data(), out.nbytes());
  }
  return out;
}

absl::StatusOr<PackedBatch> Client::Pack(const std::vector<at::Tensor>& tensors,
                                         const at::Tensor& mask,
                                         const PackCallOptions& options) {
  int64_t bytes = mask.nbytes();
  for (const at::Tensor& t : tensors)
    bytes += 2 * t.nbytes();  // inputs and, at most, results
  PACKD_ASSIGN_OR_RETURN(SharedMemory * scratch, options.results_in != nullptr
                                                     ? nullptr
                                                     : ScratchFor(bytes));
  v1::PackRequest request;
  request.set_device(options.device);
  request.set_with_position_ids(options.with_position_ids);
  PACKD_RETURN_IF_ERROR(EncodeTensor(mask, scratch, request.mutable_mask()));
  for (const at::Tensor& t : tensors) {
    PACKD_RETURN_IF_ERROR(EncodeTensor(t, scratch, request.add_inputs()));
  }
  if (options.segment_ids.defined()) {
    PACKD_RETURN_IF_ERROR(EncodeTensor(options.segment_ids, scratch,
                                       request.mutable_segment_ids()));
  }
  // Results into shared memory: room for the largest possible result (every row
  // active). The scratch segment is sized for that; a caller's segment may not
  // be.
  SharedMemory* results =
      options.results_in != nullptr ? options.results_in : scratch;
  std::vector<int64_t> result_sizes;
  for (const at::Tensor& t : tensors) result_sizes.push_back(t.nbytes());
  if (results != nullptr &&
      !AddOutputSlices(*results, result_sizes, request.mutable_outputs()) &&
      options.results_in != nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "results_in: segment \"", results->region(), "\" has ",
        results->size() - results->used(), " of ", results->size(),
        " bytes free, too few for the results (up to the inputs' size); "
        "Reset() it or give a larger one"));
  }
  v1::PackResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->Pack(c, request, &response);
  }));

  PackedBatch batch;
  for (const v1::Tensor& t : response.packed()) {
    PACKD_ASSIGN_OR_RETURN(
        at::Tensor p,
        DecodeResult(t, /*copy_out=*/options.results_in == nullptr));
    batch.packed.push_back(std::move(p));
  }
  auto long_tensor = [](const google::protobuf::RepeatedField<int64_t>& f) {
    at::Tensor t = at::empty({f.size()}, at::kLong);
    if (f.size() > 0)
      std::memcpy(t.data_ptr(), f.data(), f.size() * sizeof(int64_t));
    return t;
  };
  batch.cu_seqlens = long_tensor(response.cu_seqlens());
  if (options.cu_seqlens_int32)
    batch.cu_seqlens = batch.cu_seqlens.to(at::kInt);
  batch.total_active = response.total_active();
  batch.max_seqlen = response.max_seqlen();
  if (options.with_position_ids)
    batch.position_ids = long_tensor(response.position_ids());
  batch.last_index = long_tensor(response.last_index());
  if (options.segment_ids.defined()) {
    batch.doc_cu_seqlens = long_tensor(response.doc_cu_seqlens());
    if (options.cu_seqlens_int32) {
      batch.doc_cu_seqlens = batch.doc_cu_seqlens.to(at::kInt);
    }
    batch.doc_max_seqlen = response.doc_max_seqlen();
    batch.doc_row = long_tensor(response.doc_row());
    batch.doc_last_index = long_tensor(response.doc_last_index());
  }
  return batch;
}

absl::StatusOr<std::vector<at::Tensor>> Client::Scatter(
    const std::vector<at::Tensor>& packed, const at::Tensor& mask,
    const std::optional<std::vector<int64_t>>& tail_shape,
    const std::string& device) {
  // Each result is [B, S, *tail]: B * S rows of a packed row's bytes (unknown,
  // 0, when a tensor has no rows to measure).
  int64_t bytes = mask.nbytes();
  std::vector<int64_t> dense_sizes;
  for (const at::Tensor& t : packed) {
    const bool has_rows = t.dim() > 0 && t.size(0) > 0;
    dense_sizes.push_back(has_rows ? mask.numel() * (t.nbytes() / t.size(0))
                                   : 0);
    bytes += t.nbytes() + dense_sizes.back();
  }
  PACKD_ASSIGN_OR_RETURN(SharedMemory * scratch, ScratchFor(bytes));
  v1::ScatterRequest request;
  request.set_device(device);
  PACKD_RETURN_IF_ERROR(EncodeTensor(mask, scratch, request.mutable_mask()));
  for (const at::Tensor& t : packed) {
    PACKD_RETURN_IF_ERROR(EncodeTensor(t, scratch, request.add_packed()));
  }
  if (tail_shape.has_value()) {
    for (int64_t d : *tail_shape) request.mutable_tail_shape()->add_dims(d);
  }
  if (scratch != nullptr && mask.dim() == 2) {
    AddOutputSlices(*scratch, dense_sizes, request.mutable_outputs());
  }
  v1::ScatterResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->Scatter(c, request, &response);
  }));
  std::vector<at::Tensor> dense;
  for (const v1::Tensor& t : response.dense()) {
    PACKD_ASSIGN_OR_RETURN(at::Tensor d, DecodeResult(t, /*copy_out=*/true));
    dense.push_back(std::move(d));
  }
  return dense;
}

}  // namespace packd
