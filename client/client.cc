#include "client/client.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "base/torch_interop.h"
#include "client/call_parts.h"
#include "proto/grpc_wire.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

using client_internal::FirstRow;
using client_internal::InParts;
using client_internal::JoinPackResponses;
using client_internal::JoinRows;
using client_internal::PooledEmpty;
using client_internal::Rows;
using client_internal::ShapeOf;
using client_internal::SplitsByRows;

// Adds one output slice per result size in `segment`, or none: returns false
// (and leaves `outputs` empty) when a size is unknown (0) or does not fit.
// `regions` gains the segment's region when it is named.
bool AddOutputSlices(
    SharedMemory& segment, const std::vector<int64_t>& sizes,
    google::protobuf::RepeatedPtrField<v1::RegionSlice>* outputs,
    std::vector<std::string>* regions) {
  for (int64_t n : sizes) {
    char* p = n > 0 ? segment.Allocate(n) : nullptr;
    if (p == nullptr) {
      outputs->Clear();
      return false;
    }
    segment.Contains(p, n, outputs->Add());
  }
  if (!sizes.empty()) regions->push_back(segment.region());
  return true;
}

// A Pack's or a Scatter's tensors through `encode`: the mask, then each of
// `tensors` into `field` (inputs or packed), then the segment ids when
// defined.
template <typename Encode, typename Request, typename Outgoing>
absl::Status EncodeTensors(
    const Encode& encode, const at::Tensor& mask,
    const std::vector<at::Tensor>& tensors,
    google::protobuf::RepeatedPtrField<v1::Tensor>* field,
    const at::Tensor& segment_ids, Request* request, Outgoing* outgoing) {
  PACKD_RETURN_IF_ERROR(encode(mask, request->mutable_mask(), outgoing));
  for (const at::Tensor& t : tensors) {
    PACKD_RETURN_IF_ERROR(encode(t, field->Add(), outgoing));
  }
  if (segment_ids.defined()) {
    PACKD_RETURN_IF_ERROR(
        encode(segment_ids, request->mutable_segment_ids(), outgoing));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  PACKD_ASSIGN_OR_RETURN(std::unique_ptr<Connection> connection,
                         Connection::Open(std::move(options)));
  return std::unique_ptr<Client>(new Client(std::move(connection)));
}

Client::Client(std::unique_ptr<Connection> connection)
    : connection_(std::move(connection)),
      options_(connection_->options()),
      device_memory_(options_.device_memory != nullptr
                         ? options_.device_memory
                         : MakeCudaDeviceMemory()) {}

Client::~Client() {
  UnregisterFreed(/*all=*/true);
  // Closing a segment takes mu_ (to forget it) and unregisters it.
  std::vector<std::unique_ptr<SharedMemory>> idle;
  {
    absl::MutexLock lock(&mu_);
    idle.swap(idle_scratch_);
  }
}

absl::Status Client::RawCall(int connection, const char* method,
                             const Outgoing& outgoing, WireMessage* response) {
  absl::Status status =
      connection_->RawCall(connection, method, *outgoing.request, response);
  if (status.code() == absl::StatusCode::kNotFound) {
    // A region of ours may be gone (lease, restart): register, then again.
    absl::StatusOr<bool> missing = Reregister(outgoing.regions);
    if (missing.ok() && *missing) {
      status =
          connection_->RawCall(connection, method, *outgoing.request, response);
    }
  }
  return status;
}

absl::StatusOr<v1::PlanResponse> Client::PlanMicroBatches(
    const std::vector<int64_t>& lengths, int64_t max_tokens_per_micro_batch,
    int32_t num_ranks, int32_t micro_batch_multiple,
    const std::vector<int64_t>& loss_tokens) {
  PlanCallOptions options;
  options.num_ranks = num_ranks;
  options.micro_batch_multiple = micro_batch_multiple;
  options.loss_tokens = loss_tokens;
  return PlanMicroBatches(lengths, max_tokens_per_micro_batch, options);
}

PlanOptions PlanCallOptions::ForPlanner(
    int64_t max_tokens_per_micro_batch) const {
  PlanOptions options;
  options.max_tokens_per_micro_batch = max_tokens_per_micro_batch;
  options.num_ranks = num_ranks;
  options.micro_batch_multiple = micro_batch_multiple;
  options.cost_per_token = cost_per_token;
  options.cost_per_token_squared = cost_per_token_squared;
  options.costs = costs;
  options.groups = groups;
  options.pad_multiple = pad_multiple;
  options.pipeline_order = pipeline_order;
  return options;
}

absl::StatusOr<v1::PlanResponse> Client::PlanMicroBatches(
    const std::vector<int64_t>& lengths, int64_t max_tokens_per_micro_batch,
    const PlanCallOptions& options) {
  return connection_->Plan(
      PlanRequestOf(options.ForPlanner(max_tokens_per_micro_batch), lengths,
                    options.loss_tokens));
}

absl::Status Client::EncodeTensor(const at::Tensor& t_in, SharedMemory* scratch,
                                  v1::Tensor* out, Outgoing* outgoing) {
  const DType dtype = FromScalarType(t_in.scalar_type());
  if (dtype == DType::kUnspecified) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", c10::toString(t_in.scalar_type()),
                     " is not one packd carries"));
  }
  if (!t_in.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensors must be in host memory, not on ", t_in.device().str(),
        device_memory_ == nullptr && t_in.is_cuda()
            ? ": this client is built without CUDA (docs/gpu.md)"
            : ""));
  }
  const at::Tensor t = t_in.contiguous();
  EncodeTensorHeader(dtype, t.sizes().vec(), out);
  const int64_t bytes = t.nbytes();
  {
    absl::MutexLock lock(&mu_);
    for (SharedMemory* s : segments_) {
      if (bytes > 0 &&
          s->Contains(t.data_ptr(), bytes, out->mutable_region())) {
        outgoing->regions.push_back(s->region());
        return absl::OkStatus();
      }
    }
  }
  if (scratch != nullptr && bytes > 0) {
    if (char* p = scratch->Allocate(bytes)) {
      std::memcpy(p, t.data_ptr(), bytes);
      scratch->Contains(p, bytes, out->mutable_region());
      outgoing->regions.push_back(scratch->region());
      return absl::OkStatus();
    }
  }
  outgoing->request->Carry(
      *out, Payload::Of(t.data_ptr(), bytes, std::make_shared<at::Tensor>(t)));
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> Client::DecodeResult(const v1::Tensor& t,
                                                bool copy_out,
                                                const WireMessage& reply) {
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
  out = PooledEmpty(ShapeOf(t), options);
  const Payload payload = reply.BytesOf(t);
  if (payload.size != static_cast<int64_t>(out.nbytes())) {
    return absl::InternalError("server returned a tensor of the wrong size");
  }
  payload.CopyOut(0, payload.size, static_cast<char*>(out.data_ptr()));
  return out;
}

