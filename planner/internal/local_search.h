// The planner's local search (docs/operation.md, "Micro-batch planning"):
// moves of a unit between ranks, swaps of a unit of each and, where the cap
// leaves no room, one unit for two, each keeping the cap and leaving no
// micro-batch empty; first across ranks (the largest rank cost lowered),
// then within each rank. Not API: planner.h is.
//
//   int64_t work = kSearchWork;
//   BalanceRanks(&packing, &work);
#ifndef PACKD_PLANNER_INTERNAL_LOCAL_SEARCH_H_
#define PACKD_PLANNER_INTERNAL_LOCAL_SEARCH_H_

#include <cstdint>

#include "planner/internal/packing.h"

namespace packd::planner_internal {

// Lowers the largest rank cost: a move of a unit from the costliest rank to
// another, or a swap of a unit of each, the change that brings the two
// closest (else a swap of one unit for two); the other ranks tried cheapest
// first. Stops when the costliest rank gains from none, or `work` (units
// compared) is spent.
void BalanceRanks(Packing* p, int64_t* work);

// Balances the micro-batches within each rank (the rank costs do not
// change): a repacking by cost, then changes between the costliest and the
// cheapest micro-batch while they narrow the gap, within `work`.
void BalanceWithinRanks(Packing* p, int64_t* work);

}  // namespace packd::planner_internal

#endif  // PACKD_PLANNER_INTERNAL_LOCAL_SEARCH_H_
