#include "client/client.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/buffer.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "base/torch_interop.h"
#include "proto/address.h"
#include "proto/grpc_wire.h"
#include "proto/plan_codec.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

// Segments of this client are keyed "<shm_key_prefix>_client_..." and
// registered as regions "client-...".
constexpr char kSegmentTag[] = "client";

std::vector<int64_t> ShapeOf(const v1::Tensor& t) {
  return std::vector<int64_t>(t.shape().begin(), t.shape().end());
}

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
int64_t FirstRow(int64_t rows, int parts, int k) { return rows * k / parts; }

// An uninitialised tensor in pooled memory that stays mapped (HostBufferPool,
// base/buffer.h): results of large calls, written once, without the page
// faults of fresh memory.
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

// Shared-memory room a call needs, rounded up so that slightly larger batches
// reuse the segment: a quarter more, plus 1 MiB. (The Python client's rule is
// the same: python/packd/_regions.py, Regions.scratch_for.)
int64_t ScratchBytes(int64_t bytes) { return bytes + bytes / 4 + (1 << 20); }

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
  request.set_lease_seconds(options_.lease_seconds);
  v1::RegisterRegionResponse response;
  PACKD_RETURN_IF_ERROR(connection_->Call([&](grpc::ClientContext* c) {
    return connection_->stub().RegisterDeviceRegion(c, request, &response);
  }));
  absl::MutexLock lock(&mu_);
  device_regions_[name] = std::move(request);
  ++registrations_[name];
  return absl::OkStatus();
}

absl::Status Client::RegisterSegment(SharedMemory& shm) {
  if (!shm.segment().linked()) {
    PACKD_RETURN_IF_ERROR(
        shm.segment().Relink(connection_->NewSegmentName(kSegmentTag).key));
  }
  return connection_->RegisterSegment(shm.segment(), shm.region());
}

absl::StatusOr<bool> Client::Reregister(
    const std::vector<std::string>& regions) {
  // How often each region of ours was registered before the server listed
  // its regions: a count that changed since was registered by another call.
  absl::flat_hash_map<std::string, int64_t> before;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& region : regions) {
      auto it = registrations_.find(region);
      if (it != registrations_.end()) before[region] = it->second;
    }
  }
  if (before.empty()) return false;
  v1::ListRegionsResponse listed;
  PACKD_RETURN_IF_ERROR(connection_->Call([&](grpc::ClientContext* c) {
    return connection_->stub().ListRegions(c, v1::ListRegionsRequest(),
                                           &listed);
  }));
  absl::flat_hash_set<std::string> known;
  for (const v1::RegionInfo& info : listed.regions()) known.insert(info.name());
  bool missing = false;
  std::vector<std::string> mine;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [region, count] : before) {
      if (known.contains(region)) continue;
      missing = true;
      while (reregistering_.contains(region)) reregistered_.Wait(&mu_);
      if (registrations_[region] != count) continue;
      reregistering_.insert(region);
      mine.push_back(region);
    }
  }
  absl::Status status;
  for (const std::string& region : mine) {
    const absl::Status registered = RegisterAgain(region);
    absl::MutexLock lock(&mu_);
    reregistering_.erase(region);
    if (registered.ok()) ++registrations_[region];
    reregistered_.SignalAll();
    status.Update(registered);
  }
  PACKD_RETURN_IF_ERROR(status);
  return missing;
}

absl::Status Client::RegisterAgain(const std::string& region) {
  SharedMemory* segment = nullptr;
  std::optional<v1::RegisterDeviceRegionRequest> device;
  {
    absl::MutexLock lock(&mu_);
    for (SharedMemory* s : segments_) {
      if (s->region() == region) segment = s;
    }
    auto it = device_regions_.find(region);
    if (it != device_regions_.end()) device = it->second;
  }
  if (segment != nullptr) return RegisterSegment(*segment);
  if (!device.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("region \"", region, "\" is not this client's"));
  }
  v1::RegisterRegionResponse response;
  return connection_->Call([&](grpc::ClientContext* c) {
    return connection_->stub().RegisterDeviceRegion(c, *device, &response);
  });
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

