// Elementwise work of the fused losses' PyTorch path on CPU: one [rows, chunk] block of
// float32 logits per call, the softmax sums of the forward in one pass and dL/ds of the
// gradient pass in one more, where the plain PyTorch ops take about ten passes and three
// temporaries each (memopd/ops/distill_torch.py calls these through
// memopd/ops/_native_chunks.py; the math and the reasons: docs/design.md §6.2). Single
// precision in, the row sums kept in double.
//
// The exponentials are 2^x by range reduction (x = i + f, |f| <= 1/2) and a degree-7
// polynomial, relative error ~2e-7 (fp32 rounding), exactly 0 below 2^-126, so that a
// logit far below its row's max contributes nothing; loops are written so the compiler
// vectorises them (OpenMP SIMD pragmas, no OpenMP runtime). On x86-64 with GCC the
// kernels (logit_chunks_kernels.inc) are compiled twice, for AVX2+FMA and portable, and
// the CPU picks at first use. Rows split across `threads` std::threads.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMOPD_HAVE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "logit_chunks_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace base {
#include "logit_chunks_kernels.inc"
}  // namespace base

bool cpu_supports_avx2() {
#ifdef MEMOPD_HAVE_AVX2
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

bool g_force_base = false;  // set_isa("base"): the tests run the portable copy too

bool cpu_has_avx2() { return !g_force_base && cpu_supports_avx2(); }

std::string set_isa(const std::string& isa) {
  if (isa != "auto" && isa != "base") throw std::invalid_argument("set_isa: 'auto' or 'base', got '" + isa + "'");
  g_force_base = isa == "base";
  return cpu_has_avx2() ? "avx2" : "base";
}

void row_sums(const float* s, const float* t, int64_t c, float ms, float mt, bool weight_teacher, double* out) {
#ifdef MEMOPD_HAVE_AVX2
  if (cpu_has_avx2()) return avx2::row_sums(s, t, c, ms, mt, weight_teacher, out);
#endif
  base::row_sums(s, t, c, ms, mt, weight_teacher, out);
}

void row_dlogits(float* s, const float* t, int64_t c, float lse, float a, float b, float d, int mode, float lse_t,
                 float dlse) {
#ifdef MEMOPD_HAVE_AVX2
  if (cpu_has_avx2()) return avx2::row_dlogits(s, t, c, lse, a, b, d, mode, lse_t, dlse);
#endif
  base::row_dlogits(s, t, c, lse, a, b, d, mode, lse_t, dlse);
}

void row_jsd_weights(const float* s, float* t, int64_t c, float lse_s, float lse_t, float dlse, float log2_beta,
                     float one_minus_beta, double* out) {
#ifdef MEMOPD_HAVE_AVX2
  if (cpu_has_avx2()) return avx2::row_jsd_weights(s, t, c, lse_s, lse_t, dlse, log2_beta, one_minus_beta, out);
#endif
  base::row_jsd_weights(s, t, c, lse_s, lse_t, dlse, log2_beta, one_minus_beta, out);
}

// Runs body(r0, r1) over row ranges on up to `threads` threads.
template <class Body>
void for_rows(int64_t n, int64_t cols, int threads, Body body) {
  const int64_t min_rows = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(cols, 1));
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, n / min_rows));
  if (nt <= 1) {
    body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t step = (n + nt - 1) / nt;
  for (int64_t r0 = step; r0 < n; r0 += step) pool.emplace_back(body, r0, std::min(n, r0 + step));
  body(0, std::min(n, step));
  for (auto& th : pool) th.join();
}

const float* fptr(uintptr_t p) { return reinterpret_cast<const float*>(p); }

// s, t: [n, c] row-major blocks (t may be 0); m_s, m_t: [n] row maxima of the whole row;
// z_s, a_s, z_t, e_d: [n] float32 sums, added to.
void softmax_sums(uintptr_t s, uintptr_t t, int64_t n, int64_t c, uintptr_t m_s, uintptr_t m_t,
                  uintptr_t z_s, uintptr_t a_s, uintptr_t z_t, uintptr_t e_d, bool weight_teacher,
                  int threads) {
  if (s == 0 || m_s == 0 || z_s == 0 || a_s == 0) throw std::invalid_argument("softmax_sums: null student buffer");
  if (t != 0 && (m_t == 0 || z_t == 0 || e_d == 0)) throw std::invalid_argument("softmax_sums: null teacher buffer");
  py::gil_scoped_release release;
  for_rows(n, c, threads, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double acc[4] = {0, 0, 0, 0};  // the row's sums over this block
      const float* tr = t ? fptr(t) + r * c : nullptr;
      row_sums(fptr(s) + r * c, tr, c, fptr(m_s)[r], t ? fptr(m_t)[r] : 0.0f, weight_teacher,
               acc);
      reinterpret_cast<float*>(z_s)[r] += static_cast<float>(acc[0]);
      reinterpret_cast<float*>(a_s)[r] += static_cast<float>(acc[1]);
      if (t) {
        reinterpret_cast<float*>(z_t)[r] += static_cast<float>(acc[2]);
        reinterpret_cast<float*>(e_d)[r] += static_cast<float>(acc[3]);
      }
    }
  });
}