void Client::FillMetadata(const v1::PackResponse& response,
                          const PackCallOptions& options, PackedBatch* batch) {
  auto long_tensor = [](const google::protobuf::RepeatedField<int64_t>& f) {
    at::Tensor t = at::empty({f.size()}, at::kLong);
    if (f.size() > 0)
      std::memcpy(t.data_ptr(), f.data(), f.size() * sizeof(int64_t));
    return t;
  };
  batch->cu_seqlens = long_tensor(response.cu_seqlens());
  if (options.cu_seqlens_int32)
    batch->cu_seqlens = batch->cu_seqlens.to(at::kInt);
  batch->total_active = response.total_active();
  batch->max_seqlen = response.max_seqlen();
  if (options.with_position_ids)
    batch->position_ids = long_tensor(response.position_ids());
  batch->last_index = long_tensor(response.last_index());
  if (options.segment_ids.defined()) {
    batch->doc_cu_seqlens = long_tensor(response.doc_cu_seqlens());
    if (options.cu_seqlens_int32) {
      batch->doc_cu_seqlens = batch->doc_cu_seqlens.to(at::kInt);
    }
    batch->doc_max_seqlen = response.doc_max_seqlen();
    batch->doc_row = long_tensor(response.doc_row());
    batch->doc_last_index = long_tensor(response.doc_last_index());
  }
  if (response.cu_seqlens_padded_size() > 0) {
    batch->cu_seqlens_padded = long_tensor(response.cu_seqlens_padded());
    if (options.cu_seqlens_int32) {
      batch->cu_seqlens_padded = batch->cu_seqlens_padded.to(at::kInt);
    }
  }
  batch->max_seqlen_padded = response.max_seqlen_padded();
  if (options.layout.with_seq_idx) {
    batch->seq_idx = long_tensor(response.seq_idx());
  }
  if (options.with_token_mask) {
    const std::string& bytes = response.token_mask();
    batch->token_mask =
        at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    if (!bytes.empty()) {
      std::memcpy(batch->token_mask.data_ptr(), bytes.data(), bytes.size());
    }
  }
  if (options.mrope.has_value()) {
    batch->mrope_position_ids =
        long_tensor(response.mrope_position_ids()).view({3, -1});
  }
  if (response.has_shared()) {
    const v1::SharedLayout& s = response.shared();
    batch->shared = PackedBatch::Shared{long_tensor(s.cu_seqlens_q()),
                                        long_tensor(s.cu_seqlens_k()),
                                        long_tensor(s.kv_index()),
                                        s.max_seqlen_q(),
                                        s.max_seqlen_k(),
                                        long_tensor(s.pred_index()),
                                        long_tensor(s.target_cu_seqlens()),
                                        long_tensor(s.segment_row())};
  }
}

