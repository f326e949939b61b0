#include "planner/internal/partition.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>
#include <utility>

namespace packd::planner_internal {

std::optional<std::vector<std::vector<int64_t>>> FirstFit(const Checked& c,
                                                          int64_t slots) {
  int64_t leaves = 1;
  while (leaves < slots) leaves *= 2;
  // room[leaves + b]: micro-batch b's room (the budget, less its fill; an
  // empty one takes any unit, one over the budget none); room[i]: the most
  // of its subtree. The first micro-batch with room is found from the root.
  constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> room(2 * leaves, -1);
  for (int64_t b = 0; b < slots; ++b) room[leaves + b] = kAny;
  for (int64_t i = leaves - 1; i >= 1; --i) {
    room[i] = std::max(room[2 * i], room[2 * i + 1]);
  }
  std::vector<std::vector<int64_t>> batches(slots);
  std::vector<int64_t> fill(slots, 0);
  int64_t used = 0;
  for (int64_t u = 0; u < c.units.size(); ++u) {
    const int64_t need = c.units.padded[u];
    if (room[1] < need) return std::nullopt;
    int64_t i = 1;
    while (i < leaves) i = room[2 * i] >= need ? 2 * i : 2 * i + 1;
    const int64_t b = i - leaves;
    batches[b].push_back(u);
    fill[b] += need;
    used = std::max(used, b + 1);
    room[i] = need > c.budget ? -1 : c.budget - fill[b];
    for (i /= 2; i >= 1; i /= 2) {
      room[i] = std::max(room[2 * i], room[2 * i + 1]);
    }
  }
  batches.resize(used);
  return batches;
}

Bins SplitAndDeal(const Checked& c, std::vector<std::vector<int64_t>> batches,
                  int64_t m) {
  const int64_t slots = int64_t{c.ranks} * m;
  const std::vector<double> padded = PaddedValues(c);
  std::vector<int64_t> fill;
  // The fullest micro-batch of several units first (ties: the first).
  std::priority_queue<std::pair<int64_t, int64_t>> splittable;
  auto offer = [&](int64_t b) {
    fill.resize(batches.size());
    fill[b] = 0;
    for (int64_t u : batches[b]) fill[b] += c.units.padded[u];
    if (batches[b].size() >= 2) splittable.push({fill[b], -b});
  };
  for (int64_t b = 0; b < static_cast<int64_t>(batches.size()); ++b) offer(b);
  while (static_cast<int64_t>(batches.size()) < slots && !splittable.empty()) {
    const int64_t largest = -splittable.top().second;
    splittable.pop();
    std::vector<std::vector<int64_t>> halves =
        KarmarkarKarp(padded, batches[largest], 2, /*equal_size=*/false);
    batches[largest] = std::move(halves[0]);
    batches.push_back(std::move(halves[1]));
    offer(largest);
    offer(static_cast<int64_t>(batches.size()) - 1);
  }
  batches.resize(slots);  // empty ones, when nothing is left to split
  std::vector<double> cost(slots, 0);
  for (int64_t b = 0; b < slots; ++b) {
    for (int64_t u : batches[b]) cost[b] += c.units.cost[u];
  }
  std::vector<int64_t> all(slots);
  std::iota(all.begin(), all.end(), 0);
  Bins bins;
  for (const std::vector<int64_t>& rank :
       KarmarkarKarp(cost, all, c.ranks, /*equal_size=*/true)) {
    bins.emplace_back();
    for (int64_t b : rank) bins.back().push_back(std::move(batches[b]));
  }
  return bins;
}

std::vector<std::vector<int64_t>> RanksByTokens(const Checked& c) {
  return KarmarkarKarp(PaddedValues(c), AllUnits(c), c.ranks,
                       c.units.size() % c.ranks == 0);
}

std::vector<std::vector<int64_t>> RanksByCost(const Checked& c) {
  return KarmarkarKarp(c.units.cost, AllUnits(c), c.ranks,
                       c.units.size() % c.ranks == 0);
}

std::optional<Bins> SplitByCost(const Checked& c,
                                const std::vector<std::vector<int64_t>>& ranks,
                                int64_t m) {
  Bins bins;
  for (const std::vector<int64_t>& rank : ranks) {
    bins.push_back(KarmarkarKarp(c.units.cost, rank, m, /*equal_size=*/false));
    for (const std::vector<int64_t>& b : bins.back()) {
      int64_t fill = 0;
      for (int64_t u : b) fill += c.units.padded[u];
      if (!KeepsCap(c, fill, b.size())) return std::nullopt;
    }
  }
  return bins;
}

std::vector<std::vector<int64_t>> KarmarkarKarp(
    absl::Span<const double> value, const std::vector<int64_t>& items,
    int64_t k, bool equal_size) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<std::pair<double, int64_t>> keyed(n);
  for (int64_t j = 0; j < n; ++j) keyed[j] = {value[items[j]], items[j]};
  std::sort(keyed.begin(), keyed.end());
  // A set: its sum and a list of positions in `keyed`, linked by `next`.
  struct Set {
    double sum;
    int64_t head, tail;
  };
  // A partial solution's non-empty sets, heaviest first (the other k -
  // size() are empty), kept apart from the heap, which holds only what it
  // orders by: the spread, the heaviest sum, the solution's age.
  std::vector<std::vector<Set>> solutions;
  struct Entry {
    double spread, heaviest;
    int64_t id;    // breaks ties, the oldest first, so the order is total
    int64_t slot;  // its sets: solutions[slot]
  };
  // The heap's top: the largest spread, then the heaviest set, then the
  // oldest solution.
  auto lower = [](const Entry& a, const Entry& b) {
    if (a.spread != b.spread) return a.spread < b.spread;
    if (a.heaviest != b.heaviest) return a.heaviest < b.heaviest;
    return a.id > b.id;
  };
  auto entry_of = [&](const std::vector<Set>& sets, int64_t id, int64_t slot) {
    const double lightest =
        static_cast<int64_t>(sets.size()) < k ? 0 : sets.back().sum;
    return Entry{sets.front().sum - lightest, sets.front().sum, id, slot};
  };
  auto heavier = [](const Set& a, const Set& b) {
    return a.sum != b.sum ? a.sum > b.sum : a.head < b.head;
  };
  std::vector<int64_t> next(n, -1);
  std::vector<Entry> heap;
  // Items entering one by one wait in `keyed` rather than the heap: the
  // first `singles` positions, which leave heaviest first (an item's spread
  // is its value), the last one the oldest.
  int64_t singles = 0, ids = n;
  if (equal_size && k > 1) {
    for (int64_t at = 0; at < n; at += k) {
      std::vector<Set> sets;
      for (int64_t j = at; j < at + k && j < n; ++j) {
        sets.push_back({keyed[j].first, j, j});
      }
      std::sort(sets.begin(), sets.end(), heavier);
      heap.push_back(entry_of(sets, ids++, solutions.size()));
      solutions.push_back(std::move(sets));
    }
    std::make_heap(heap.begin(), heap.end(), lower);
  } else {
    singles = n;
  }
  auto single = [&](int64_t j) {
    return entry_of({{keyed[j].first, j, j}}, n - 1 - j, -1);
  };
  // The slot of the next solution to merge.
  auto take = [&]() {
    if (singles > 0 &&
        (heap.empty() || lower(heap.front(), single(singles - 1)))) {
      --singles;
      solutions.push_back({{keyed[singles].first, singles, singles}});
      return static_cast<int64_t>(solutions.size()) - 1;
    }
    std::pop_heap(heap.begin(), heap.end(), lower);
    const int64_t slot = heap.back().slot;
    heap.pop_back();
    return slot;
  };
  std::vector<Set> touched;
  while (static_cast<int64_t>(heap.size()) + singles > 1) {
    const int64_t into = take();
    std::vector<Set> b = std::move(solutions[take()]);
    std::vector<Set>& merged = solutions[into];
    // Set j of the merge: a's j-th heaviest with b's (k-1-j)-th. a's sets
    // before k - nb are untouched, still heaviest first; only those from
    // there on (b's sets, and a's they join) need sorting before the two
    // runs are merged, in place, from the lightest end.
    const int64_t na = static_cast<int64_t>(merged.size());
    const int64_t nb = static_cast<int64_t>(b.size());
    const int64_t untouched = std::min(na, k - nb);
    touched.clear();
    for (int64_t j = k - nb; j < k; ++j) {
      Set t = b[k - 1 - j];
      if (j < na) {
        Set s = merged[j];
        s.sum += t.sum;
        next[s.tail] = t.head;
        s.tail = t.tail;
        t = s;
      }
      touched.push_back(t);
    }
    std::sort(touched.begin(), touched.end(), heavier);
    merged.resize(untouched + nb);
    int64_t i = untouched - 1, t = nb - 1;
    for (int64_t out = untouched + nb - 1; t >= 0; --out) {
      if (i >= 0 && heavier(touched[t], merged[i])) {
        merged[out] = merged[i--];
      } else {
        merged[out] = touched[t--];
      }
    }
    heap.push_back(entry_of(merged, ids++, into));  // the youngest
    std::push_heap(heap.begin(), heap.end(), lower);
  }
  std::vector<std::vector<int64_t>> out(k);
  if (n == 0) return out;
  const std::vector<Set>& last = singles == 1
                                     ? std::vector<Set>{{keyed[0].first, 0, 0}}
                                     : solutions[heap.front().slot];
  for (size_t s = 0; s < last.size(); ++s) {
    for (int64_t at = last[s].head; at >= 0; at = next[at]) {
      out[s].push_back(keyed[at].second);
    }
  }
  return out;
}

}  // namespace packd::planner_internal
