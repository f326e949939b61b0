// Pack and Scatter as raw methods under the memory budget: the generic
// reactor (InlineCall) that admits a call before gRPC reads its request,
// reads it in place (WireMessage), runs it on packd's workers through the
// call mechanism (server/call.h), and answers with slices that wrap the
// results; and what a call holds, for the budget. The handlers it runs,
// RunPack and RunScatter, are in pack_service.cc.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "kernels/status_macros.h"
#include "proto/tensor_codec.h"
#include "server/pack_service.h"
#include "server/step.h"

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

// A call of a raw method, served by a generic handler so that gRPC reads the
// request only once the memory budget has admitted the call: until then it
// stays with its sender (HTTP/2 flow control; the server turns off
// bandwidth-delay probing so that a stream's window stays at 64 KiB until its
// message is asked for). The call reserves what its request can make it hold
// (AdmissionBytes: from the size its client declares in kRequestBytesHeader,
// else the largest), reads and parses the request from the received slices
// with tensor bytes in place, keeps what it needs (Prepare: the request, the
// inputs gathered, results), and then serves it (Serve, on packd's workers).
// Pack and Scatter answer one message (InlineCall), PackMicroBatches a stream
// (StepCall).
template <typename Request>
class BudgetedCall : public grpc::ServerGenericBidiReactor {
 public:
  BudgetedCall(PackServiceImpl* service,
               grpc::GenericCallbackServerContext* context, const char* method)
      : service_(service),
        method_(method),
        deadline_(PackServiceImpl::BudgetDeadline(context)),
        context_(context) {}

  void OnReadDone(bool ok) override {
    TakeOver(this);
    if (!ok) {
      Done(absl::CancelledError(absl::StrCat(
          "the ", method_, " call ended before its request arrived")));
      return;
    }
    // The parse and the op run on packd's workers, never on gRPC's thread.
    service_->calls_.Submit([this] { ParseAndServe(); });
  }

  // The call has ended: its response sent (or its failure told), so a drain
  // that waits for it also waits for its reply to leave.
  void OnDone() override {
    TakeOver(this);
    if (admitted_) service_->calls_.Release();
    delete this;
  }

 protected:
  // Admits the call and reserves its memory, then reads the request. Called
  // once by the subclass's constructor.
  void Start() {
    // Authenticated and counted in flight (UNAVAILABLE while draining), then
    // released in OnDone once the reply has been sent.
    if (absl::Status admitted =
            service_->calls_.Admit(*context_, Draining::kRefused);
        !admitted.ok()) {
      Done(admitted);
      return;
    }
    admitted_ = true;
    const auto declared = context_->client_metadata().find(kRequestBytesHeader);
    if (declared != context_->client_metadata().end() &&
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

  // After the parse: what the call needs besides its request (its results),
  // having done what it must before it knows (a step plans). On a worker.
  virtual absl::StatusOr<int64_t> Prepare() = 0;
  // Serves the parsed call, with its memory held, and ends it with Done. On a
  // worker.
  virtual void Serve() = 0;
  // Sends the reply of a call that succeeded and finishes (Done's last step):
  // HandOff(this), then the gRPC call, and nothing after it.
  virtual void FinishOk() = 0;

  // Finishes the call: with the reply when `status` is OK. Nothing may touch
  // the reactor afterwards (OnDone deletes it).
  void Done(const absl::Status& status) {
    hold_.reset();
    if (admitted_ && !status.ok()) service_->calls_.AfterFailure();
    service_->calls_.Record(method_, status.code(), start_, request_bytes_,
                            status.ok() ? response_bytes_ : 0);
    if (status.ok()) return FinishOk();  // hands the reactor to gRPC itself
    HandOff(this);                       // OnDone runs on one of gRPC's threads
    Finish(ToGrpcStatus(status));
  }

  // Lets go of the request's bytes once they are no longer needed, rather
  // than when the reply has been sent.
  void ReleaseRequest() {
    parsed_.ReleaseBytes();
    request_.Clear();
  }

  PackServiceImpl* const service_;
  const char* const method_;
  MemoryBudget::Hold hold_;
  Wire<Request> parsed_;
  size_t response_bytes_ = 0;

 private:
  void ParseAndServe() {
    int64_t needed = 0;
    absl::Status status = Guarded(method_, [&] { return Parse(&needed); });
    if (!status.ok() || hold_ == nullptr || needed <= hold_->bytes()) {
      MemoryBudget::ShrinkTo(hold_, needed);
      if (status.ok()) return Serve();
      return Done(status);
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
          service_->calls_.Submit([this] { Serve(); });
        },
        /*first=*/true);
  }

  // Parses the request, and sets `needed` to what the call holds from now on:
  // the request, the copies of its inline inputs that arrived in several
  // slices (gathered into one buffer; those in one slice are read in place),
  // and what Prepare says (never more than the budget).
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
    PACKD_ASSIGN_OR_RETURN(const int64_t results, Prepare());
    *needed = SaturatingAdd(SaturatingAdd(static_cast<int64_t>(request_bytes_),
                                          parsed_.SplitPayloadBytes()),
                            results);
    if (service_->budget_.limit() > 0 && *needed > service_->budget_.limit()) {
      return service_->budget_.TooLarge(*needed);
    }
    return absl::OkStatus();
  }

