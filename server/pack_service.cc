#include "server/pack_service.h"

#include <algorithm>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/buffer.h"
#include "kernels/device_runtime.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "kernels/status_macros.h"
#include "planner/planner.h"
#include "proto/tensor_codec.h"

#ifndef PACKD_VERSION
#define PACKD_VERSION "unknown"
#endif

namespace packd {
namespace {

// Writes result i into a pooled buffer that the reply wraps without a copy,
// carried by `reply` for the i-th tensor of its response field `field`, sized
// once the mask scan has counted the active rows. The running total is
// checked against the message limit first.
template <typename Field>
OutputAllocator IntoReply(WireMessage* reply, Field* field,
                          std::vector<Buffer>* buffers, int64_t limit,
                          int64_t reserved) {
  return
      [reply, field, buffers, limit, used = reserved](
          size_t index, int64_t bytes) mutable -> absl::StatusOr<OutputPlace> {
        used += bytes;
        if (used > limit) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "the response would hold at least ", used,
              " bytes, over the server's limit of ", limit,
              " bytes (--max_message_bytes); split the batch or use tensor "
              "handles"));
        }
        while (field->size() <= static_cast<int>(index)) field->Add();
        const v1::Tensor* tensor = &(*field)[index];
        if (bytes == 0) {
          reply->Carry(*tensor, Payload());
          return OutputPlace{nullptr, Device::Cpu()};
        }
        PACKD_ASSIGN_OR_RETURN(Buffer buffer,
                               HostBufferPool::Global().Acquire(bytes));
        reply->Carry(*tensor, Payload::Of(buffer.data(), bytes));
        void* data = buffer.data();
        buffers->push_back(std::move(buffer));
        return OutputPlace{data, Device::Cpu()};
      };
}

// Writes result i into the request's output slice i, if it fits.
OutputAllocator IntoSlices(const std::vector<ResolvedSlice>* slices) {
  return [slices](size_t i, int64_t bytes) -> absl::StatusOr<OutputPlace> {
    const ResolvedSlice& slice = (*slices)[i];
    if (static_cast<uint64_t>(bytes) > slice.byte_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "] has ", slice.byte_size,
                       " bytes but the result needs ", bytes, " bytes"));
    }
    return OutputPlace{slice.data, slice.region->device()};
  };
}

// Sets each result tensor's header, and the region slice written when results
// went to the request's outputs.
template <typename Field>
void EncodeResults(
    const std::vector<ResultTensor>& results,
    const google::protobuf::RepeatedPtrField<v1::RegionSlice>& outputs,
    Field* field) {
  for (size_t i = 0; i < results.size(); ++i) {
    while (field->size() <= static_cast<int>(i)) field->Add();
    v1::Tensor* out = &(*field)[i];
    EncodeTensorHeader(results[i].view.dtype, results[i].view.shape, out);
    if (!outputs.empty()) {
      v1::RegionSlice* written = out->mutable_region();
      written->set_region(outputs[i].region());
      written->set_offset(outputs[i].offset());
      written->set_byte_size(results[i].view.nbytes());
    }
  }
}

}  // namespace

PackServiceImpl::PackServiceImpl(ServiceOptions options)
    : options_(std::move(options)),
      regions_(options_.regions),
      decoder_(regions_, options_.default_device, options_.max_message_bytes),
      calls_(
          CallMechanism::Options{
              options_.auth,
              options_.worker_threads > 0
                  ? options_.worker_threads
                  : static_cast<int>(std::thread::hardware_concurrency()),
              [this] { CheckDefaultDevice(); }},
          &metrics_),
      budget_(options_.max_inflight_bytes) {}

void PackServiceImpl::StartDraining() { calls_.StartDraining(); }

bool PackServiceImpl::WaitForIdle(absl::Time deadline) {
  return calls_.WaitForIdle(deadline);
}

namespace {

// a * b, or INT64_MAX when it overflows (a, b >= 0).
int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? INT64_MAX : out;
}
int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? INT64_MAX : out;
}