absl::StatusOr<std::vector<at::Tensor>> Client::Results(
    const std::vector<const Tensors*>& results,
    const std::vector<const WireMessage*>& replies, bool copy_out) {
  for (size_t k = 0; k < results.size(); ++k) {
    if (results[k]->size() != results[0]->size()) {
      return absl::InternalError(
          absl::StrCat("server returned parts that do not join: part ", k,
                       " of ", results.size(), " has ", results[k]->size(),
                       " results, part 0 has ", results[0]->size()));
    }
  }
  std::vector<at::Tensor> out;
  for (int i = 0; i < results[0]->size(); ++i) {
    if (results.size() == 1) {
      PACKD_ASSIGN_OR_RETURN(at::Tensor t, DecodeResult(results[0]->Get(i),
                                                        copy_out, *replies[0]));
      out.push_back(std::move(t));
      continue;
    }
    std::vector<const v1::Tensor*> heads;
    std::vector<Payload> payloads;
    for (size_t k = 0; k < results.size(); ++k) {
      heads.push_back(&results[k]->Get(i));
      payloads.push_back(replies[k]->BytesOf(*heads.back()));
    }
    PACKD_ASSIGN_OR_RETURN(at::Tensor t, JoinRows(heads, payloads));
    out.push_back(std::move(t));
  }
  return out;
}

// A part's reply: the response, its inline results in place.
struct Client::PackPart {
  Wire<v1::PackResponse> reply;
};

struct Client::ScatterPart {
  Wire<v1::ScatterResponse> reply;
};

int Client::Parts(int64_t bytes, bool through_shared_memory,
                  int64_t rows) const {
  if (through_shared_memory || options_.split_threshold_bytes <= 0 ||
      bytes < options_.split_threshold_bytes) {
    return 1;
  }
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(connection_->connections(), rows)));
}

absl::Status Client::EncodePack(const std::string& device,
                                const PackCallOptions& options,
                                const std::vector<at::Tensor>& tensors,
                                const at::Tensor& mask,
                                const at::Tensor& segment_ids,
                                const Encoder& encode, v1::PackRequest* request,
                                Outgoing* outgoing) {
  request->set_device(device);
  request->set_with_position_ids(options.with_position_ids);
  EncodeLayout(options.layout, request);
  request->set_with_token_mask(options.with_token_mask);
  if (options.mrope.has_value()) {
    EncodeMRope(*options.mrope, request->mutable_mrope());
  }
  return EncodeTensors(encode, mask, tensors, request->mutable_inputs(),
                       segment_ids, request, outgoing);
}

absl::Status Client::EncodeScatter(
    const std::string& device, const ScatterCallOptions& options,
    const std::vector<at::Tensor>& packed, const at::Tensor& mask,
    const at::Tensor& segment_ids, const Encoder& encode,
    v1::ScatterRequest* request, Outgoing* outgoing) {
  request->set_device(device);
  PACKD_RETURN_IF_ERROR(EncodeLayout(options.layout, request));
  PACKD_RETURN_IF_ERROR(EncodeTensors(encode, mask, packed,
                                      request->mutable_packed(), segment_ids,
                                      request, outgoing));
  if (options.tail_shape.has_value()) {
    for (int64_t d : *options.tail_shape) {
      request->mutable_tail_shape()->add_dims(d);
    }
  }
  return absl::OkStatus();
}

Client::Encoder Client::HostEncoder(SharedMemory* scratch) {
  return [this, scratch](const at::Tensor& t, v1::Tensor* out,
                         Outgoing* outgoing) {
    return EncodeTensor(t, scratch, out, outgoing);
  };
}

