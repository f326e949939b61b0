#include "server/budgeted_reactor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/tsan.h"
#include "kernels/pack_sizes.h"
#include "packd/v1/pack_service.pb.h"

namespace packd {
namespace {

// When a call waiting in the memory budget gives up: a little before the
// caller's deadline, so that it hears RESOURCE_EXHAUSTED from packd rather
// than its own DEADLINE_EXCEEDED.
absl::Time BudgetDeadline(const grpc::GenericCallbackServerContext* context) {
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline < absl::InfiniteFuture()) {
    deadline -= std::min(absl::Milliseconds(200), (deadline - absl::Now()) / 5);
  }
  return deadline;
}

// What a call reserves before its request is read: the most a request of
// `declared` bytes (0: the largest) can make it hold, or the whole budget. A
// call needs at most three times its request: the request, its inputs
// gathered, and results (Pack's are no larger than its inputs; Scatter's may
// need more, and wait for it once parsed). Without a declared size the
// request may be up to --max_message_bytes (gRPC accepts up to twice that,
// which three times still covers, and packd refuses it before any copy).
int64_t AdmissionBytes(const ReactorEnvironment& env, int64_t declared) {
  const int64_t limit = env.budget->share();
  if (limit <= 0) return 0;
  const int64_t request = declared > 0 ? declared : env.max_message_bytes;
  return std::min(limit, SaturatingMul(3, request));
}

}  // namespace

template <typename Request>
BudgetedReactor<Request>::BudgetedReactor(
    const ReactorEnvironment* env, grpc::GenericCallbackServerContext* context,
    const char* method)
    : env_(*env),
      method_(method),
      deadline_(BudgetDeadline(context)),
      context_(context) {}

template <typename Request>
void BudgetedReactor<Request>::OnReadDone(bool ok) {
  TakeOver(this);
  if (!ok) {
    Done(absl::CancelledError(absl::StrCat(
        "the ", method_, " call ended before its request arrived")));
    return;
  }
  // A request that can be a small call's is parsed here: a small call runs
  // on this thread (docs/design.md §2). Every other runs on packd's workers.
  if (MayBeSmall(request_.Length())) return ParseAndServe(/*may_stay=*/true);
  env_.calls->Submit([this] { ParseAndServe(/*may_stay=*/false); });
}

template <typename Request>
void BudgetedReactor<Request>::OnDone() {
  TakeOver(this);
  if (admitted_) env_.calls->Release();
  delete this;
}

template <typename Request>
void BudgetedReactor<Request>::Start() {
  // Authenticated and counted in flight (UNAVAILABLE while draining), then
  // released in OnDone once the reply has been sent.
  absl::StatusOr<Tenant> admitted =
      env_.calls->Admit(*context_, Draining::kRefused);
  if (!admitted.ok()) {
    Done(admitted.status());
    return;
  }
  admitted_ = true;
  tenant_ = *std::move(admitted);
  const auto declared = context_->client_metadata().find(kRequestBytesHeader);
  if (declared != context_->client_metadata().end() &&
      (!absl::SimpleAtoi(
           absl::string_view(declared->second.data(), declared->second.size()),
           &declared_bytes_) ||
       declared_bytes_ <= 0)) {
    Done(absl::InvalidArgumentError(
        absl::StrCat(kRequestBytesHeader, " must be a positive number")));
    return;
  }
  // A request declared too large is refused before it is read.
  if (absl::Status size = env_.decoder->CheckSize("request", declared_bytes_);
      !size.ok()) {
    Done(size);
    return;
  }
  // Waits, off gRPC's threads, until the bytes are free or the deadline.
  env_.budget->Reserve(
      AdmissionBytes(env_, declared_bytes_), deadline_,
      [this](absl::StatusOr<MemoryBudget::Hold> hold) {
        if (!hold.ok()) return Done(hold.status());
        hold_ = *std::move(hold);
        HandOff(this);  // OnReadDone runs on a gRPC thread
        StartRead(&request_);
      },
      /*first=*/false, tenant_.name);
}

template <typename Request>
void BudgetedReactor<Request>::Done(const absl::Status& status) {
  hold_.reset();
  env_.calls->End(method_, start_, status, admitted_, request_bytes_,
                  status.ok() ? response_bytes_ : 0, tenant_.name);
  if (status.ok()) return FinishOk();  // hands the reactor to gRPC itself
  HandOff(this);                       // OnDone runs on one of gRPC's threads
  Finish(ToGrpcStatus(status));
}

template <typename Request>
void BudgetedReactor<Request>::ReleaseRequest() {
  parsed_.ReleaseBytes();
  request_.Clear();
}

template <typename Request>
void BudgetedReactor<Request>::ParseAndServe(bool may_stay) {
  int64_t needed = 0;
  absl::Status status = Guarded(method_, [&] { return Parse(&needed); });
  if (!status.ok() || hold_ == nullptr || needed <= hold_->bytes()) {
    MemoryBudget::ShrinkTo(hold_, needed);
    if (!status.ok()) return Done(status);
    if (!may_stay || Small()) return Serve();
    return env_.calls->Submit([this] { Serve(); });
  }
  // Needs more than it reserved (a Scatter whose results outgrow its
  // request): it gives its reservation back and waits, ahead of calls not yet
  // read, for the whole of it, so that no two calls ever hold part of what
  // they need while waiting for the rest.
  hold_.reset();
  env_.budget->Reserve(
      needed, deadline_,
      [this](absl::StatusOr<MemoryBudget::Hold> hold) {
        if (!hold.ok()) return Done(hold.status());
        hold_ = *std::move(hold);
        // Not on the budget's thread: it grants every waiter.
        env_.calls->Submit([this] { Serve(); });
      },
      /*first=*/true, tenant_.name);
}

template <typename Request>
absl::Status BudgetedReactor<Request>::Parse(int64_t* needed) {
  request_bytes_ = request_.Length();
  PACKD_RETURN_IF_ERROR(env_.decoder->CheckSize("request", request_bytes_));
  if (declared_bytes_ > 0 &&
      static_cast<int64_t>(request_bytes_) > declared_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request has ", request_bytes_, " bytes, more than the ",
        declared_bytes_, " its ", kRequestBytesHeader, " header declared"));
  }
  PACKD_RETURN_IF_ERROR(Receive(request_, &parsed_));
  PACKD_ASSIGN_OR_RETURN(const int64_t results, Prepare());
  *needed = SaturatingAdd(SaturatingAdd(static_cast<int64_t>(request_bytes_),
                                        parsed_.SplitPayloadBytes()),
                          results);
  if (env_.budget->limit() > 0 && *needed > env_.budget->share()) {
    return env_.budget->TooLarge(*needed);
  }
  return absl::OkStatus();
}

template class BudgetedReactor<v1::PackRequest>;
template class BudgetedReactor<v1::ScatterRequest>;
template class BudgetedReactor<v1::PackMicroBatchesRequest>;

}  // namespace packd
