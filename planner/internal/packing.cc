#include "planner/internal/packing.h"

#include <tuple>

namespace packd::planner_internal {
namespace {

// The fullest micro-batch of rank r that unit u fits, or -1.
int64_t FullestFit(const Packing& p, int32_t r, int64_t u) {
  const int64_t padded = p.c->units.padded[u];
  const std::vector<int64_t>& fill = p.fill[r];
  const int64_t m = static_cast<int64_t>(fill.size());
  if (padded > p.c->budget) {  // alone: the first empty micro-batch
    for (int64_t b = 0; b < m; ++b) {
      if (p.bins[r][b].empty()) return b;
    }
    return -1;
  }
  const int64_t limit = p.c->budget - padded;
  int64_t best = -1, best_fill = -1;
  for (int64_t b = 0; b < m; ++b) {
    if (fill[b] <= limit && fill[b] > best_fill) {
      best = b;
      best_fill = fill[b];
    }
  }
  return best;
}

// Ranks ordered by what a greedy packing balances, cost or padded tokens,
// for picking the least that has room.
class CheapestRanks {
 public:
  CheapestRanks(const Packing& p, bool by_cost) : by_cost_(by_cost) {
    for (int32_t r = 0; r < p.c->ranks; ++r) ranks_.Push({KeyOf(p, r), r});
  }
  // Places `u` in the least rank with room, into its fullest micro-batch the
  // unit fits. False when it fits nowhere.
  bool Place(Packing* p, int64_t u) {
    int64_t b = -1;
    const auto rank = ranks_.First([&](const std::pair<double, int32_t>& e) {
      b = FullestFit(*p, e.second, u);
      return b >= 0;
    });
    if (!rank) return false;
    p->Put(rank->second, b, u);
    ranks_.Push({KeyOf(*p, rank->second), rank->second});
    return true;
  }

 private:
  double KeyOf(const Packing& p, int32_t r) const {
    return by_cost_ ? p.rank_cost[r] : static_cast<double>(p.rank_fill[r]);
  }
  bool by_cost_;
  MinHeap<std::pair<double, int32_t>> ranks_;
};

}  // namespace

void SortDescending(const Checked& c, bool by_cost,
                    std::vector<int64_t>* units) {
  const Units& u = c.units;
  std::vector<std::tuple<double, double, int64_t>> keys(units->size());
  for (size_t j = 0; j < units->size(); ++j) {
    const int64_t i = (*units)[j];
    const double cost = -u.cost[i], padded = -static_cast<double>(u.padded[i]);
    keys[j] = by_cost ? std::make_tuple(cost, padded, i)
                      : std::make_tuple(padded, cost, i);
  }
  std::sort(keys.begin(), keys.end());
  for (size_t j = 0; j < keys.size(); ++j) (*units)[j] = std::get<2>(keys[j]);
}

std::vector<int64_t> Descending(const Checked& c, bool by_cost) {
  std::vector<int64_t> order = AllUnits(c);
  SortDescending(c, by_cost, &order);
  return order;
}

bool Greedy(const Checked& c, const std::vector<int64_t>& order, int64_t m,
            bool by_cost, Packing* p) {
  *p = Packing(c, m);
  CheapestRanks ranks(*p, by_cost);
  for (int64_t u : order) {
    if (!ranks.Place(p, u)) return false;
  }
  return true;
}

bool Differenced(const Checked& c,
                 const std::vector<std::vector<int64_t>>& partition, int64_t m,
                 Packing* p) {
  *p = Packing(c, m);
  std::vector<int64_t> left;
  for (int32_t r = 0; r < c.ranks; ++r) {
    std::vector<int64_t> units = partition[r];
    SortDescending(c, /*by_cost=*/false, &units);
    for (int64_t u : units) {
      int64_t b = 0;
      while (b < m && !p->Fits(r, b, u)) ++b;
      if (b < m) {
        p->Put(r, b, u);
      } else {
        left.push_back(u);
      }
    }
  }
  SortDescending(c, /*by_cost=*/true, &left);
  CheapestRanks ranks(*p, /*by_cost=*/true);
  for (int64_t u : left) {
    if (!ranks.Place(p, u)) return false;
  }
  return true;
}

Packing PackingOf(const Checked& c, const Bins& bins) {
  Packing p(c, static_cast<int64_t>(bins[0].size()));
  for (int32_t r = 0; r < c.ranks; ++r) {
    for (size_t b = 0; b < bins[r].size(); ++b) {
      for (int64_t u : bins[r][b]) p.Put(r, static_cast<int64_t>(b), u);
    }
  }
  return p;
}

void FillEmpty(Packing* p) {
  auto move_smallest = [&](Slot from, Slot to) {
    const std::vector<int64_t>& bin = p->bins[from.first][from.second];
    const auto smallest =
        std::min_element(bin.begin(), bin.end(), [&](int64_t a, int64_t b) {
          return p->c->units.padded[a] < p->c->units.padded[b];
        });
    p->Put(to.first, to.second,
           p->Take(from.first, from.second, smallest - bin.begin()));
  };
  // Donors (micro-batches of two or more units), gathered once: a plan may
  // hold many empty micro-batches and few donors, so looking for a donor per
  // empty micro-batch would be quadratic.
  auto donors_of = [&](int32_t r, std::vector<Slot>* donors) {
    for (int64_t b = 0; b < p->m(); ++b) {
      if (p->units(r, b) >= 2) donors->push_back({r, b});
    }
  };
  auto fill = [&](int32_t r, const std::vector<Slot>& donors, size_t& next) {
    for (int64_t b = 0; b < p->m(); ++b) {
      if (p->units(r, b) != 0) continue;
      while (next < donors.size() &&
             p->units(donors[next].first, donors[next].second) < 2) {
        ++next;
      }
      if (next == donors.size()) return;
      move_smallest(donors[next], {r, b});
    }
  };
  for (int32_t r = 0; r < p->c->ranks; ++r) {
    std::vector<Slot> donors;
    donors_of(r, &donors);
    std::stable_sort(donors.begin(), donors.end(), [&](Slot a, Slot b) {
      return p->units(a.first, a.second) > p->units(b.first, b.second);
    });
    size_t next = 0;
    fill(r, donors, next);
  }
  std::vector<Slot> donors;
  for (int32_t r = 0; r < p->c->ranks; ++r) donors_of(r, &donors);
  size_t next = 0;
  for (int32_t r = 0; r < p->c->ranks; ++r) fill(r, donors, next);
}

bool Better(const Packing& a, const Packing& b) {
  const double ca = a.MaxRankCost(), cb = b.MaxRankCost();
  if (std::abs(ca - cb) > 1e-12 * std::max(ca, cb)) return ca < cb;
  return *std::max_element(a.rank_fill.begin(), a.rank_fill.end()) <
         *std::max_element(b.rank_fill.begin(), b.rank_fill.end());
}

}  // namespace packd::planner_internal