absl::StatusOr<Client::PackPart> Client::PackRows(
    const std::vector<at::Tensor>& tensors, const at::Tensor& mask,
    const at::Tensor& segment_ids, const PackCallOptions& options,
    SharedMemory* scratch, int connection) {
  Wire<v1::PackRequest> request;
  Outgoing outgoing(&request);
  PACKD_RETURN_IF_ERROR(EncodePack(options.device, options, tensors, mask,
                                   segment_ids, HostEncoder(scratch),
                                   &request.message(), &outgoing));
  // Results into shared memory: room for the largest possible result (every row
  // active). The scratch segment is sized for that; a caller's segment may not
  // be.
  SharedMemory* results = options.layout.any()
                              ? nullptr  // a layout's results come inline
                          : options.results_in != nullptr ? options.results_in
                                                          : scratch;
  std::vector<int64_t> result_sizes;
  for (const at::Tensor& t : tensors) result_sizes.push_back(t.nbytes());
  if (results != nullptr &&
      !AddOutputSlices(*results, result_sizes, request->mutable_outputs(),
                       &outgoing.regions) &&
      options.results_in != nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "results_in: segment \"", results->region(), "\" has ",
        results->size() - results->used(), " of ", results->size(),
        " bytes free, too few for the results (up to the inputs' size); "
        "Reset() it or give a larger one"));
  }
  PackPart part;
  PACKD_RETURN_IF_ERROR(
      RawCall(connection, kPackMethod, outgoing, &part.reply));
  return part;
}

absl::StatusOr<PackedBatch> Client::Pack(const std::vector<at::Tensor>& tensors,
                                         const at::Tensor& mask,
                                         const PackCallOptions& options) {
  Named named = {{"mask", &mask}, {"segment_ids", &options.segment_ids}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    named.push_back({absl::StrCat("inputs[", i, "]"), &tensors[i]});
  }
  PACKD_ASSIGN_OR_RETURN(std::optional<int> gpu, GpuOf(named));
  if (options.layout.any() && options.results_in != nullptr) {
    return absl::InvalidArgumentError(
        "results_in takes the results of a Pack without a layout; a layout's "
        "results come inline");
  }
  if (gpu.has_value()) return PackOnGpu(*gpu, tensors, mask, options);
  int64_t bytes = mask.nbytes();
  for (const at::Tensor& t : tensors)
    bytes += 2 * t.nbytes();  // inputs and, at most, results
  Scratch scratch(nullptr, ScratchReturn{this});
  if (options.results_in == nullptr) {
    PACKD_ASSIGN_OR_RETURN(scratch, ScratchFor(bytes));
  }
  // A large inline call goes as parts of the rows, each on its own
  // connection, at once.
  const int64_t rows = mask.dim() == 2 ? mask.size(0) : 0;
  const int parts = options.results_in == nullptr && !options.layout.any() &&
                            !options.with_token_mask &&
                            !options.mrope.has_value() &&
                            SplitsByRows(tensors, mask, options.segment_ids)
                        ? Parts(bytes, scratch != nullptr, rows)
                        : 1;
  std::vector<int64_t> first_rows;
  for (int k = 0; k < parts; ++k)
    first_rows.push_back(FirstRow(rows, parts, k));
  PACKD_ASSIGN_OR_RETURN(
      std::vector<PackPart> parts_done,
      InParts<PackPart>(parts, [&](int k) -> absl::StatusOr<PackPart> {
        if (parts == 1) {
          return PackRows(tensors, mask, options.segment_ids, options,
                          scratch.get(), 0);
        }
        const int64_t begin = first_rows[k];
        const int64_t n = FirstRow(rows, parts, k + 1) - begin;
        return PackRows(Rows(tensors, begin, n), Rows(mask, begin, n),
                        Rows(options.segment_ids, begin, n), options, nullptr,
                        k);
      }));
  PackedBatch batch;
  std::vector<const v1::PackResponse*> responses;
  std::vector<const Tensors*> results;
  std::vector<const WireMessage*> replies;
  for (const PackPart& part : parts_done) {
    responses.push_back(&part.reply.message());
    results.push_back(&part.reply->packed());
    replies.push_back(&part.reply);
  }
  PACKD_ASSIGN_OR_RETURN(
      batch.packed,
      Results(results, replies, /*copy_out=*/options.results_in == nullptr));
  if (parts == 1 && parts_done[0].reply->shifted_size() > 0) {
    PACKD_ASSIGN_OR_RETURN(batch.shifted,
                           Results({&parts_done[0].reply->shifted()}, replies,
                                   /*copy_out=*/true));
  }
  const v1::PackResponse response =
      parts == 1 ? std::move(parts_done[0].reply.message())
                 : JoinPackResponses(responses, first_rows);
  FillMetadata(response, options, &batch);
  return batch;
}

