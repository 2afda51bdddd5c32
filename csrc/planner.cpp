// Row planner for packed batches: bins packable items into rows under a token budget.
//
// An item is one unit that must stay whole inside a row (a call segment, or a whole
// flattened trajectory). Items of the same prefix group share one prefix segment per
// row, whose cost is paid once by the first item of that group placed in the row.
//
// Algorithm: first-fit decreasing with prefix affinity, fully deterministic.
//   1. Order items by cost (length + its group's prefix cost) descending, ties by index.
//   2. For each item, first try the rows (in creation order) that already hold its
//      group (cost: its length); then every row in creation order (cost: length plus the
//      group's prefix if the row lacks it); else open a new row.
// The slow Python reference in tests/test_planner.py must give identical plans.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

struct Row {
  int64_t used = 0;
  std::unordered_set<int64_t> groups;
};

std::vector<int64_t> plan_rows(const std::vector<int64_t>& lengths,
                               const std::vector<int64_t>& groups,
                               const std::vector<int64_t>& group_cost,
                               int64_t budget) {
  const size_t n = lengths.size();
  if (groups.size() != n) {
    throw std::invalid_argument("plan_rows: lengths and groups differ in size");
  }
  if (budget <= 0) {
    throw std::invalid_argument("plan_rows: budget must be positive, got " + std::to_string(budget));
  }
  auto prefix_of = [&](size_t i) -> int64_t {
    const int64_t g = groups[i];
    if (g < 0) return 0;
    if (static_cast<size_t>(g) >= group_cost.size()) {
      throw std::invalid_argument("plan_rows: item " + std::to_string(i) + " has group " +
                                  std::to_string(g) + " with no group_cost entry");
    }
    return group_cost[g];
  };
  for (size_t i = 0; i < n; ++i) {
    if (lengths[i] <= 0) {
      throw std::invalid_argument("plan_rows: item " + std::to_string(i) + " has non-positive length");
    }
    const int64_t need = lengths[i] + prefix_of(i);
    if (need > budget) {
      throw std::invalid_argument("plan_rows: item " + std::to_string(i) + " needs " +
                                  std::to_string(need) + " tokens, over the row budget of " +
                                  std::to_string(budget));
    }
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return lengths[a] + prefix_of(a) > lengths[b] + prefix_of(b);
  });

  std::vector<Row> rows;
  std::vector<int64_t> row_of(n, -1);
  for (size_t i : order) {
    const int64_t g = groups[i];
    const int64_t len = lengths[i];
    int64_t chosen = -1;
    if (g >= 0) {
      for (size_t r = 0; r < rows.size(); ++r) {
        if (rows[r].groups.count(g) && rows[r].used + len <= budget) {
          chosen = static_cast<int64_t>(r);
          break;
        }
      }
    }
    if (chosen < 0) {
      for (size_t r = 0; r < rows.size(); ++r) {
        const bool has = g >= 0 && rows[r].groups.count(g);
        const int64_t cost = len + (has ? 0 : prefix_of(i));
        if (rows[r].used + cost <= budget) {
          chosen = static_cast<int64_t>(r);
          break;
        }
      }
    }
    if (chosen < 0) {
      rows.emplace_back();
      chosen = static_cast<int64_t>(rows.size()) - 1;
    }
    Row& row = rows[chosen];
    if (g >= 0 && !row.groups.count(g)) {
      row.used += prefix_of(i);
      row.groups.insert(g);
    }
    row.used += len;
    row_of[i] = chosen;
  }
  return row_of;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "memopd C++ core: the packed-row planner";
  m.def("plan_rows", &plan_rows, py::arg("lengths"), py::arg("groups"), py::arg("group_cost"),
        py::arg("budget"),
        "Assign items to rows under a token budget (first-fit decreasing with prefix "
        "affinity). groups[i] = -1 for items with no shared prefix; group_cost[g] is the "
        "prefix length paid once per row holding group g. Returns the row of each item.");
}
