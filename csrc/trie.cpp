// The trie layout's plan (memopd/packing.py, `_layout_trie`): which spine each call reads
// and down to which depth. The Python planner it replaces (`_sorted_calls`,
// `_trie_spines` in packing.py) documents the method and stays as the fallback for a core
// built before this file; both give the same plan, tie for tie (tests/core/test_trie_reference.py).
//
// A call's sequence is [q, x_t, a_t]: q = ids[q_off[traj]:+q_len[traj]], then x_t and a_t
// contiguous at ids[x_off:+length - q_len]. The calls are sorted by their sequences
// (ids compared as signed int64, a proper prefix first, ties in call order), the common
// prefix of each neighbouring pair read, and the compressed trie those give priced
// bottom up: each node either continues the spine through it into one child, or each
// child reads that spine down to the node's depth, or owns a spine of its own.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// The distinct q of a batch (few: one per group or task), sorted, with the common prefix
// of any two from a range minimum over neighbours' (a sparse table): two calls whose q
// differ at a depth inside both are ordered by their q alone, and share exactly that much.
struct QTable {
  std::vector<int64_t> cls;  // per trajectory: its class (distinct q), 0..K-1
  std::vector<int64_t> rank;  // per class: its place in the sorted q
  std::vector<std::vector<int64_t>> lcp_min;  // [j][r]: min common prefix of ranks r..r+2^j

  QTable(const int64_t* ids, const int64_t* q_off, const int64_t* q_len, int64_t B) {
    cls.resize(static_cast<size_t>(B));
    std::vector<int64_t> rep;  // per class: its first trajectory
    std::unordered_map<uint64_t, std::vector<int64_t>> seen;  // hash -> classes
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* q = ids + q_off[b];
      uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(q_len[b]);
      for (int64_t i = 0; i < q_len[b]; ++i) h = (h ^ static_cast<uint64_t>(q[i])) * 1099511628211ull;
      auto& classes = seen[h];
      int64_t found = -1;
      for (int64_t k : classes) {
        const int64_t f = rep[k];
        if (q_len[f] == q_len[b] && std::equal(q, q + q_len[b], ids + q_off[f])) {
          found = k;
          break;
        }
      }
      if (found < 0) {
        found = static_cast<int64_t>(rep.size());
        rep.push_back(b);
        classes.push_back(found);
      }
      cls[b] = found;
    }
    const int64_t K = static_cast<int64_t>(rep.size());
    std::vector<int64_t> sorted(static_cast<size_t>(K));
    std::iota(sorted.begin(), sorted.end(), 0);
    auto q_of = [&](int64_t k) { return ids + q_off[rep[k]]; };
    std::sort(sorted.begin(), sorted.end(), [&](int64_t a, int64_t b) {
      return std::lexicographical_compare(q_of(a), q_of(a) + q_len[rep[a]], q_of(b), q_of(b) + q_len[rep[b]]);
    });
    rank.resize(static_cast<size_t>(K));
    for (int64_t r = 0; r < K; ++r) rank[sorted[r]] = r;
    std::vector<int64_t> adj(static_cast<size_t>(std::max<int64_t>(K - 1, 0)));
    for (int64_t r = 0; r + 1 < K; ++r) {
      const int64_t a = sorted[r], b = sorted[r + 1];
      const int64_t m = std::min(q_len[rep[a]], q_len[rep[b]]);
      adj[r] = std::mismatch(q_of(a), q_of(a) + m, q_of(b)).first - q_of(a);
    }
    lcp_min.push_back(std::move(adj));
    for (size_t j = 1; (int64_t{1} << j) < K; ++j) {
      const auto& prev = lcp_min.back();
      const size_t half = size_t{1} << (j - 1);
      std::vector<int64_t> next(prev.size() - half);
      for (size_t r = 0; r < next.size(); ++r) next[r] = std::min(prev[r], prev[r + half]);
      lcp_min.push_back(std::move(next));
    }
  }

  // common prefix of the q of two different classes
  int64_t lcp(int64_t ca, int64_t cb) const {
    int64_t lo = rank[ca], hi = rank[cb];
    if (lo > hi) std::swap(lo, hi);
    const int64_t n = hi - lo;  // neighbours' values lo..hi-1
    size_t j = 0;
    while ((int64_t{2} << j) <= n) ++j;
    return std::min(lcp_min[j][lo], lcp_min[j][hi - (int64_t{1} << j)]);
  }
};

struct Calls {
  const int64_t* ids;
  const QTable* qt;
  std::vector<int64_t> q_off, q_len, x_off, len, q_class;  // per call