  const absl::Time start_ = absl::Now();
  const absl::Time deadline_;
  grpc::GenericCallbackServerContext* const context_;
  int64_t declared_bytes_ = 0;
  bool admitted_ = false;
  grpc::ByteBuffer request_;
  size_t request_bytes_ = 0;
};

// One Pack or Scatter call: runs the op and answers with slices that wrap the
// result buffers and the reservation.
template <typename Request, typename Response>
class InlineCall final : public BudgetedCall<Request> {
 public:
  using Reply = PackServiceImpl::CallReply<Response>;
  // The handler (RunPack, RunScatter), as a plain function of the service.
  using Work = absl::Status (*)(PackServiceImpl* service, const Wire<Request>&,
                                Reply*);

  InlineCall(PackServiceImpl* service,
             grpc::GenericCallbackServerContext* context, const char* method,
             Work work)
      : BudgetedCall<Request>(service, context, method), work_(work) {
    this->Start();
  }

 private:
  // Its inline results, sized exactly (never more than a response may
  // carry).
  absl::StatusOr<int64_t> Prepare() override {
    return std::min(ResultBytes(this->parsed_),
                    this->service_->options_.max_message_bytes);
  }

  void Serve() override {
    this->Done(Guarded(this->method_, [this] { return Run(); }));
  }

  void FinishOk() override {
    HandOff(this);  // OnDone runs on one of gRPC's threads
    this->StartWriteAndFinish(&response_, grpc::WriteOptions(),
                              grpc::Status::OK);
  }

  // Runs the op and makes the response.
  absl::Status Run() {
    // Owned by the slices of the reply until gRPC has sent them, with the
    // call's share of the budget.
    auto reply = std::make_shared<Reply>();
    reply->hold = std::move(this->hold_);
    absl::Status done = work_(this->service_, this->parsed_, reply.get());
    this->ReleaseRequest();
    PACKD_RETURN_IF_ERROR(done);
    const Spliced spliced = reply->response.Serialize();
    // From now on the call holds its reply alone: the rest of its share goes
    // back to the budget for the calls waiting.
    MemoryBudget::ShrinkTo(reply->hold, spliced.size());
    PACKD_RETURN_IF_ERROR(
        this->service_->decoder_.CheckSize("response", spliced.size()));
    response_ = ToByteBuffer(spliced, reply);
    this->response_bytes_ = spliced.size();
    return absl::OkStatus();
  }

  const Work work_;
  grpc::ByteBuffer response_;
};

// One PackMicroBatches call (docs/design.md §12): the step made once its
// request is parsed (TrainingStep: measured and planned), then the plan and
// one message per micro-batch, written in order. Micro-batch n + 1 is packed
// on a worker while n is being sent, and no further: the call holds at most
// two packed micro-batches (the one gRPC is writing and the next), so a slow
// reader holds the server to that, and its reservation covers it.
class StepCall final : public BudgetedCall<v1::PackMicroBatchesRequest> {
 public:
  StepCall(PackServiceImpl* service,
           grpc::GenericCallbackServerContext* context)
      : BudgetedCall(service, context, "PackMicroBatches") {
    Start();
  }

  void OnWriteDone(bool ok) override {
    TakeOver(this);
    std::optional<absl::Status> finish;
    bool write = false, prepare = false;
    std::unique_ptr<Message> written;  // let go of once unlocked
    {
      absl::MutexLock lock(&mu_);
      written = std::move(current_);
      writing_ = false;
      if (!ok && failure_.ok()) {
        failure_ = absl::CancelledError(
            "the PackMicroBatches stream ended before every micro-batch was "
            "sent");
      }
      if (!failure_.ok() || (pending_ == nullptr && next_ == messages_)) {
        // Failed, or every message is written: done once no packing runs.
        if (!preparing_) finish = failure_;
      } else if (pending_ != nullptr) {
        current_ = std::move(pending_);
        writing_ = write = true;
        prepare = preparing_ = next_ < messages_;
      }
    }
    if (finish.has_value()) return Done(*finish);
    if (write) Write();
    if (prepare) service_->calls_.Submit([this] { PrepareNext(); });
  }

