// Reads a batch of trajectory records (memopd.Trajectory objects, their Python lists of
// ids, log-probs and provenance triples) into flat arrays in one pass, for the pack
// compiler (memopd/packing.py, `_Records`, whose docstring says what each array holds).
//
// Only the plain case is handled here: Trajectory instances whose fields are lists of
// Python ints (int subclasses such as `Source` too, bools not; exact floats for log-probs,
// 3-tuples for provenance) that fit int64, with
// one log-prob per action token and one provenance triple per context token. Anything
// else (a missing list, an int subclass or numpy scalar, an id beyond int64, a count
// that does not match) returns None, and the Python reader, which names the problem,
// takes over. The arrays own their buffers (std::vector released into a capsule).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace {

template <typename T>
py::array_t<T> to_array(std::vector<T>&& v, ssize_t cols = 0) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule keep(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  if (cols > 0) {
    const ssize_t rows = static_cast<ssize_t>(owned->size()) / cols;
    return py::array_t<T>({rows, cols}, owned->data(), keep);
  }
  return py::array_t<T>(static_cast<ssize_t>(owned->size()), owned->data(), keep);
}

// Appends the ints of `list` to `out`; false if it is not a list of int64-sized ints.
bool append_ids(PyObject* list, std::vector<int64_t>& out) {
  if (!PyList_CheckExact(list)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(list);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(list, i);
    if (!PyLong_Check(v) || PyBool_Check(v)) return false;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return false;
    out.push_back(static_cast<int64_t>(x));
  }
  return true;
}

// A borrowed attribute: the new reference is dropped at once (the object keeps it alive).
PyObject* attr(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) throw py::error_already_set();
  Py_DECREF(v);
  return v;
}

// Where one call's action and observation ids sit in `ids` / `obs` (o_len -1: none).
struct CallSpan {
  int64_t a_off, a_len, o_off, o_len;
};