  // ids of call c from depth d to the end of the contiguous piece holding d
  const int64_t* at(int64_t c, int64_t d, int64_t& run) const {
    if (d < q_len[c]) {
      run = q_len[c] - d;
      return ids + q_off[c] + d;
    }
    run = len[c] - d;
    return ids + x_off[c] + d - q_len[c];
  }

  // first depth >= from where calls a and b differ, or m (the shorter length)
  int64_t first_diff(int64_t a, int64_t b, int64_t from, int64_t m) const {
    int64_t d = from;
    while (d < m) {
      int64_t ra, rb;
      const int64_t* pa = at(a, d, ra);
      const int64_t* pb = at(b, d, rb);
      const int64_t n = std::min({ra, rb, m - d});
      const int64_t k = std::mismatch(pa, pa + n, pb).first - pa;
      d += k;
      if (k < n) return d;
    }
    return m;
  }

  // the first depth where a and b differ (m: none below the shorter length m); `q_order`
  // set to -1 / +1 when their q alone decide their order, else 0
  int64_t diff(int64_t a, int64_t b, int64_t m, int& q_order) const {
    q_order = 0;
    if (q_class[a] == q_class[b]) return first_diff(a, b, q_len[a], m);
    const int64_t l = qt->lcp(q_class[a], q_class[b]);
    if (l < q_len[a] && l < q_len[b]) {
      q_order = qt->rank[q_class[a]] < qt->rank[q_class[b]] ? -1 : 1;
      return l;
    }
    return first_diff(a, b, l, m);
  }

  // call a's sequence before call b's (a proper prefix first)
  bool less(int64_t a, int64_t b) const {
    const int64_t m = std::min(len[a], len[b]);
    int q_order;
    const int64_t d = diff(a, b, m, q_order);
    if (q_order) return q_order < 0;
    return d < m ? tok(a, d) < tok(b, d) : len[a] < len[b];
  }

  int64_t tok(int64_t c, int64_t d) const {
    return d < q_len[c] ? ids[q_off[c] + d] : ids[x_off[c] + d - q_len[c]];
  }
};

struct Child {
  bool leaf;
  int64_t id;  // sorted call index, or node index
  bool owns = false;  // a node child that owns its spine
};

struct Node {
  Node(int64_t depth_, int64_t lo_) : depth(depth_), lo(lo_) {}
  int64_t depth, lo, hi = 0, n = 0, s = 0, g = 0;
  int64_t heavy = -1;  // index into children
  std::vector<Child> children;
};

// G(v) and its heavy child (see `_trie_spines`): each child read (A) or owning (G), the
// spine through v continuing into the child where owning gains most (first on ties)
void close_node(std::vector<Node>& nodes, int64_t v, const std::vector<int64_t>& lens) {
  Node& node = nodes[v];
  const int64_t D = node.depth;
  int64_t best = std::numeric_limits<int64_t>::max(), tot = 0, n = 0, s = 0, heavy = -1;
  for (size_t i = 0; i < node.children.size(); ++i) {
    Child& c = node.children[i];
    int64_t f, g;
    if (c.leaf) {
      const int64_t ln = lens[c.id];
      const int64_t a = ln - std::min(D, ln - 1);
      f = a;
      g = D + a;
      n += 1;
      s += ln;
    } else {
      const Node& u = nodes[c.id];
      const int64_t a = u.s - u.n * D;
      g = u.g;
      f = std::min(a, g);
      c.owns = g < a;
      n += u.n;
      s += u.s;
    }
    tot += f;
    if (g - f < best) {
      best = g - f;
      heavy = static_cast<int64_t>(i);
    }
  }
  node.n = n;
  node.s = s;
  node.g = tot + best;
  node.heavy = heavy;
}

