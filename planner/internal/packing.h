// A packing under way (the planner's units in the micro-batches of each rank,
// with their sums) and the constructions that make one: the greedy packings
// by cost or tokens, the Karmarkar-Karp partition packed first fit, and
// empty micro-batches filled. Not API: planner.h is.
//
// clang-format off
//   Packing p(c, m);
//   if (Greedy(c, Descending(c, /*by_cost=*/true), m, /*by_cost=*/true, &p))
//     FillEmpty(&p);
// clang-format on
#ifndef PACKD_PLANNER_INTERNAL_PACKING_H_
#define PACKD_PLANNER_INTERNAL_PACKING_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "planner/internal/units.h"

namespace packd::planner_internal {

using Slot = std::pair<int32_t, int64_t>;  // (rank, micro-batch)

// A packing under way: the units of each micro-batch of each rank, with
// every micro-batch's padded tokens and cost, and every rank's cost.
struct Packing {
  Packing(const Checked& checked, int64_t m)
      : c(&checked),
        bins(checked.ranks, std::vector<std::vector<int64_t>>(m)),
        fill(checked.ranks, std::vector<int64_t>(m, 0)),
        cost(checked.ranks, std::vector<double>(m, 0)),
        rank_cost(checked.ranks, 0),
        rank_fill(checked.ranks, 0) {}

  int64_t m() const { return static_cast<int64_t>(bins[0].size()); }
  int64_t units(int32_t r, int64_t b) const {
    return static_cast<int64_t>(bins[r][b].size());
  }
  bool Fits(int32_t r, int64_t b, int64_t u) const {
    return KeepsCap(*c, fill[r][b] + c->units.padded[u], bins[r][b].size() + 1);
  }
  void Put(int32_t r, int64_t b, int64_t u) {
    bins[r][b].push_back(u);
    Account(r, b, u, +1);
  }
  // Removes the unit at `pos` of micro-batch (r, b) and returns it.
  int64_t Take(int32_t r, int64_t b, int64_t pos) {
    std::vector<int64_t>& bin = bins[r][b];
    const int64_t u = bin[pos];
    bin.erase(bin.begin() + pos);
    Account(r, b, u, -1);
    return u;
  }
  void Account(int32_t r, int64_t b, int64_t u, int sign) {
    fill[r][b] += sign * c->units.padded[u];
    rank_fill[r] += sign * c->units.padded[u];
    cost[r][b] += sign * c->units.cost[u];
    rank_cost[r] += sign * c->units.cost[u];
  }
  double MaxRankCost() const {
    return *std::max_element(rank_cost.begin(), rank_cost.end());
  }

  const Checked* c;
  Bins bins;
  std::vector<std::vector<int64_t>> fill;
  std::vector<std::vector<double>> cost;
  std::vector<double> rank_cost;
  std::vector<int64_t> rank_fill;
};

// A min-heap of (key, id) in a vector: the order of a std::set without a
// node per change. First(ok) takes out the least entry ok accepts, putting
// back those it passed.
template <typename Key>
class MinHeap {
 public:
  void Push(Key key) {
    heap_.push_back(key);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
  }
  template <typename Ok>
  std::optional<Key> First(Ok ok) {
    std::optional<Key> found;
    passed_.clear();
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
      Key top = heap_.back();
      heap_.pop_back();
      if (ok(top)) {
        found = top;
        break;
      }
      passed_.push_back(top);
    }
    for (const Key& k : passed_) Push(k);
    return found;
  }

 private:
  std::vector<Key> heap_, passed_;
};

// The units of `units`, sorted costliest first (ties: the most padded
// tokens, then the lowest index), or with by_cost false, most padded tokens
// first (ties: the costliest). Sorted by value, not through the units'
// arrays: the largest batches sort 65,536 units several times.
void SortDescending(const Checked& c, bool by_cost,
                    std::vector<int64_t>* units);
// Every unit, in that order.
std::vector<int64_t> Descending(const Checked& c, bool by_cost);

// Longest processing time first: units in `order` (Descending(c, by_cost)),
// each to the cheapest rank (or the one with the fewest tokens) that has
// room, into its fullest micro-batch the unit fits (which keeps room for what
// follows). False when some unit fits nowhere.
bool Greedy(const Checked& c, const std::vector<int64_t>& order, int64_t m,
            bool by_cost, Packing* p);

// The ranks of a Karmarkar-Karp partition by cost, each packed first fit
// decreasing (by padded tokens) into m micro-batches; the units a rank cannot
// hold then go, costliest first, to the cheapest rank with room. False when
// one fits nowhere.
bool Differenced(const Checked& c,
                 const std::vector<std::vector<int64_t>>& partition, int64_t m,
                 Packing* p);

// The packing of `bins` (units per micro-batch, of each rank).
Packing PackingOf(const Checked& c, const Bins& bins);

// Fills empty micro-batches while others hold several units: first from the
// same rank (rank costs unchanged), then from any rank. A moved unit comes
// from a micro-batch of several, so it is within the budget.
void FillEmpty(Packing* p);

// Whether a is a better packing than b (same micro-batches per rank): a
// smaller largest rank cost, then fewer padded tokens on the fullest rank.
bool Better(const Packing& a, const Packing& b);

}  // namespace packd::planner_internal

#endif  // PACKD_PLANNER_INTERNAL_PACKING_H_