 private:
  absl::StatusOr<int64_t> Prepare() override {
    PACKD_ASSIGN_OR_RETURN(
        step_, TrainingStep::Make(parsed_, service_->decoder_,
                                  service_->options_.max_message_bytes));
    messages_ = step_->size() + 1;
    return SaturatingMul(2, step_->max_micro_batch_bytes());
  }

  void Serve() override {
    if (service_->options_.testing_call_hook) {
      service_->options_.testing_call_hook(method_);
    }
    {
      absl::MutexLock lock(&mu_);
      preparing_ = true;
    }
    PrepareNext();
  }

  void FinishOk() override {
    HandOff(this);  // OnDone runs on one of gRPC's threads
    Finish(grpc::Status::OK);
  }

  // Makes message next_ (0: the plan), then writes it, or leaves it pending
  // while the previous one is written; goes on to the next while nothing is
  // pending. On a worker.
  void PrepareNext() {
    while (true) {
      size_t k = 0;
      {
        absl::MutexLock lock(&mu_);
        k = next_++;
      }
      auto message = std::make_unique<Message>();
      absl::Status made =
          Guarded(method_, [&] { return Make(k, message.get()); });
      std::optional<absl::Status> finish;
      bool write = false, more = false;
      {
        absl::MutexLock lock(&mu_);
        if (!made.ok() && failure_.ok()) failure_ = made;
        if (!failure_.ok()) {
          preparing_ = false;
          if (!writing_) finish = failure_;
        } else if (writing_) {
          pending_ = std::move(message);
          preparing_ = false;
        } else {
          current_ = std::move(message);
          writing_ = write = true;
          more = next_ < messages_;
          preparing_ = more;
        }
      }
      if (finish.has_value()) return Done(*finish);
      if (write) Write();
      if (!more) return;
    }
  }

  // A message to send; one of a micro-batch counts in the metrics' gauge of
  // micro-batches held until it has been written (or dropped).
  struct Message {
    ~Message() {
      if (held != nullptr) held->HoldMicroBatches(-1);
    }
    grpc::ByteBuffer buffer;
    int64_t bytes = 0;
    Metrics* held = nullptr;
  };

  // Message k: the plan, or micro-batch k - 1 packed.
  absl::Status Make(size_t k, Message* out) {
    auto reply = std::make_shared<
        PackServiceImpl::CallReply<v1::PackMicroBatchesResponse>>();
    if (k == 0) {
      *reply->response->mutable_plan() = step_->plan();
    } else {
      PACKD_RETURN_IF_ERROR(service_->OnDevice(
          step_->device(),
          step_->PackMicroBatch(k - 1, &reply->response, &reply->buffers)));
    }
    const Spliced spliced = reply->response.Serialize();
    PACKD_RETURN_IF_ERROR(
        service_->decoder_.CheckSize("response", spliced.size()));
    out->buffer = ToByteBuffer(spliced, reply);
    out->bytes = spliced.size();
    if (k > 0) {
      out->held = &service_->metrics_;
      out->held->HoldMicroBatches(1);
    }
    return absl::OkStatus();
  }

  // Writes current_.
  void Write() {
    response_bytes_ += current_->bytes;
    HandOff(this);  // OnWriteDone runs on one of gRPC's threads
    StartWrite(&current_->buffer);
  }

  std::unique_ptr<TrainingStep> step_;
  size_t messages_ = 0;
  absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;       // the next message to make
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // current_ is being written
  bool preparing_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Message> current_;
  std::unique_ptr<Message> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerGenericBidiReactor* PackServiceImpl::InlineCalls::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  if (context->method() == "/packd.v1.PackService/Pack") {
    return new InlineCall<v1::PackRequest, v1::PackResponse>(
        service_, context, "Pack",
        [](PackServiceImpl* service, const Wire<v1::PackRequest>& request,
           PackServiceImpl::CallReply<v1::PackResponse>* reply) {
          return service->RunPack(request, reply);
        });
  }
  if (context->method() == "/packd.v1.PackService/PackMicroBatches") {
    return new StepCall(service_, context);
  }
  if (context->method() == "/packd.v1.PackService/Scatter") {
    return new InlineCall<v1::ScatterRequest, v1::ScatterResponse>(
        service_, context, "Scatter",
        [](PackServiceImpl* service, const Wire<v1::ScatterRequest>& request,
           PackServiceImpl::CallReply<v1::ScatterResponse>* reply) {
          return service->RunScatter(request, reply);
        });
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