py::tuple trie_plan(I64 ids_a, I64 q_off_traj, I64 q_len_traj, I64 traj, I64 x_off, I64 length) {
  const int64_t C = traj.size();
  const int64_t B = q_off_traj.size();
  if (x_off.size() != C || length.size() != C || q_len_traj.size() != B)
    throw std::invalid_argument("trie_plan: per-call arrays differ in size");
  Calls calls;
  calls.ids = ids_a.data();
  const int64_t n_ids = ids_a.size();
  const QTable qt(calls.ids, q_off_traj.data(), q_len_traj.data(), B);
  calls.qt = &qt;
  const auto& cls = qt.cls;
  for (auto* v : {&calls.q_off, &calls.q_len, &calls.x_off, &calls.len, &calls.q_class}) v->resize(C);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t b = traj.data()[c];
    if (b < 0 || b >= B) throw std::invalid_argument("trie_plan: a call's trajectory is out of range");
    calls.q_off[c] = q_off_traj.data()[b];
    calls.q_len[c] = q_len_traj.data()[b];
    calls.x_off[c] = x_off.data()[c];
    calls.len[c] = length.data()[c];
    calls.q_class[c] = cls[b];
    const int64_t rest = calls.len[c] - calls.q_len[c];
    if (calls.len[c] <= 0 || rest < 0 || calls.q_off[c] < 0 || calls.q_off[c] + calls.q_len[c] > n_ids ||
        calls.x_off[c] < 0 || calls.x_off[c] + rest > n_ids)
      throw std::invalid_argument("trie_plan: a call's tokens are out of range");
  }
  std::vector<int64_t> order(static_cast<size_t>(C));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return calls.less(a, b); });
  std::vector<int64_t> lens(static_cast<size_t>(C)), lcp(static_cast<size_t>(C), 0);
  for (int64_t k = 0; k < C; ++k) lens[k] = calls.len[order[k]];
  for (int64_t k = 0; k + 1 < C; ++k) {
    const int64_t a = order[k], b = order[k + 1];
    int q_order;
    lcp[k] = calls.diff(a, b, std::min(lens[k], lens[k + 1]), q_order);
  }

  // the compressed trie, built over the sorted calls with a stack of open nodes (root 0)
  std::vector<Node> nodes;
  nodes.reserve(static_cast<size_t>(C) + 1);
  nodes.emplace_back(0, 0);
  std::vector<int64_t> stack{0};
  for (int64_t k = 0; k < C; ++k) {
    Child last{true, k};
    const int64_t h = k < C - 1 ? lcp[k] : 0;
    while (nodes[stack.back()].depth > h) {
      const int64_t v = stack.back();
      stack.pop_back();
      nodes[v].children.push_back(last);
      nodes[v].hi = k + 1;
      close_node(nodes, v, lens);
      last = Child{false, v};
    }
    if (nodes[stack.back()].depth == h) {
      nodes[stack.back()].children.push_back(last);
    } else {
      const int64_t lo = last.leaf ? last.id : nodes[last.id].lo;
      nodes.emplace_back(h, lo);
      nodes.back().children.push_back(last);
      stack.push_back(static_cast<int64_t>(nodes.size()) - 1);
    }
  }

  // the spines, numbered as they are taken off the to-do stack
  std::vector<int64_t> spine(static_cast<size_t>(C), -1), depth(static_cast<size_t>(C), 0), todo;
  for (const Child& c : nodes[0].children)
    if (!c.leaf && nodes[c.id].g < nodes[c.id].s) todo.push_back(c.id);
  int64_t n_spines = 0;
  while (!todo.empty()) {
    int64_t v = todo.back();
    todo.pop_back();
    const int64_t s = n_spines++;
    while (v >= 0) {
      const Node& node = nodes[v];
      const int64_t D = node.depth;
      int64_t nxt = -1;
      for (size_t i = 0; i < node.children.size(); ++i) {
        const Child& c = node.children[i];
        if (c.leaf) {
          spine[c.id] = s;
          depth[c.id] = std::min(D, lens[c.id] - 1);
        } else if (static_cast<int64_t>(i) == node.heavy) {
          nxt = c.id;
        } else if (c.owns) {
          todo.push_back(c.id);
        } else {
          const Node& u = nodes[c.id];
          std::fill(spine.begin() + u.lo, spine.begin() + u.hi, s);
          std::fill(depth.begin() + u.lo, depth.begin() + u.hi, D);
        }
      }
      v = nxt;
    }
  }
  I64 out_order(C), out_spine(C), out_depth(C);
  int64_t *po = out_order.mutable_data(), *ps = out_spine.mutable_data(), *pd = out_depth.mutable_data();
  for (int64_t k = 0; k < C; ++k) {
    po[k] = order[k];
    ps[order[k]] = spine[k];
    pd[order[k]] = depth[k];
  }
  return py::make_tuple(out_order, out_spine, out_depth);
}

}  // namespace

void register_trie(py::module_& m) {
  m.def("trie_plan", &trie_plan, py::arg("ids"), py::arg("q_off_traj"), py::arg("q_len_traj"), py::arg("traj"),
        py::arg("x_off"), py::arg("length"),
        "The trie layout's plan of a batch of calls (call c: its trajectory's q, then "
        "ids[x_off[c]:] up to length[c] tokens in all): the calls in sorted order of their "
        "sequences, and per call (in call order) the spine it reads (-1: none) and its "
        "branch depth.");
}