// Bytes of a tensor's header (numel * itemsize), 0 when it is not valid (the
// decoder refuses it later).
int64_t HeaderBytes(const v1::Tensor& t) {
  absl::StatusOr<TensorView> view = DecodeTensorHeader(t, "");
  return view.ok() ? view->nbytes() : 0;
}

// The active positions of an inline [B, S] mask, counted as the op counts them
// (nonzero: NaN active, -0.0 not); -1 when the mask is not inline or not well
// formed (the decoder refuses it later). A scan of the mask alone: a small
// part of what a Pack reads.
int64_t InlineActive(const Wire<v1::PackRequest>& request) {
  const v1::Tensor& mask = request->mask();
  absl::StatusOr<TensorView> view = DecodeTensorHeader(mask, "");
  if (!view.ok() || view->shape.size() != 2 || mask.has_region()) return -1;
  const Payload payload = request.BytesOf(mask);
  if (payload.size != view->nbytes()) return -1;
  if (payload.contiguous()) {
    return CountNonzero(view->dtype, payload.data(), view->numel());
  }
  std::string copy(static_cast<size_t>(payload.size), '\0');
  payload.CopyOut(0, payload.size, copy.data());
  return CountNonzero(view->dtype, copy.data(), view->numel());
}

// The bytes of a call's inline results. Pack's: the active rows of each
// input, from the mask's active count when the mask is inline (else the
// inputs' size, which bounds them).
int64_t ResultBytes(const Wire<v1::PackRequest>& wire) {
  const v1::PackRequest& request = wire.message();
  if (!request.outputs().empty()) return 0;
  const int64_t active = InlineActive(wire);
  const auto& mask = request.mask();
  int64_t bytes = 0;
  for (const v1::Tensor& t : request.inputs()) {
    int64_t result = HeaderBytes(t);
    const bool over_mask = active >= 0 && t.shape_size() >= 2 &&
                           t.shape(0) == mask.shape(0) &&
                           t.shape(1) == mask.shape(1);
    const int64_t positions =
        over_mask ? SaturatingMul(t.shape(0), t.shape(1)) : 0;
    if (positions > 0 && positions < INT64_MAX) {
      result = SaturatingMul(result / positions, active);
    }
    bytes = SaturatingAdd(bytes, result);
  }
  return bytes;
}
int64_t ResultBytes(const Wire<v1::ScatterRequest>& wire) {
  const v1::ScatterRequest& request = wire.message();
  if (!request.outputs().empty() || request.mask().shape_size() != 2) return 0;
  const int64_t positions =
      SaturatingMul(std::max<int64_t>(0, request.mask().shape(0)),
                    std::max<int64_t>(0, request.mask().shape(1)));
  int64_t bytes = 0;
  for (const v1::Tensor& t : request.packed()) {
    if (t.shape_size() == 0 || t.shape(0) <= 0) continue;
    const int64_t row = HeaderBytes(t) / t.shape(0);
    bytes = SaturatingAdd(bytes, SaturatingMul(positions, row));
  }
  return bytes;
}

}  // namespace

absl::Time PackServiceImpl::BudgetDeadline(
    const grpc::CallbackServerContext* context) {
  // Give up a little before the caller's deadline, so that it hears
  // RESOURCE_EXHAUSTED from us rather than its own DEADLINE_EXCEEDED.
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline < absl::InfiniteFuture()) {
    deadline -= std::min(absl::Milliseconds(200), (deadline - absl::Now()) / 5);
  }
  return deadline;
}

int64_t PackServiceImpl::AdmissionBytes(int64_t declared) const {
  const int64_t limit = budget_.limit();
  if (limit <= 0) return 0;
  // A call needs at most three times its request: the request, its inputs
  // gathered, and results (Pack's are no larger than its inputs; Scatter's
  // may need more, and wait for it once parsed). Without a declared size the
  // request may be up to --max_message_bytes (gRPC accepts up to twice that,
  // which three times still covers, and packd refuses it before any copy).
  const int64_t request = declared > 0 ? declared : options_.max_message_bytes;
  return std::min(limit, SaturatingMul(3, request));
}