py::object read_records(py::sequence trajectories, py::object trajectory_type, bool read_provenance,
                        bool read_observations) {
  static PyObject* s_inv = PyUnicode_InternFromString("invocations");
  static PyObject* s_prefix = PyUnicode_InternFromString("prefix_ids");
  static PyObject* s_context = PyUnicode_InternFromString("context_ids");
  static PyObject* s_action = PyUnicode_InternFromString("action_ids");
  static PyObject* s_lps = PyUnicode_InternFromString("sample_logprobs");
  static PyObject* s_prov = PyUnicode_InternFromString("provenance");
  static PyObject* s_obs = PyUnicode_InternFromString("observation_ids");

  const Py_ssize_t B = PySequence_Size(trajectories.ptr());
  if (B < 0) throw py::error_already_set();
  std::vector<py::object> trajs;
  trajs.reserve(static_cast<size_t>(B));
  // sizes first, so that every buffer is allocated once at its final size
  size_t n_ids = 0, n_act = 0, n_ctx = 0, n_obs = 0, n_call = 0;
  for (Py_ssize_t b = 0; b < B; ++b) {
    trajs.push_back(trajectories[b]);
    const int is_traj = PyObject_IsInstance(trajs.back().ptr(), trajectory_type.ptr());
    if (is_traj < 0) throw py::error_already_set();
    if (!is_traj) return py::none();
    PyObject* invs = attr(trajs.back().ptr(), s_inv);
    if (!PyList_CheckExact(invs) || PyList_GET_SIZE(invs) == 0) return py::none();
    PyObject* q = attr(PyList_GET_ITEM(invs, 0), s_prefix);
    if (!PyList_CheckExact(q)) return py::none();
    n_ids += PyList_GET_SIZE(q);
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(invs); ++t) {
      PyObject* inv = PyList_GET_ITEM(invs, t);
      PyObject* x = attr(inv, s_context);
      PyObject* a = attr(inv, s_action);
      if (!PyList_CheckExact(x) || !PyList_CheckExact(a)) return py::none();
      n_ctx += PyList_GET_SIZE(x);
      n_act += PyList_GET_SIZE(a);
      if (read_observations) {
        PyObject* ob = attr(inv, s_obs);
        if (ob != Py_None) {
          if (!PyList_CheckExact(ob)) return py::none();
          n_obs += PyList_GET_SIZE(ob);
        }
      }
      ++n_call;
    }
  }
  n_ids += n_ctx + n_act;
  std::vector<int64_t> ids, obs, q_off, q_len, n_calls, x_len, a_len;
  std::vector<double> lps;
  std::vector<int8_t> src, has_lp, has_prov;
  ids.reserve(n_ids);
  lps.reserve(n_act);
  obs.reserve(n_obs);
  for (auto* v : {&q_off, &q_len, &n_calls}) v->reserve(static_cast<size_t>(B));
  for (auto* v : {&x_len, &a_len}) v->reserve(n_call);
  has_lp.reserve(n_call);
  if (read_provenance) {
    src.reserve(n_ctx);
    has_prov.reserve(n_call);
  }
  bool odd_prefix = false;
  bool prov_ok = true;  // every triple points at an earlier call's token of its kind, equal to it
  const double nan = std::nan("");
  std::vector<CallSpan> spans;
  for (Py_ssize_t b = 0; b < B; ++b) {
    PyObject* invs = attr(trajs[b].ptr(), s_inv);
    const Py_ssize_t C = PyList_GET_SIZE(invs);
    PyObject* q = attr(PyList_GET_ITEM(invs, 0), s_prefix);
    q_off.push_back(static_cast<int64_t>(ids.size()));
    if (!append_ids(q, ids)) return py::none();
    q_len.push_back(static_cast<int64_t>(PyList_GET_SIZE(q)));
    n_calls.push_back(C);
    spans.clear();
    for (Py_ssize_t t = 0; t < C; ++t) {
      PyObject* inv = PyList_GET_ITEM(invs, t);
      PyObject* p = attr(inv, s_prefix);
      if (p != q) {
        const int same = PyObject_RichCompareBool(p, q, Py_EQ);
        if (same < 0) throw py::error_already_set();
        if (!same) odd_prefix = true;
      }
      PyObject* x = attr(inv, s_context);
      PyObject* a = attr(inv, s_action);
      const int64_t x_off = static_cast<int64_t>(ids.size());
      if (!append_ids(x, ids) || !append_ids(a, ids)) return py::none();
      const Py_ssize_t nx = PyList_GET_SIZE(x), na = PyList_GET_SIZE(a);
      x_len.push_back(nx);
      a_len.push_back(na);
      PyObject* lp = attr(inv, s_lps);
      if (lp == Py_None) {
        lps.insert(lps.end(), static_cast<size_t>(na), nan);
        has_lp.push_back(0);
      } else {
        if (!PyList_CheckExact(lp) || PyList_GET_SIZE(lp) != na) return py::none();
        for (Py_ssize_t i = 0; i < na; ++i) {
          PyObject* v = PyList_GET_ITEM(lp, i);
          if (!PyFloat_CheckExact(v)) return py::none();
          lps.push_back(PyFloat_AS_DOUBLE(v));
        }
        has_lp.push_back(1);
      }
      CallSpan span{x_off + nx, na, static_cast<int64_t>(obs.size()), -1};
      if (read_observations) {
        PyObject* ob = attr(inv, s_obs);
        if (ob != Py_None) {
          if (!append_ids(ob, obs)) return py::none();
          span.o_len = PyList_GET_SIZE(ob);
        }
      }
      spans.push_back(span);
      if (read_provenance) {
        PyObject* pv = attr(inv, s_prov);
        if (pv == Py_None) {
          has_prov.push_back(0);
          src.insert(src.end(), static_cast<size_t>(nx), -1);
          continue;
        }
        if (!PyList_CheckExact(pv) || PyList_GET_SIZE(pv) != nx) return py::none();
        for (Py_ssize_t i = 0; i < nx; ++i) {
          PyObject* triple = PyList_GET_ITEM(pv, i);
          if (!PyTuple_CheckExact(triple) || PyTuple_GET_SIZE(triple) != 3) return py::none();
          long long f[3];
          for (int k = 0; k < 3; ++k) {
            PyObject* v = PyTuple_GET_ITEM(triple, k);
            if (!PyLong_Check(v) || PyBool_Check(v)) return py::none();
            int overflow = 0;
            f[k] = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow) return py::none();
          }
          const long long source = f[0], call = f[1], off = f[2];
          if (source < 0 || source > 2) {
            prov_ok = false;  // not a Source code; recorded as "no source" (-1 is no action copy either)
            src.push_back(source == 1 ? 1 : 3);
            continue;
          }
          src.push_back(static_cast<int8_t>(source));
          if (!prov_ok) continue;
          if (source == 0) {  // template: inserted by the update of call `call` (-1: initial)
            prov_ok = call >= -1 && call < t;
            continue;
          }
          if (call < 0 || call >= t) {
            prov_ok = false;
            continue;
          }
          const CallSpan& r = spans[static_cast<size_t>(call)];
          const int64_t n_src = source == 1 ? r.a_len : r.o_len;
          if (off < 0 || off >= n_src) {
            prov_ok = false;
            continue;
          }
          const int64_t ref = source == 1 ? ids[static_cast<size_t>(r.a_off + off)] : obs[static_cast<size_t>(r.o_off + off)];
          prov_ok = ref == ids[static_cast<size_t>(x_off + i)];
        }
        has_prov.push_back(1);
      }
    }
  }
  py::dict out;
  int64_t obs_min = 0, obs_max = -1;  // max < min: no observation ids
  for (size_t i = 0; i < obs.size(); ++i) {
    if (i == 0 || obs[i] < obs_min) obs_min = obs[i];
    if (i == 0 || obs[i] > obs_max) obs_max = obs[i];
  }
  out["ids"] = to_array(std::move(ids));
  out["lps"] = to_array(std::move(lps));
  out["q_off"] = to_array(std::move(q_off));
  out["q_len"] = to_array(std::move(q_len));
  out["n_calls"] = to_array(std::move(n_calls));
  out["x_len"] = to_array(std::move(x_len));
  out["a_len"] = to_array(std::move(a_len));
  out["has_lp"] = to_array(std::move(has_lp)).attr("view")("bool");
  out["odd_prefix"] = odd_prefix;
  if (read_provenance) {
    out["src"] = to_array(std::move(src));
    out["has_prov"] = to_array(std::move(has_prov)).attr("view")("bool");
    out["prov_ok"] = prov_ok;
  }
  if (read_observations) {
    out["obs_min"] = obs_min;
    out["obs_max"] = obs_max;
  }
  return std::move(out);
}

}  // namespace

void register_records(py::module_& m) {
  m.def("read_records", &read_records, py::arg("trajectories"), py::arg("trajectory_type"),
        py::arg("read_provenance"), py::arg("read_observations"),
        "Flat arrays of a batch of plain trajectory records (ids, log-probs, lengths; on request "
        "each context token's provenance source and whether every provenance triple holds, and "
        "the range of the observation ids) as a dict, or None when a record is not plain (the "
        "Python reader then names the problem).");
}
