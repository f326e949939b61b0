// Pack and Scatter as raw methods under the memory budget: the generic
// reactor (InlineCall) that admits a call before gRPC reads its request,
// reads it in place (WireMessage), runs it on packd's workers through the
// call mechanism (server/call.h), and answers with slices that wrap the
// results; and what a call holds, for the budget. The handlers it runs,
// RunPack and RunScatter, are in pack_service.cc.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "kernels/status_macros.h"
#include "proto/tensor_codec.h"
#include "server/pack_service.h"

namespace packd {

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

// The rows of a Pack's results at most: the mask's active count without a
// layout; with one, that padded (each sequence by at most pad_multiple - 1
// rows, and there are at most B rows or `active` documents), or
// fixed.tokens. -1 when unknown.
int64_t ResultRows(const v1::PackRequest& request, int64_t active) {
  if (active < 0) return -1;
  const v1::FixedLayout& fixed = request.fixed();
  if (fixed.tokens() > 0) return std::max(fixed.tokens(), active);
  const int64_t m = std::max<int64_t>(request.pad_multiple(), 1);
  const int64_t sequences = request.has_segment_ids()
                                ? active
                                : std::max<int64_t>(0, request.mask().shape(0));
  return SaturatingAdd(active, SaturatingMul(m - 1, sequences));
}

// The bytes of a call's inline results. Pack's: the rows of each input (and
// of each shift's input) that ResultRows bounds when the mask is inline, else
// the inputs' size, which bounds them without a layout.
int64_t ResultBytes(const Wire<v1::PackRequest>& wire) {
  const v1::PackRequest& request = wire.message();
  if (!request.outputs().empty()) return 0;
  const auto& mask = request.mask();
  const int64_t rows = ResultRows(request, InlineActive(wire));
  auto result_bytes = [&](const v1::Tensor& t) {
    int64_t result = HeaderBytes(t);
    const bool over_mask = rows >= 0 && t.shape_size() >= 2 &&
                           t.shape(0) == mask.shape(0) &&
                           t.shape(1) == mask.shape(1);
    const int64_t positions =
        over_mask ? SaturatingMul(t.shape(0), t.shape(1)) : 0;
    if (positions > 0 && positions < INT64_MAX) {
      result = SaturatingMul(result / positions, rows);
    }
    return result;
  };
  int64_t bytes = 0;
  for (const v1::Tensor& t : request.inputs()) {
    bytes = SaturatingAdd(bytes, result_bytes(t));
  }
  for (const v1::Shift& shift : request.shifts()) {
    if (shift.input() >= 0 && shift.input() < request.inputs_size()) {
      bytes = SaturatingAdd(bytes, result_bytes(request.inputs(shift.input())));
    }
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

}  // namespace packd