// One Pack or Scatter call, served by a generic handler so that gRPC reads the
// request only once the memory budget has admitted the call: until then it
// stays with its sender (HTTP/2 flow control; the server turns off
// bandwidth-delay probing so that a stream's window stays at 64 KiB until its
// message is asked for). The call reserves what its request can make it hold
// (AdmissionBytes: from the size its client declares in kRequestBytesHeader,
// else the largest), reads and parses the request from the received slices
// with tensor bytes in place, keeps what it needs (request, gathered inputs,
// inline results), runs the op, and answers with slices that wrap the result
// buffers and the reservation.
template <typename Request, typename Response>
class InlineCall final : public grpc::ServerGenericBidiReactor {
 public:
  using Reply = PackServiceImpl::CallReply<Response>;
  using Work = absl::Status (PackServiceImpl::*)(const Wire<Request>&, Reply*);

  InlineCall(PackServiceImpl* service,
             grpc::GenericCallbackServerContext* context, const char* method,
             Work work)
      : service_(service),
        method_(method),
        work_(work),
        deadline_(PackServiceImpl::BudgetDeadline(context)) {
    // Authenticated and counted in flight (UNAVAILABLE while draining), then
    // released in OnDone once the reply has been sent.
    if (absl::Status admitted =
            service_->calls_.Admit(*context, Draining::kRefused);
        !admitted.ok()) {
      Done(admitted);
      return;
    }
    admitted_ = true;
    const auto declared = context->client_metadata().find(kRequestBytesHeader);
    if (declared != context->client_metadata().end() &&
        (!absl::SimpleAtoi(absl::string_view(declared->second.data(),
                                             declared->second.size()),
                           &declared_bytes_) ||
         declared_bytes_ <= 0)) {
      Done(absl::InvalidArgumentError(
          absl::StrCat(kRequestBytesHeader, " must be a positive number")));
      return;
    }
    // A request declared too large is refused before it is read.
    if (absl::Status size =
            service_->decoder_.CheckSize("request", declared_bytes_);
        !size.ok()) {
      Done(size);
      return;
    }
    // Waits, off gRPC's threads, until the bytes are free or the deadline.
    service_->budget_.Reserve(
        service_->AdmissionBytes(declared_bytes_), deadline_,
        [this](absl::StatusOr<MemoryBudget::Hold> hold) {
          if (!hold.ok()) return Done(hold.status());
          hold_ = *std::move(hold);
          HandOff(this);  // OnReadDone runs on one of gRPC's threads
          StartRead(&request_);
        });
  }

  void OnReadDone(bool ok) override {
    TakeOver(this);
    if (!ok) {
      Done(absl::CancelledError(absl::StrCat(
          "the ", method_, " call ended before its request arrived")));
      return;
    }
    // The parse and the op run on packd's workers, never on gRPC's thread.
    service_->calls_.Submit([this] { ParseAndRun(); });
  }

  // The call has ended: its response sent (or its failure told), so a drain
  // that waits for it also waits for its reply to leave.
  void OnDone() override {
    TakeOver(this);
    if (admitted_) service_->calls_.Release();
    delete this;
  }

 private:
  void ParseAndRun() {
    int64_t needed = 0;
    absl::Status status = Guarded(method_, [&] { return Parse(&needed); });
    if (!status.ok() || hold_ == nullptr || needed <= hold_->bytes()) {
      MemoryBudget::ShrinkTo(hold_, needed);
      Done(status.ok() ? Guarded(method_, [this] { return Run(); }) : status);
      return;
    }
    // Needs more than it reserved (a Scatter whose results outgrow its
    // request): it gives its reservation back and waits, ahead of calls not
    // yet read, for the whole of it, so that no two calls ever hold part of
    // what they need while waiting for the rest.
    hold_.reset();
    service_->budget_.Reserve(
        needed, deadline_,
        [this](absl::StatusOr<MemoryBudget::Hold> hold) {
          if (!hold.ok()) return Done(hold.status());
          hold_ = *std::move(hold);
          // Not on the budget's thread: it grants every waiter.
          service_->calls_.Submit(
              [this] { Done(Guarded(method_, [this] { return Run(); })); });
        },
        /*first=*/true);
  }