absl::StatusOr<std::vector<at::Tensor>> Client::Scatter(
    const std::vector<at::Tensor>& packed, const at::Tensor& mask,
    const std::optional<std::vector<int64_t>>& tail_shape,
    const std::string& device) {
  ScatterCallOptions options;
  options.tail_shape = tail_shape;
  options.device = device;
  return Scatter(packed, mask, options);
}

absl::StatusOr<std::vector<at::Tensor>> Client::Scatter(
    const std::vector<at::Tensor>& packed, const at::Tensor& mask,
    const ScatterCallOptions& options) {
  const std::string& device = options.device;
  const bool laid_out = options.layout.any() || options.segment_ids.defined();
  Named named = {{"mask", &mask}, {"segment_ids", &options.segment_ids}};
  for (size_t i = 0; i < packed.size(); ++i) {
    named.push_back({absl::StrCat("packed[", i, "]"), &packed[i]});
  }
  PACKD_ASSIGN_OR_RETURN(std::optional<int> gpu, GpuOf(named));
  if (gpu.has_value()) {
    if (!device.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device \"", device, "\" is for host tensors; these are on ",
          device_memory_->Name(*gpu), ", where the call runs"));
    }
    return ScatterOnGpu(*gpu, packed, mask, options);
  }
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
  PACKD_ASSIGN_OR_RETURN(Scratch scratch, ScratchFor(bytes));
  auto scatter_rows = [&](const std::vector<at::Tensor>& rows_packed,
                          const at::Tensor& rows_mask, SharedMemory* segment,
                          int connection) -> absl::StatusOr<ScatterPart> {
    Wire<v1::ScatterRequest> request;
    Outgoing outgoing(&request);
    PACKD_RETURN_IF_ERROR(EncodeScatter(
        device, options, rows_packed, rows_mask, options.segment_ids,
        HostEncoder(segment), &request.message(), &outgoing));
    if (segment != nullptr && rows_mask.dim() == 2) {
      AddOutputSlices(*segment, dense_sizes, request->mutable_outputs(),
                      &outgoing.regions);
    }
    ScatterPart part;
    PACKD_RETURN_IF_ERROR(
        RawCall(connection, kScatterMethod, outgoing, &part.reply));
    return part;
  };

  // A large inline call goes as parts of the rows, each with the packed rows
  // of its part, on their own connections at once: part k's packed rows
  // start at the active count before its first row.
  const int64_t rows = mask.dim() == 2 ? mask.size(0) : 0;
  int parts = laid_out ? 1 : Parts(bytes, scratch != nullptr, rows);
  std::vector<int64_t> first_packed(parts + 1, 0);
  if (parts > 1) {
    const at::Tensor before =
        at::cat({at::zeros({1}, at::kLong), mask.ne(0).sum(1).cumsum(0)});
    for (int k = 0; k <= parts; ++k) {
      first_packed[k] = before[FirstRow(rows, parts, k)].item<int64_t>();
    }
    for (const at::Tensor& t : packed) {
      if (t.dim() < 1 || t.size(0) != first_packed[parts]) parts = 1;
    }
  }
  PACKD_ASSIGN_OR_RETURN(
      std::vector<ScatterPart> parts_done,
      InParts<ScatterPart>(parts, [&](int k) -> absl::StatusOr<ScatterPart> {
        if (parts == 1) return scatter_rows(packed, mask, scratch.get(), 0);
        const int64_t begin = FirstRow(rows, parts, k);
        return scatter_rows(
            Rows(packed, first_packed[k],
                 first_packed[k + 1] - first_packed[k]),
            Rows(mask, begin, FirstRow(rows, parts, k + 1) - begin), nullptr,
            k);
      }));
  std::vector<const Tensors*> results;
  std::vector<const WireMessage*> replies;
  for (const ScatterPart& part : parts_done) {
    results.push_back(&part.reply->dense());
    replies.push_back(&part.reply);
  }
  return Results(results, replies, /*copy_out=*/true);
}

}  // namespace packd
