// CheckPlan: whether a plan keeps every rule of PlanMicroBatches
// (planner/planner.h) for its inputs, for the tests and benchmarks that hold
// packd's plans, and its peers', to them. Not linked by packd.
//
//   EXPECT_TRUE(CheckPlan(*plan, lengths, loss_tokens, options).ok());
#ifndef PACKD_PLANNER_TESTING_CHECK_PLAN_H_
#define PACKD_PLANNER_TESTING_CHECK_PLAN_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "planner/planner.h"

namespace packd {

// OK when `plan` keeps every rule of PlanMicroBatches for these inputs;
// INTERNAL saying which rule it breaks otherwise; the request's own
// INVALID_ARGUMENT when the inputs are not a valid request.
absl::Status CheckPlan(const Plan& plan, absl::Span<const int64_t> lengths,
                       absl::Span<const int64_t> loss_tokens,
                       const PlanOptions& options);

}  // namespace packd

#endif  // PACKD_PLANNER_TESTING_CHECK_PLAN_H_