  // Parses the request, and sets `needed` to what the call holds from now on:
  // the request, the copies of its inline inputs that arrived in several
  // slices (gathered into one buffer; those in one slice are read in place),
  // and its inline results, sized exactly (never more than a response may
  // carry).
  absl::Status Parse(int64_t* needed) {
    request_bytes_ = request_.Length();
    PACKD_RETURN_IF_ERROR(
        service_->decoder_.CheckSize("request", request_bytes_));
    if (declared_bytes_ > 0 &&
        static_cast<int64_t>(request_bytes_) > declared_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the request has ", request_bytes_, " bytes, more than the ",
          declared_bytes_, " its ", kRequestBytesHeader, " header declared"));
    }
    PACKD_RETURN_IF_ERROR(parsed_.Receive(request_));
    *needed = SaturatingAdd(
        SaturatingAdd(static_cast<int64_t>(request_bytes_),
                      parsed_.SplitPayloadBytes()),
        std::min(ResultBytes(parsed_), service_->options_.max_message_bytes));
    if (service_->budget_.limit() > 0 && *needed > service_->budget_.limit()) {
      return service_->budget_.TooLarge(*needed);
    }
    return absl::OkStatus();
  }

  // Runs the op and makes the response.
  absl::Status Run() {
    // Owned by the slices of the reply until gRPC has sent them, with the
    // call's share of the budget.
    auto reply = std::make_shared<Reply>();
    reply->hold = std::move(hold_);
    absl::Status done = (service_->*work_)(parsed_, reply.get());
    // The request's bytes are no longer needed: release them now rather than
    // when the reply has been sent.
    parsed_.ReleaseBytes();
    request_.Clear();
    PACKD_RETURN_IF_ERROR(done);
    const Spliced spliced = reply->response.Serialize();
    // From now on the call holds its reply alone: the rest of its share goes
    // back to the budget for the calls waiting.
    MemoryBudget::ShrinkTo(reply->hold, spliced.size());
    PACKD_RETURN_IF_ERROR(
        service_->decoder_.CheckSize("response", spliced.size()));
    response_ = ToByteBuffer(spliced, reply);
    response_bytes_ = spliced.size();
    return absl::OkStatus();
  }

  // Finishes the call: with the response when `status` is OK. Nothing may
  // touch the reactor afterwards (OnDone deletes it).
  void Done(const absl::Status& status) {
    hold_.reset();
    if (admitted_ && !status.ok()) service_->calls_.AfterFailure();
    service_->calls_.Record(method_, status.code(), start_, request_bytes_,
                            status.ok() ? response_bytes_ : 0);
    HandOff(this);  // OnDone runs on one of gRPC's threads
    if (status.ok()) {
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    } else {
      Finish(ToGrpcStatus(status));
    }
  }

  PackServiceImpl* const service_;
  const char* const method_;
  const Work work_;
  const absl::Time start_ = absl::Now();
  const absl::Time deadline_;
  int64_t declared_bytes_ = 0;
  bool admitted_ = false;
  MemoryBudget::Hold hold_;
  grpc::ByteBuffer request_;
  size_t request_bytes_ = 0;
  Wire<Request> parsed_;
  grpc::ByteBuffer response_;
  size_t response_bytes_ = 0;
};

grpc::ServerGenericBidiReactor* PackServiceImpl::InlineCalls::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  if (context->method() == "/packd.v1.PackService/Pack") {
    return new InlineCall<v1::PackRequest, v1::PackResponse>(
        service_, context, "Pack", &PackServiceImpl::RunPack);
  }
  if (context->method() == "/packd.v1.PackService/Scatter") {
    return new InlineCall<v1::ScatterRequest, v1::ScatterResponse>(
        service_, context, "Scatter", &PackServiceImpl::RunScatter);
  }
  class Unknown final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Unknown(const std::string& method) {
      Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                          absl::StrCat("packd has no method ", method)));
    }
    void OnDone() override { delete this; }
  };
  return new Unknown(context->method());
}

std::string PackServiceImpl::RenderMetrics() const {
  return metrics_.Render(regions_.size(), regions_.expired(),
                         calls_.in_flight());
}

