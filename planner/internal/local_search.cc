#include "planner/internal/local_search.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace packd::planner_internal {
namespace {

// The least gain, relative to the cost it lowers, that a change of the local
// search must bring: below it, costs are level to within rounding noise.
constexpr double kLeastGain = 1e-12;

// The most units of a rank that the search for one-for-two swaps takes.
constexpr size_t kMostPairPartners = 512;

// Ranks by cost.
using RankOrder = std::set<std::pair<double, int32_t>>;

RankOrder OrderOf(const Packing& p) {
  RankOrder order;
  for (int32_t r = 0; r < p.c->ranks; ++r) order.insert({p.rank_cost[r], r});
  return order;
}

// A move (to_pos < 0) of a unit from micro-batch `from` to `to`, or a swap
// of a unit of each; d is the cost it takes from the costlier side.
struct Change {
  int32_t from_rank;
  int64_t from_bin, from_pos;
  int32_t to_rank;
  int64_t to_bin, to_pos;
  double d;
  // With a second unit of `to`: the unit from `from` is swapped for two.
  int64_t to_bin2 = -1, to_pos2 = -1;
};

void Apply(const Change& ch, Packing* p) {
  const int64_t a = p->Take(ch.from_rank, ch.from_bin, ch.from_pos);
  if (ch.to_pos2 >= 0) {
    // From one micro-batch, the later position first, so the earlier one
    // stays where it is.
    const bool second_first = ch.to_bin2 == ch.to_bin && ch.to_pos2 > ch.to_pos;
    int64_t b1, b2;
    if (second_first) {
      b2 = p->Take(ch.to_rank, ch.to_bin2, ch.to_pos2);
      b1 = p->Take(ch.to_rank, ch.to_bin, ch.to_pos);
    } else {
      b1 = p->Take(ch.to_rank, ch.to_bin, ch.to_pos);
      b2 = p->Take(ch.to_rank, ch.to_bin2, ch.to_pos2);
    }
    p->Put(ch.from_rank, ch.from_bin, b1);
    p->Put(ch.from_rank, ch.from_bin, b2);
    p->Put(ch.to_rank, ch.to_bin, a);
    return;
  }
  if (ch.to_pos >= 0) {
    p->Put(ch.from_rank, ch.from_bin,
           p->Take(ch.to_rank, ch.to_bin, ch.to_pos));
  }
  p->Put(ch.to_rank, ch.to_bin, a);
}

// A unit of the cheaper side of a change, with its place, in cost order.
struct Partner {
  double cost;
  int64_t unit;
  Slot slot;
  int64_t pos;
  bool operator<(const Partner& o) const {
    return cost != o.cost ? cost < o.cost : unit < o.unit;
  }
};

// The units of the micro-batches `to`, sorted by cost, and the emptiest of
// them (the least padded tokens, then the fewest units): what a change
// into `to` searches.
std::vector<Partner> PartnersOf(const Packing& p, const std::vector<Slot>& to,
                                Slot* emptiest, int64_t* work) {
  std::vector<Partner> partners;
  *emptiest = to[0];
  auto load = [&](Slot s) {
    return std::make_pair(p.fill[s.first][s.second],
                          p.bins[s.first][s.second].size());
  };
  for (Slot t : to) {
    const std::vector<int64_t>& bin = p.bins[t.first][t.second];
    for (int64_t j = 0; j < static_cast<int64_t>(bin.size()); ++j) {
      partners.push_back({p.c->units.cost[bin[j]], bin[j], t, j});
    }
    if (load(t) < load(*emptiest)) *emptiest = t;
  }
  std::sort(partners.begin(), partners.end());
  *work -= static_cast<int64_t>(partners.size()) + 1;
  return partners;
}

// The partners b with tol < base - c_b < gap - tol that `feasible`
// accepts, nearest base - gap / 2 (where d = base - c_b halves the gap): the
// first feasible one outward in each direction is that direction's best, so
// each direction stops at it; `consider(b, d)` hears both. `skip` is a
// position of `partners` not to take.
template <typename Feasible, typename Consider>
void SearchOutward(const std::vector<Partner>& partners, double base,
                   double gap, double tol, int64_t skip, int64_t* work,
                   Feasible feasible, Consider consider) {
  const auto mid = std::lower_bound(partners.begin(), partners.end(),
                                    Partner{base - gap / 2, -1, {0, 0}, 0});
  *work -= 16;
  for (auto it = mid; it != partners.end(); ++it) {  // d <= gap / 2
    const double d = base - it->cost;
    if (d <= tol) break;
    --*work;
    if (it - partners.begin() != skip && d < gap - tol && feasible(*it)) {
      consider(*it, d);
      break;
    }
  }
  for (auto it = mid; it != partners.begin();) {  // d > gap / 2
    --it;
    const double d = base - it->cost;
    if (d >= gap - tol) break;
    --*work;
    if (it - partners.begin() != skip && d > tol && feasible(*it)) {
      consider(*it, d);
      break;
    }
  }
}

// The change between the micro-batches `from` (of the costlier side) and
// `to`, `gap` apart, that brings the two sides closest together, keeping
// the cap and leaving no micro-batch empty; none when every change would
// leave the larger side no smaller than now (by more than `tol`). A move
// of a unit a takes c_a: it goes to the emptiest of `to`, which holds it if
// any does. A swap with b takes c_a - c_b: `to`'s units sorted by cost,
// each a looks for b nearest c_a - gap / 2, outward in both directions, so
// the result is that of comparing every pair, at a fraction of the work.
std::optional<Change> BestChange(const Packing& p,
                                 const std::vector<Slot>& from,
                                 const std::vector<Slot>& to, double gap,
                                 double tol, int64_t* work) {
  const Units& units = p.c->units;
  Slot emptiest;
  const std::vector<Partner> partners = PartnersOf(p, to, &emptiest, work);
  const std::vector<int64_t>& ebin = p.bins[emptiest.first][emptiest.second];
  const int64_t efill = p.fill[emptiest.first][emptiest.second];
  std::optional<Change> best;
  auto consider = [&](double d, Slot f, int64_t fi, Slot t, int64_t ti) {
    if (!best || std::abs(gap - 2 * d) < std::abs(gap - 2 * best->d)) {
      best = Change{f.first, f.second, fi, t.first, t.second, ti, d};
    }
  };
  for (Slot f : from) {
    const std::vector<int64_t>& fbin = p.bins[f.first][f.second];
    const int64_t ffill = p.fill[f.first][f.second];
    for (int64_t fi = 0; fi < static_cast<int64_t>(fbin.size()); ++fi) {
      const double ca = units.cost[fbin[fi]];
      const int64_t pa = units.padded[fbin[fi]];
      if (ca <= tol) continue;
      if (fbin.size() >= 2 && ca < gap - tol &&
          KeepsCap(*p.c, efill + pa, ebin.size() + 1)) {
        consider(ca, f, fi, emptiest, -1);
      }
      SearchOutward(
          partners, ca, gap, tol, -1, work,
          [&](const Partner& b) {
            const int64_t pb = units.padded[b.unit];
            return KeepsCap(*p.c, ffill - pa + pb, fbin.size()) &&
                   KeepsCap(*p.c, p.fill[b.slot.first][b.slot.second] - pb + pa,
                            p.bins[b.slot.first][b.slot.second].size());
          },
          [&](const Partner& b, double d) {
            consider(d, f, fi, b.slot, b.pos);
          });
    }
  }
  return best;
}

// Where no move or swap helps (the cap full on both sides), a unit a of
// `from` swapped for two units of `to` (micro-batches of one rank) that
// together cost less and fit where a was: the pair (b1, b2) with c_a - c_b1
// - c_b2 nearest gap / 2, b2 searched as BestChange searches b.
std::optional<Change> BestPairChange(const Packing& p,
                                     const std::vector<Slot>& from,
                                     const std::vector<Slot>& to, double gap,
                                     double tol, int64_t* work) {
  // Quadratic in the units of `to`: for ranks of a few hundred, where the
  // cap binds hardest (large batches spread over many units level by
  // swaps).
  size_t count = 0;
  for (Slot t : to) count += p.bins[t.first][t.second].size();
  if (count > kMostPairPartners) return std::nullopt;
  const Units& units = p.c->units;
  Slot emptiest;
  const std::vector<Partner> partners = PartnersOf(p, to, &emptiest, work);
  std::optional<Change> best;
  for (Slot f : from) {
    if (*work <= 0) break;
    const std::vector<int64_t>& fbin = p.bins[f.first][f.second];
    const int64_t ffill = p.fill[f.first][f.second];
    for (int64_t fi = 0; fi < static_cast<int64_t>(fbin.size()); ++fi) {
      const double ca = units.cost[fbin[fi]];
      const int64_t pa = units.padded[fbin[fi]];
      *work -= 16 * static_cast<int64_t>(partners.size());
      for (size_t i = 0; i < partners.size(); ++i) {
        const Partner& b1 = partners[i];
        if (ca - b1.cost <= tol) break;  // the rest cost more
        const int64_t p1 = units.padded[b1.unit];
        const std::vector<int64_t>& bin1 =
            p.bins[b1.slot.first][b1.slot.second];
        const int64_t fill1 = p.fill[b1.slot.first][b1.slot.second];
        auto feasible = [&](const Partner& b2) {
          const int64_t p2 = units.padded[b2.unit];
          if (!KeepsCap(*p.c, ffill - pa + p1 + p2, fbin.size() + 1)) {
            return false;
          }
          if (b2.slot == b1.slot) {
            return KeepsCap(*p.c, fill1 - p1 - p2 + pa, bin1.size() - 1);
          }
          return p.bins[b2.slot.first][b2.slot.second].size() >= 2 &&
                 KeepsCap(*p.c, fill1 - p1 + pa, bin1.size());
        };
        auto consider = [&](const Partner& b2, double d) {
          if (!best || std::abs(gap - 2 * d) < std::abs(gap - 2 * best->d)) {
            best = Change{f.first,        f.second, fi, b1.slot.first,
                          b1.slot.second, b1.pos,   d,  b2.slot.second,
                          b2.pos};
          }
        };
        // d = ca - c_b1 - c_b2: b2 searched as a swap's partner of base
        // ca - c_b1.
        SearchOutward(partners, ca - b1.cost, gap, tol, static_cast<int64_t>(i),
                      work, feasible, consider);
      }
    }
  }
  return best;
}

std::vector<Slot> SlotsOf(const Packing& p, int32_t r) {
  std::vector<Slot> slots;
  for (int64_t b = 0; b < p.m(); ++b) slots.push_back({r, b});
  return slots;
}

// Rank r's units repacked into its micro-batches, costliest first, each into
// the cheapest micro-batch it fits (ties: the one of fewer units); kept only
// when every unit fits and no micro-batch is left empty that was not.
void RepackRank(Packing* p, int32_t r) {
  const int64_t m = p->m();
  std::vector<int64_t> units;
  int64_t empty = 0;
  for (int64_t b = 0; b < m; ++b) {
    units.insert(units.end(), p->bins[r][b].begin(), p->bins[r][b].end());
    empty += p->bins[r][b].empty();
  }
  SortDescending(*p->c, /*by_cost=*/true, &units);
  const Units& u = p->c->units;
  std::vector<std::vector<int64_t>> bins(m);
  std::vector<int64_t> fill(m, 0);
  std::vector<double> cost(m, 0);
  // Micro-batches cheapest first (ties: fewer units, then the first).
  MinHeap<std::tuple<double, size_t, int64_t>> cheapest;
  for (int64_t b = 0; b < m; ++b) cheapest.Push({0.0, size_t{0}, b});
  for (int64_t unit : units) {
    const auto slot = cheapest.First([&](const auto& e) {
      const int64_t b = std::get<2>(e);
      return KeepsCap(*p->c, fill[b] + u.padded[unit], bins[b].size() + 1);
    });
    if (!slot) return;
    const int64_t b = std::get<2>(*slot);
    bins[b].push_back(unit);
    fill[b] += u.padded[unit];
    cost[b] += u.cost[unit];
    cheapest.Push({cost[b], bins[b].size(), b});
  }
  int64_t now_empty = 0;
  for (const auto& bin : bins) now_empty += bin.empty();
  if (now_empty > empty) return;
  p->bins[r] = std::move(bins);
  p->fill[r] = std::move(fill);
  p->cost[r] = std::move(cost);
}

}  // namespace

