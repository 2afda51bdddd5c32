// Row planner for packed batches: bins packable items into rows under a token budget.
//
// An item is one unit that must stay whole inside a row (a call segment, or a whole
// flattened trajectory). Items of the same prefix group g share one prefix segment per
// row, whose cost p_g = group_cost[g] is paid once by every row holding any item of g.
// Items with a negative group (-1) have no shared prefix.
//
// Algorithm (group chunking, then first-fit decreasing of the chunks), why it is sound,
// and how it compares with the previous planner: docs/design.md §2.3, the one
// description. The slow Python reference in tests/test_planner.py must give identical
// plans.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// First fit over up to `max_bins` bins of equal capacity: put(size) returns the lowest
// bin index whose free space is >= size, opening the next bin when none is. A segment
// tree of the free space of each bin (unopened bins hold `capacity`) finds it in O(log).
class FirstFit {
 public:
  FirstFit(size_t max_bins, int64_t capacity) {
    while (size_ < std::max<size_t>(max_bins, 1)) size_ <<= 1;
    tree_.assign(2 * size_, capacity);
  }

  // Caller guarantees 0 < size <= capacity, and at most `max_bins` bins are ever opened.
  size_t put(int64_t size) {
    size_t node = 1;
    while (node < size_) {
      node = tree_[2 * node] >= size ? 2 * node : 2 * node + 1;
    }
    const size_t bin = node - size_;
    tree_[node] -= size;
    for (node >>= 1; node >= 1; node >>= 1) {
      tree_[node] = std::max(tree_[2 * node], tree_[2 * node + 1]);
    }
    return bin;
  }

 private:
  size_t size_ = 1;
  std::vector<int64_t> tree_;
};

struct Chunk {
  int64_t cost = 0;      // prefix (once) + lengths of its items
  size_t first = 0;      // lowest item index in the chunk (tie-break)
  std::vector<size_t> items;
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
    if (group_cost[g] < 0) {
      throw std::invalid_argument("plan_rows: item " + std::to_string(i) + " has group " +
                                  std::to_string(g) + " with a negative group_cost");
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

  // 1. Chunking: items of each group, by length descending, first fit into chunks of
  //    capacity budget - p_g. Ungrouped items are chunks of their own.
  std::vector<std::vector<size_t>> members(group_cost.size());
  std::vector<Chunk> chunks;
  chunks.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (groups[i] >= 0) {
      members[groups[i]].push_back(i);
    } else {
      chunks.push_back(Chunk{lengths[i], i, {i}});
    }
  }
  for (size_t g = 0; g < members.size(); ++g) {
    std::vector<size_t>& m = members[g];
    if (m.empty()) continue;
    std::stable_sort(m.begin(), m.end(), [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
    const int64_t p = group_cost[g];
    FirstFit fit(m.size(), budget - p);
    const size_t base = chunks.size();
    for (size_t i : m) {
      const size_t c = fit.put(lengths[i]);
      if (base + c == chunks.size()) chunks.push_back(Chunk{p, i, {}});
      Chunk& chunk = chunks[base + c];
      chunk.cost += lengths[i];
      chunk.first = std::min(chunk.first, i);
      chunk.items.push_back(i);
    }
  }

  // 2. Packing: chunks by cost descending (ties: lowest item index), first fit into rows.
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (chunks[a].cost != chunks[b].cost) return chunks[a].cost > chunks[b].cost;
    return chunks[a].first < chunks[b].first;
  });
  FirstFit rows(chunks.size(), budget);
  std::vector<int64_t> row_of(n, -1);
  for (size_t c : order) {
    const int64_t r = static_cast<int64_t>(rows.put(chunks[c].cost));
    for (size_t i : chunks[c].items) row_of[i] = r;
  }
  return row_of;
}

}  // namespace

void register_logit_chunks(py::module_& m);  // csrc/logit_chunks.cpp
void register_records(py::module_& m);  // csrc/records.cpp
void register_bf16_gemm(py::module_& m);  // csrc/bf16_gemm.cpp
void register_trie(py::module_& m);  // csrc/trie.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "memopd C++ core: the packed-row planner, the record reader and trie planner of the pack compiler and "
            "the CPU logit-chunk kernels of the fused losses";
  register_logit_chunks(m);
  register_records(m);
  register_bf16_gemm(m);
  register_trie(m);
  m.def("plan_rows", &plan_rows, py::arg("lengths"), py::arg("groups"), py::arg("group_cost"),
        py::arg("budget"),
        "Assign items to rows under a token budget, few prefix copies first: the items of "
        "each group are cut first-fit-decreasing into as few chunks as fit one row each "
        "(with the group's prefix), then all chunks (and ungrouped items) are packed "
        "first-fit-decreasing into rows. groups[i] = -1 for items with no shared prefix; "
        "group_cost[g] is the prefix length paid once per row holding group g. Returns the "
        "row of each item.");
}