template <typename Request, typename Response, typename Field, typename Op>
absl::Status PackServiceImpl::RunCall(const char* method,
                                      const Wire<Request>& request,
                                      Field* results, int64_t bytes_per_row,
                                      CallReply<Response>* reply, Op&& op) {
  PACKD_ASSIGN_OR_RETURN(DecodedCall call, decoder_.Decode(request));
  // The decoder has held the mask's rows against the message limit, so this
  // cannot overflow.
  const int64_t reserved = bytes_per_row * (call.mask.shape[0] + 1);
  CallOptions options;
  options.device = call.device;
  options.allocate = call.outputs.empty()
                         ? IntoReply(&reply->response, results, &reply->buffers,
                                     options_.max_message_bytes, reserved)
                         : IntoSlices(&call.outputs);
  if (options_.testing_call_hook) options_.testing_call_hook(method);
  PACKD_ASSIGN_OR_RETURN(std::vector<ResultTensor> out, op(call, options));
  EncodeResults(out, request->outputs(), results);
  return absl::OkStatus();
}

template <typename Request, typename Response, typename Run>
absl::Status PackServiceImpl::RunPlain(const Request& request,
                                       Response* response, Run&& run) {
  Wire<Request> wire;
  wire.message() = request;
  CallReply<Response> reply;
  PACKD_RETURN_IF_ERROR(run(wire, &reply));
  reply.response.CopyPayloadsIntoData();
  *response = std::move(reply.response.message());
  absl::Status size = decoder_.CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

absl::Status PackServiceImpl::DoPack(const v1::PackRequest& request,
                                     v1::PackResponse* response) {
  return RunPlain(request, response, [this](const auto& wire, auto* reply) {
    return RunPack(wire, reply);
  });
}

absl::Status PackServiceImpl::DoScatter(const v1::ScatterRequest& request,
                                        v1::ScatterResponse* response) {
  return RunPlain(request, response, [this](const auto& wire, auto* reply) {
    return RunScatter(wire, reply);
  });
}

absl::Status PackServiceImpl::RunPack(const Wire<v1::PackRequest>& wire,
                                      CallReply<v1::PackResponse>* reply) {
  const v1::PackRequest& request = wire.message();
  v1::PackResponse* response = &reply->response.message();
  auto pack = [&](const DecodedCall& call, const CallOptions& base)
      -> absl::StatusOr<std::vector<ResultTensor>> {
    PackOptions options;
    static_cast<CallOptions&>(options) = base;
    options.with_position_ids = request.with_position_ids();
    options.segment_ids = call.segment_ids;
    PACKD_ASSIGN_OR_RETURN(PackResult result,
                           ::packd::Pack(call.tensors, call.mask, options));
    response->mutable_doc_cu_seqlens()->Assign(result.doc_cu_seqlens.begin(),
                                               result.doc_cu_seqlens.end());
    response->set_doc_max_seqlen(result.doc_max_seqlen);
    response->mutable_doc_row()->Assign(result.doc_row.begin(),
                                        result.doc_row.end());
    response->mutable_doc_last_index()->Assign(result.doc_last_index.begin(),
                                               result.doc_last_index.end());
    response->mutable_cu_seqlens()->Assign(result.cu_seqlens.begin(),
                                           result.cu_seqlens.end());
    response->set_total_active(result.total_active);
    response->set_max_seqlen(result.max_seqlen);
    response->mutable_position_ids()->Assign(result.position_ids.begin(),
                                             result.position_ids.end());
    response->mutable_last_index()->Assign(result.last_index.begin(),
                                           result.last_index.end());
    return std::move(result.packed);
  };
  return RunCall("Pack", wire, response->mutable_packed(),
                 RequestDecoder::kBytesPerMaskRow, reply, pack);
}

absl::Status PackServiceImpl::RunScatter(
    const Wire<v1::ScatterRequest>& wire,
    CallReply<v1::ScatterResponse>* reply) {
  const v1::ScatterRequest& request = wire.message();
  auto scatter = [&](const DecodedCall& call, const CallOptions& base)
      -> absl::StatusOr<std::vector<ResultTensor>> {
    ScatterOptions options;
    static_cast<CallOptions&>(options) = base;
    if (request.has_tail_shape()) {
      options.tail_shape.emplace(request.tail_shape().dims().begin(),
                                 request.tail_shape().dims().end());
    }
    PACKD_ASSIGN_OR_RETURN(ScatterResult result,
                           ::packd::Scatter(call.tensors, call.mask, options));
    return std::move(result.dense);
  };
  return RunCall("Scatter", wire, reply->response->mutable_dense(), 0, reply,
                 scatter);
}

absl::Status PackServiceImpl::DoPlan(const v1::PlanRequest& request,
                                     v1::PlanResponse* response) {
  PACKD_RETURN_IF_ERROR(decoder_.CheckSize("request", request.ByteSizeLong()));
  PlanOptions options;
  options.max_tokens_per_micro_batch = request.max_tokens_per_micro_batch();
  options.num_ranks = request.num_ranks();
  options.micro_batch_multiple = request.micro_batch_multiple();
  const absl::Span<const int64_t> lengths(request.lengths().data(),
                                          request.lengths_size());
  const absl::Span<const int64_t> loss(request.loss_tokens().data(),
                                       request.loss_tokens_size());
  // Every micro-batch slot costs a message: refuse plans whose slots alone
  // would pass the message limit before planning them.
  const int64_t lower = MicroBatchLowerBound(lengths, options);
  const int64_t ranks = std::max<int32_t>(1, options.num_ranks);
  if (lower > options_.max_message_bytes / 8 / ranks) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the plan would hold at least ", lower,
                     " micro-batches on each of ", ranks,
                     " ranks, too many for one response (--max_message_bytes); "
                     "raise max_tokens_per_micro_batch"));
  }
  PACKD_ASSIGN_OR_RETURN(Plan plan,
                         ::packd::PlanMicroBatches(lengths, loss, options));
  for (MicroBatch& mb : plan.micro_batches) {
    v1::MicroBatch* out = response->add_micro_batches();
    out->set_rank(mb.rank);
    out->mutable_samples()->Assign(mb.samples.begin(), mb.samples.end());
    out->set_tokens(mb.tokens);
    out->set_loss_tokens(mb.loss_tokens);
  }
  response->set_micro_batches_per_rank(plan.micro_batches_per_rank);
  response->set_global_loss_tokens(plan.global_loss_tokens);
  response->set_imbalance(plan.imbalance);
  absl::Status size = decoder_.CheckSize("response", response->ByteSizeLong());
  if (!size.ok()) response->Clear();
  return size;
}

