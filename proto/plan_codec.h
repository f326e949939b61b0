// The plan codec: packd.v1.PlanRequest to and from the planner's options, and
// a Plan into a PlanResponse (docs/design.md §9, §11). The one place a plan
// request is translated, for the server, the step and the clients.
//
// clang-format off
//   PlanOptions options = PlanOptionsOf(request);  // views request's costs and groups
//   PACKD_ASSIGN_OR_RETURN(Plan plan, PlanMicroBatches(LengthsOf(request), LossTokensOf(request), options));
//   EncodePlan(plan, &response);
// clang-format on
#ifndef PACKD_PROTO_PLAN_CODEC_H_
#define PACKD_PROTO_PLAN_CODEC_H_

#include <cstdint>

#include "absl/types/span.h"
#include "packd/v1/pack_service.pb.h"
#include "planner/planner.h"

namespace packd {

// The options of `request`: budget, ranks, multiple, cost model, costs,
// groups, pad_multiple and pipeline_order. `costs` and `groups` view the
// request's own arrays, so the request must outlive the options.
PlanOptions PlanOptionsOf(const v1::PlanRequest& request);

// Views of the request's lengths and loss tokens.
absl::Span<const int64_t> LengthsOf(const v1::PlanRequest& request);
absl::Span<const int64_t> LossTokensOf(const v1::PlanRequest& request);

// A request carrying `options` (not max_micro_batches, a server's limit, nor
// loss_tokens_within_lengths, the step's), `lengths` and `loss_tokens`.
v1::PlanRequest PlanRequestOf(const PlanOptions& options,
                              absl::Span<const int64_t> lengths,
                              absl::Span<const int64_t> loss_tokens);

// Sets every field of `response` from `plan` (after clearing it); PlanOf is
// its inverse.
void EncodePlan(const Plan& plan, v1::PlanResponse* response);
Plan PlanOf(const v1::PlanResponse& response);

}  // namespace packd

#endif  // PACKD_PROTO_PLAN_CODEC_H_