absl::StatusOr<std::unique_ptr<SharedMemory>> Client::CreateSharedMemory(
    int64_t bytes) {
  Connection::SegmentName name = connection_->NewSegmentName(kSegmentTag);
  const std::string region = name.region;
  PACKD_ASSIGN_OR_RETURN(
      std::unique_ptr<SharedMemory> shm,
      SharedMemory::Create(std::move(name.key), region, bytes, [this, region] {
        {
          absl::MutexLock lock(&mu_);
          segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                         [&](SharedMemory* s) {
                                           return s->region() == region;
                                         }),
                          segments_.end());
          registrations_.erase(region);
        }
        connection_->UnregisterRegion(region).IgnoreError();
      }));
  // On failure the segment goes (unlinked); the unregister it sends finds
  // nothing, harmlessly. No other call knows it yet: no lock is needed.
  PACKD_RETURN_IF_ERROR(RegisterSegment(*shm));
  absl::MutexLock lock(&mu_);
  segments_.push_back(shm.get());
  registrations_[region] = 1;
  return shm;
}

absl::StatusOr<Client::Scratch> Client::ScratchFor(int64_t bytes) {
  Scratch none(nullptr, ScratchReturn{this});
  if (options_.shared_memory_threshold_bytes <= 0 ||
      bytes < options_.shared_memory_threshold_bytes ||
      !IsNodeLocal(options_.address)) {
    return none;
  }
  std::optional<bool> allowed;
  {
    absl::MutexLock lock(&mu_);
    allowed = server_allows_shm_;
  }
  if (!allowed.has_value()) {
    PACKD_ASSIGN_OR_RETURN(v1::ServerInfo info, Info());
    allowed = info.shared_memory_enabled();
    absl::MutexLock lock(&mu_);
    server_allows_shm_ = allowed;
  }
  if (!*allowed) return none;
  std::unique_ptr<SharedMemory> segment;
  {
    // The smallest idle segment that holds the call.
    absl::MutexLock lock(&mu_);
    auto best = idle_scratch_.end();
    for (auto it = idle_scratch_.begin(); it != idle_scratch_.end(); ++it) {
      if ((*it)->size() >= bytes &&
          (best == idle_scratch_.end() || (*it)->size() < (*best)->size())) {
        best = it;
      }
    }
    if (best != idle_scratch_.end()) {
      segment = std::move(*best);
      idle_scratch_.erase(best);
    }
  }
  if (segment == nullptr) {
    PACKD_ASSIGN_OR_RETURN(segment, CreateSharedMemory(ScratchBytes(bytes)));
  }
  segment->Reset();
  return Scratch(segment.release(), ScratchReturn{this});
}

void Client::ScratchReturn::operator()(SharedMemory* segment) const {
  // Declared before the lock, so closed after it is released: closing takes
  // mu_ and unregisters.
  std::unique_ptr<SharedMemory> evicted;
  absl::MutexLock lock(&client->mu_);
  std::vector<std::unique_ptr<SharedMemory>>& idle = client->idle_scratch_;
  idle.emplace_back(segment);
  if (static_cast<int>(idle.size()) >
      std::max(client->options_.idle_scratch_segments, 0)) {
    auto smallest = std::min_element(
        idle.begin(), idle.end(),
        [](const auto& a, const auto& b) { return a->size() < b->size(); });
    evicted = std::move(*smallest);
    idle.erase(smallest);
  }
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

namespace {

// Rows [begin, begin + n) of each [B, ...] tensor; undefined stays undefined.
at::Tensor Rows(const at::Tensor& t, int64_t begin, int64_t n) {
  return t.defined() ? t.narrow(0, begin, n) : t;
}
std::vector<at::Tensor> Rows(const std::vector<at::Tensor>& tensors,
                             int64_t begin, int64_t n) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) out.push_back(Rows(t, begin, n));
  return out;
}

// Whether every tensor, and the segment ids if given, is [B, S, ...] like the
// [B, S] mask with B >= 2: then the halves of the rows are two batches whose
// results, joined, are the whole batch's.
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

void AppendShifted(const google::protobuf::RepeatedField<int64_t>& from,
                   int skip, int64_t shift,
                   google::protobuf::RepeatedField<int64_t>* to) {
  for (int i = skip; i < from.size(); ++i) to->Add(from[i] + shift);
}

// The response of a whole batch from those of its row ranges, which start at
// rows `first_rows`: offsets, maxima and row numbers joined. The packed
// tensors are joined separately.
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