grpc::ServerUnaryReactor* PackServiceImpl::PlanMicroBatches(
    grpc::CallbackServerContext* context, const v1::PlanRequest* request,
    v1::PlanResponse* response) {
  return calls_.Unary(context, "PlanMicroBatches", Draining::kRefused, *request,
                      response, [=] { return DoPlan(*request, response); });
}

void PackServiceImpl::CheckDefaultDevice() {
  const absl::Status device =
      Registry::Runtime(options_.default_device).status();
  if (device.code() != absl::StatusCode::kUnavailable) return;
  {
    absl::MutexLock lock(&mu_);
    if (device_lost_) return;
    device_lost_ = true;
  }
  if (options_.on_device_lost) options_.on_device_lost(device);
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterSystemRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterSystemRegionRequest* request,
    v1::RegisterRegionResponse* response) {
  return calls_.Unary(context, "RegisterSystemRegion", Draining::kServed,
                      *request, response, [=] {
                        return regions_.RegisterSystem(
                            request->name(), request->key(), request->offset(),
                            request->byte_size(), request->lease_seconds());
                      });
}

absl::Status PackServiceImpl::DoRegisterDeviceRegion(
    const v1::RegisterDeviceRegionRequest& request) {
  PACKD_RETURN_IF_ERROR(regions_.CheckEnabled());
  PACKD_RETURN_IF_ERROR(RegionRegistry::ValidateName(request.name()));
  PACKD_ASSIGN_OR_RETURN(Device device, ParseDevice(request.device()));
  if (device.kind == DeviceKind::kCpu) {
    return absl::InvalidArgumentError(
        "device regions live on cuda:N or hip:N; register host memory with "
        "RegisterSystemRegion");
  }
  if (request.ipc_handle().size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_handle has ", request.ipc_handle().size(),
        " bytes; a cudaIpcMemHandle_t / hipIpcMemHandle_t has 64"));
  }
  if (request.byte_size() == 0) {
    return absl::InvalidArgumentError("byte_size must be positive");
  }
  std::string identity = RegionRegistry::DeviceIdentity(
      request.ipc_handle(), device, request.byte_size());
  // A repeat after a lost reply finds its region: no second mapping.
  PACKD_ASSIGN_OR_RETURN(const bool held,
                         regions_.HeldAs(request.name(), identity));
  if (held) return absl::OkStatus();
  PACKD_ASSIGN_OR_RETURN(DeviceRuntime * runtime, Registry::Runtime(device));
  PACKD_ASSIGN_OR_RETURN(DeviceMapping mapping,
                         runtime->OpenIpcMemory(request.ipc_handle(), device,
                                                request.byte_size()));
  return regions_.RegisterDevice(request.name(), device,
                                 static_cast<char*>(mapping.base),
                                 request.byte_size(), std::move(mapping.owner),
                                 request.lease_seconds(), std::move(identity));
}

