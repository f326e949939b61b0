// PackScatterReactor: one Pack or Scatter call, admitted by the memory budget
// before its request is read (BudgetedReactor), run on packd's workers by its
// handler, and answered with slices that wrap the result buffers and the call's
// share of the budget.
//
// clang-format off
//   return new PackScatterReactor<v1::PackRequest, v1::PackResponse>(&env, context, "Pack", work);
// clang-format on
#ifndef PACKD_SERVER_PACK_SCATTER_REACTOR_H_
#define PACKD_SERVER_PACK_SCATTER_REACTOR_H_

#include <grpcpp/generic/async_generic_service.h>

#include <functional>

#include "absl/status/status.h"
#include "proto/wire.h"
#include "server/budgeted_reactor.h"
#include "service/call_spec.h"
#include "service/pack_reply.h"

namespace packd {

// Used by gRPC and packd's workers in turn, as BudgetedReactor.
template <typename Request, typename Response>
class PackScatterReactor final : public BudgetedReactor<Request> {
 public:
  // The handler: the op of a parsed request (whose spec Prepare made), its
  // response and results put in the reply.
  using Work = std::function<absl::Status(const Wire<Request>&, const CallSpec&,
                                          CallReply<Response>*)>;

  PackScatterReactor(const ReactorEnvironment* env,
                     grpc::GenericCallbackServerContext* context,
                     const char* method, Work work);

 private:
  // Its inline results, sized exactly (never more than a response may carry).
  absl::StatusOr<int64_t> Prepare() override;
  bool MayBeSmall(size_t request_bytes) const override;
  bool Small() const override;
  void Serve() override;
  void FinishOk() override;
  // Runs the op and makes the response.
  absl::Status Run();

  const Work work_;
  // The request's headers, layout and sizes, made once by Prepare.
  CallSpec spec_;
  grpc::ByteBuffer response_;
};

}  // namespace packd

#endif  // PACKD_SERVER_PACK_SCATTER_REACTOR_H_