// One tensor from the results of each part (same dtype and trailing dims),
// joined along dim 0 with one copy out of the received bytes.
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
      return absl::InternalError("server returned parts that do not join");
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

}  // namespace

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
  for (const Tensors* r : results) {
    if (r->size() != results[0]->size()) {
      return absl::InternalError("server returned parts that do not join");
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
  PACKD_RETURN_IF_ERROR(encode(mask, request->mutable_mask(), outgoing));
  for (const at::Tensor& t : tensors) {
    PACKD_RETURN_IF_ERROR(encode(t, request->add_inputs(), outgoing));
  }
  if (segment_ids.defined()) {
    PACKD_RETURN_IF_ERROR(
        encode(segment_ids, request->mutable_segment_ids(), outgoing));
  }
  return absl::OkStatus();
}

absl::Status Client::EncodeScatter(
    const std::string& device, const ScatterCallOptions& options,
    const std::vector<at::Tensor>& packed, const at::Tensor& mask,
    const at::Tensor& segment_ids, const Encoder& encode,
    v1::ScatterRequest* request, Outgoing* outgoing) {
  request->set_device(device);
  PACKD_RETURN_IF_ERROR(EncodeLayout(options.layout, request));
  PACKD_RETURN_IF_ERROR(encode(mask, request->mutable_mask(), outgoing));
  for (const at::Tensor& t : packed) {
    PACKD_RETURN_IF_ERROR(encode(t, request->add_packed(), outgoing));
  }
  if (segment_ids.defined()) {
    PACKD_RETURN_IF_ERROR(
        encode(segment_ids, request->mutable_segment_ids(), outgoing));
  }
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

absl::Status Client::PackMicroBatches(
    const std::vector<at::Tensor>& tensors, const at::Tensor& mask,
    int64_t max_tokens_per_micro_batch, const StepCallOptions& options,
    const std::function<absl::Status(const v1::PlanResponse&)>& on_plan,
    const std::function<absl::Status(StepMicroBatch)>& on_micro_batch) {
  const PackCallOptions& pack = options.pack;
  Named named = {{"mask", &mask},
                 {"segment_ids", &pack.segment_ids},
                 {"loss_mask", &options.loss_mask}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    named.push_back({absl::StrCat("inputs[", i, "]"), &tensors[i]});
  }
  PACKD_ASSIGN_OR_RETURN(std::optional<int> gpu, GpuOf(named));
  if (pack.results_in != nullptr) {
    return absl::InvalidArgumentError(
        "results_in is Pack's; a step's micro-batches come in its stream");
  }
  if (gpu.has_value() && !pack.device.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device \"", pack.device, "\" is for host tensors; these are on ",
        device_memory_->Name(*gpu), ", where the step runs"));
  }
  int64_t bytes = 0;
  for (const auto& [name, t] : named) bytes += t->defined() ? t->nbytes() : 0;
  // The results' arena (after the inputs in the call's segment, or on the
  // tensors' GPU): as large as the last step's results, and a margin (the
  // server sends them inline when it is too small).
  int64_t arena = 0;
  {
    absl::MutexLock lock(&mu_);
    arena = step_output_bytes_;
  }
  if (arena > 0) arena += arena / 8 + (64 << 10);
  Wire<v1::PackMicroBatchesRequest> request;
  Outgoing outgoing(&request);
  *request->mutable_plan() =
      PlanRequestOf(options.plan.ForPlanner(max_tokens_per_micro_batch), {},
                    options.plan.loss_tokens);
  request->mutable_ranks()->Assign(options.ranks.begin(), options.ranks.end());
  // How a micro-batch's results are read: copied out of the shared-memory
  // arena or the reply; on a GPU, views of the step's arena there (which they
  // keep) or inline ones copied to it.
  std::function<absl::StatusOr<std::vector<at::Tensor>>(const Tensors&,
                                                        const WireMessage&)>
      results;
  Scratch scratch(nullptr, ScratchReturn{this});
  at::Tensor gpu_arena;
  int64_t gpu_arena_offset = 0;
  if (gpu.has_value()) {
    UnregisterFreed();
    const at::Tensor mask_c = mask.contiguous();
    std::vector<at::Tensor> tensors_c;
    for (const at::Tensor& t : tensors) tensors_c.push_back(t.contiguous());
    PACKD_ASSIGN_OR_RETURN(std::string uuid, GpuUuid(*gpu));
    PACKD_RETURN_IF_ERROR(
        EncodePack(absl::StrCat("uuid:", uuid), pack, tensors_c, mask_c,
                   pack.segment_ids.defined() ? pack.segment_ids.contiguous()
                                              : at::Tensor(),
                   GpuEncoder(*gpu), request->mutable_batch(), &outgoing));
    if (options.loss_mask.defined()) {
      PACKD_RETURN_IF_ERROR(EncodeGpuTensor(options.loss_mask.contiguous(),
                                            *gpu, request->mutable_loss_mask(),
                                            &outgoing));
    }
    if (arena > 0) {
      PACKD_ASSIGN_OR_RETURN(gpu_arena,
                             device_memory_->Empty({arena}, at::kByte, *gpu));
      PACKD_ASSIGN_OR_RETURN(*request->mutable_outputs(),
                             GpuSlice(gpu_arena, *gpu, &outgoing));
      gpu_arena_offset = static_cast<int64_t>(request->outputs().offset());
    }
    // The inputs written and the arena's memory free before packd touches
    // them.
    PACKD_RETURN_IF_ERROR(device_memory_->Synchronize(*gpu));
    results = [&](const Tensors& got, const WireMessage& reply)
        -> absl::StatusOr<std::vector<at::Tensor>> {
      std::vector<at::Tensor> out;
      for (const v1::Tensor& t : got) {
        if (!t.has_region()) {
          PACKD_ASSIGN_OR_RETURN(at::Tensor host,
                                 DecodeResult(t, /*copy_out=*/true, reply));
          PACKD_ASSIGN_OR_RETURN(at::Tensor placed,
                                 device_memory_->ToDevice(host, *gpu));
          out.push_back(std::move(placed));
          continue;
        }
        const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
        const at::ScalarType dtype =
            ToScalarType(static_cast<DType>(t.dtype()));
        const int64_t begin =
            static_cast<int64_t>(t.region().offset()) - gpu_arena_offset;
        const int64_t n = static_cast<int64_t>(t.region().byte_size());
        if (n == 0) {
          PACKD_ASSIGN_OR_RETURN(at::Tensor empty,
                                 device_memory_->Empty(shape, dtype, *gpu));
          out.push_back(std::move(empty));
          continue;
        }
        if (!gpu_arena.defined() || begin < 0 ||
            begin + n > gpu_arena.numel()) {
          return absl::InternalError(absl::StrCat(
              "packd wrote a result at ", begin, "..", begin + n,
              ", outside the step's arena of ",
              gpu_arena.defined() ? gpu_arena.numel() : 0, " bytes"));
        }
        out.push_back(gpu_arena.narrow(0, begin, n).view(dtype).reshape(shape));
      }
      return out;
    };
  } else {
    PACKD_ASSIGN_OR_RETURN(scratch, ScratchFor(bytes + arena));
    PACKD_RETURN_IF_ERROR(EncodePack(
        pack.device, pack, tensors, mask, pack.segment_ids,
        HostEncoder(scratch.get()), request->mutable_batch(), &outgoing));
    if (options.loss_mask.defined()) {
      PACKD_RETURN_IF_ERROR(EncodeTensor(options.loss_mask, scratch.get(),
                                         request->mutable_loss_mask(),
                                         &outgoing));
    }
    if (scratch != nullptr && arena > 0) {
      if (char* p = scratch->Allocate(arena); p != nullptr) {
        scratch->Contains(p, arena, request->mutable_outputs());
        outgoing.regions.push_back(scratch->region());
      }
    }
    results = [&](const Tensors& got, const WireMessage& reply) {
      return Results({&got}, {&reply}, /*copy_out=*/true);
    };
  }
  bool planned = false;
  auto on_message = [&](const grpc::ByteBuffer& buffer) -> absl::Status {
    Wire<v1::PackMicroBatchesResponse> reply;
    if (absl::Status parsed = Receive(buffer, &reply); !parsed.ok()) {
      return absl::InternalError(
          absl::StrCat("the server's reply: ", parsed.message()));
    }
    if (!planned) {
      planned = true;
      {
        absl::MutexLock lock(&mu_);
        step_output_bytes_ = reply->output_bytes();
      }
      return on_plan(reply->plan());
    }
    StepMicroBatch mb;
    mb.rank = reply->rank();
    mb.index = reply->index();
    mb.samples.assign(reply->samples().begin(), reply->samples().end());
    mb.through_shared_memory = reply->packed().packed_size() > 0 &&
                               reply->packed().packed(0).has_region();
    PACKD_ASSIGN_OR_RETURN(mb.batch.packed,
                           results(reply->packed().packed(), reply));
    PACKD_ASSIGN_OR_RETURN(mb.batch.shifted,
                           results(reply->packed().shifted(), reply));
    FillMetadata(reply->packed(), pack, &mb.batch);
    if (gpu.has_value()) {
      PACKD_RETURN_IF_ERROR(MetadataToDevice(*gpu, &mb.batch));
    }
    return on_micro_batch(std::move(mb));
  };
  absl::Status status =
      connection_->RawStream(kPackMicroBatchesMethod, request, on_message);
  if (status.code() == absl::StatusCode::kNotFound && !planned) {
    // A region of ours may be gone (lease, restart): register, then again.
    absl::StatusOr<bool> missing = Reregister(outgoing.regions);
    if (missing.ok() && *missing) {
      status =
          connection_->RawStream(kPackMicroBatchesMethod, request, on_message);
    }
  }
  return status;
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