grpc::ServerUnaryReactor* PackServiceImpl::RegisterDeviceRegion(
    grpc::CallbackServerContext* context,
    const v1::RegisterDeviceRegionRequest* request,
    v1::RegisterRegionResponse* response) {
  return calls_.Unary(context, "RegisterDeviceRegion", Draining::kServed,
                      *request, response,
                      [=] { return DoRegisterDeviceRegion(*request); });
}

grpc::ServerUnaryReactor* PackServiceImpl::UnregisterRegion(
    grpc::CallbackServerContext* context,
    const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse* response) {
  return calls_.Unary(context, "UnregisterRegion", Draining::kServed, *request,
                      response,
                      [=] { return regions_.Unregister(request->name()); });
}

grpc::ServerUnaryReactor* PackServiceImpl::ListRegions(
    grpc::CallbackServerContext* context, const v1::ListRegionsRequest* request,
    v1::ListRegionsResponse* response) {
  return calls_.Unary(context, "ListRegions", Draining::kServed, *request,
                      response, [=] {
                        PACKD_RETURN_IF_ERROR(regions_.CheckEnabled());
                        for (v1::RegionInfo& info : regions_.List()) {
                          *response->add_regions() = std::move(info);
                        }
                        return absl::OkStatus();
                      });
}

grpc::ServerUnaryReactor* PackServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context,
    const v1::GetServerInfoRequest* request, v1::ServerInfo* response) {
  return calls_.Unary(context, "GetServerInfo", Draining::kServed, *request,
                      response, [=] { return DoServerInfo(response); });
}

absl::Status PackServiceImpl::DoServerInfo(v1::ServerInfo* response) {
  response->set_version(PACKD_VERSION);
  for (DeviceKind kind :
       {DeviceKind::kCpu, DeviceKind::kCuda, DeviceKind::kHip}) {
    absl::StatusOr<DeviceRuntime*> runtime =
        Registry::Global().FindRuntime(Device{kind, 0});
    if (!runtime.ok()) continue;  // not built in, or no device 0
    for (const DeviceInfo& device : (*runtime)->ListDevices()) {
      v1::DeviceInfo* info = response->add_devices();
      info->set_name(device.device.ToString());
      info->set_kind(kind == DeviceKind::kCpu    ? "cpu"
                     : kind == DeviceKind::kCuda ? "cuda"
                                                 : "hip");
      info->set_memory_bytes(device.memory_bytes);
    }
  }
  response->set_default_device(options_.default_device.ToString());
  response->set_max_message_bytes(options_.max_message_bytes);
  response->set_shared_memory_enabled(regions_.enabled());
  return absl::OkStatus();
}

}  // namespace packd