void BalanceRanks(Packing* p, int64_t* work) {
  if (p->c->ranks < 2) return;
  RankOrder order = OrderOf(*p);
  while (*work > 0) {
    const auto [high, h] = *order.rbegin();
    const double tol = high * kLeastGain;
    bool changed = false;
    for (auto it = order.begin(); it != order.end() && *work > 0; ++it) {
      const auto [low, l] = *it;
      // No change gains tol where the gap is under twice that; nor with
      // the ranks after, which are costlier.
      if (l == h || high - low < 2 * tol) break;
      const std::vector<Slot> from = SlotsOf(*p, h), to = SlotsOf(*p, l);
      std::optional<Change> ch =
          BestChange(*p, from, to, high - low, tol, work);
      if (!ch) ch = BestPairChange(*p, from, to, high - low, tol, work);
      if (!ch) continue;
      order.erase(std::prev(order.end()));
      order.erase(it);
      Apply(*ch, p);
      order.insert({p->rank_cost[h], h});
      order.insert({p->rank_cost[l], l});
      changed = true;
      break;
    }
    if (!changed) return;
  }
}

void BalanceWithinRanks(Packing* p, int64_t* work) {
  if (p->m() < 2) return;
  for (int32_t r = 0; r < p->c->ranks; ++r) {
    int64_t units = 0;
    for (int64_t b = 0; b < p->m(); ++b) units += p->units(r, b);
    if (units < 2) continue;
    RepackRank(p, r);
    // A share of the work for each rank, so the last are balanced too.
    int64_t share = std::max<int64_t>(*work / (p->c->ranks - r), 4 * units);
    *work -= share;
    while (share > 0) {
      const auto& cost = p->cost[r];
      const int64_t hb =
          std::max_element(cost.begin(), cost.end()) - cost.begin();
      const int64_t lb =
          std::min_element(cost.begin(), cost.end()) - cost.begin();
      const double gap = cost[hb] - cost[lb];
      std::optional<Change> ch = BestChange(*p, {{r, hb}}, {{r, lb}}, gap,
                                            cost[hb] * kLeastGain, &share);
      if (!ch) break;
      Apply(*ch, p);
    }
  }
}

}  // namespace packd::planner_internal