// In place over s [n, c]: dL/ds with per-row coefficients a, b, d ([n] each, b/d may be 0);
// mode 3 (forward KL) also reads the per-row lse_t and dlse.
void dlogits(uintptr_t s, uintptr_t t, int64_t n, int64_t c, uintptr_t lse_s, uintptr_t a, uintptr_t b,
             uintptr_t d, int mode, int threads, uintptr_t lse_t, uintptr_t dlse) {
  if (s == 0 || lse_s == 0 || a == 0) throw std::invalid_argument("dlogits: null buffer");
  if (mode < 0 || mode > 3) throw std::invalid_argument("dlogits: mode must be 0, 1, 2 or 3");
  if (mode != 0 && (t == 0 || d == 0)) throw std::invalid_argument("dlogits: modes 1-3 need t and d");
  if (mode == 3 && (lse_t == 0 || dlse == 0)) throw std::invalid_argument("dlogits: mode 3 needs lse_t and dlse");
  py::gil_scoped_release release;
  for_rows(n, c, threads, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      row_dlogits(reinterpret_cast<float*>(s) + r * c, t ? fptr(t) + r * c : nullptr, c, fptr(lse_s)[r],
                  fptr(a)[r], b ? fptr(b)[r] : 0.0f, d ? fptr(d)[r] : 0.0f, mode,
                  mode == 3 ? fptr(lse_t)[r] : 0.0f, mode == 3 ? fptr(dlse)[r] : 0.0f);
    }
  });
}

// In place over t [n, c]: the JSD weight -(δ - u) of each entry (nats); sp, sq ([n]) += Σ p w, Σ q w.
void jsd_weights(uintptr_t s, uintptr_t t, int64_t n, int64_t c, uintptr_t lse_s, uintptr_t lse_t, uintptr_t dlse,
                 double beta, uintptr_t sp, uintptr_t sq, int threads) {
  if (s == 0 || t == 0 || lse_s == 0 || lse_t == 0 || dlse == 0 || sp == 0 || sq == 0)
    throw std::invalid_argument("jsd_weights: null buffer");
  if (!(beta > 0.0 && beta <= 1.0)) throw std::invalid_argument("jsd_weights: beta must be in (0, 1]");
  const float log2_beta = static_cast<float>(std::log2(beta));
  const float omb = static_cast<float>(1.0 - beta);
  py::gil_scoped_release release;
  for_rows(n, c, threads, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double acc[2] = {0, 0};
      row_jsd_weights(fptr(s) + r * c, reinterpret_cast<float*>(t) + r * c, c, fptr(lse_s)[r], fptr(lse_t)[r],
                      fptr(dlse)[r], log2_beta, omb, acc);
      reinterpret_cast<float*>(sp)[r] += static_cast<float>(acc[0]);
      reinterpret_cast<float*>(sq)[r] += static_cast<float>(acc[1]);
    }
  });
}

}  // namespace

void register_logit_chunks(py::module_& m) {
  m.def("set_logit_chunks_isa", &set_isa, py::arg("isa"),
        "Which compiled copy of the logit-chunk kernels runs: 'auto' (AVX2+FMA where the CPU has "
        "them) or 'base' (the portable one); returns the one now in use.");
  m.def("softmax_sums", &softmax_sums, py::arg("s"), py::arg("t"), py::arg("n"), py::arg("c"), py::arg("m_s"),
        py::arg("m_t"), py::arg("z_s"), py::arg("a_s"), py::arg("z_t"), py::arg("e_d"), py::arg("weight_teacher"),
        py::arg("threads"),
        "Forward sums of one [n, c] float32 logit block (data pointers): z_s += Σ e^{s-m_s}, a_s += Σ "
        "log2e (s-m_s) e^{s-m_s}; with a teacher block t also z_t += Σ e^{t-m_t} and e_d += Σ w (s-t), "
        "w = e^{t-m_t} if weight_teacher else e^{s-m_s}. t = 0: student only.");
  m.def("jsd_weights", &jsd_weights, py::arg("s"), py::arg("t"), py::arg("n"), py::arg("c"), py::arg("lse_s"),
        py::arg("lse_t"), py::arg("dlse"), py::arg("beta"), py::arg("sp"), py::arg("sq"), py::arg("threads"),
        "In place over the [n, c] float32 teacher block t: the JSD weight -(δ - u) = log(β q/p + 1 - β) "
        "(nats), δ = (s - t) - dlse; sp += Σ p w, sq += Σ q w per row, p = e^{s-lse_s}, q = e^{t-lse_t}.");
  m.def("dlogits", &dlogits, py::arg("s"), py::arg("t"), py::arg("n"), py::arg("c"), py::arg("lse_s"), py::arg("a"),
        py::arg("b"), py::arg("d"), py::arg("mode"), py::arg("threads"), py::arg("lse_t") = 0, py::arg("dlse") = 0,
        "In place over the [n, c] float32 block s: p (a + b log2 p + d X), p = e^{s - lse_s}, X = 0 (mode "
        "0), s - t (1), t (2) or (q - p)/p with q = e^{t - lse_t}, -δ = dlse - (s - t) (3, the forward KL); "
        "a, b, d per row (b, d may be 0; lse_t, dlse per row, mode 3 only).");
}
