// A bfloat16 GEMM with float32 accumulation and float32 output for the fused losses' CPU
// path: C = alpha·op(A)·op(B) (+ C), with A, B strided bf16 matrices, or float32 ones that
// are rounded to bf16 (round to nearest even) as they are packed. The products of two bf16
// values are exact in fp32, so the result differs from the exact product of the bf16
// operands only by fp32 accumulation; the lm-head logits then keep fp32 precision at the
// bf16 rate. torch on CPU has no such call (its bf16 matmul rounds its output to bf16, and
// MKL's cblas_gemm_bf16bf16f32 runs at the fp32 rate on CPUs MKL does not dispatch for).
//
// It runs on CPUs with AVX512-BF16 (vdpbf16ps: fp32 += a0·b0 + a1·b1 over bf16 pairs;
// denormal inputs and outputs flushed to zero); `bf16_gemm_available()` says whether this
// CPU has it, and the Python side keeps its fp32 path where not. Both operands are packed
// into pairs along the reduction dimension (A in 12-row panels whose pairs are broadcast,
// B in 32-column panels loaded as vectors), then a 12x32 register-tile kernel runs over
// cache blocks. Rows of C are split over up to `threads` std::threads.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMOPD_HAVE_BF16_KERNEL 1
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

#ifdef MEMOPD_HAVE_BF16_KERNEL
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

constexpr int64_t kMR = 12;    // rows of the register tile
constexpr int64_t kNR = 32;    // columns of the register tile (two 16-lane vectors)
constexpr int64_t kKCP = 512;  // at most this many reduction pairs per cache block (1024 bf16 values)
constexpr int64_t kNCP = 8;    // B panels per cache block
constexpr int64_t kNCPAT = 16; // B panels per cache block of bf16_gemm_at (1 MiB packed at H = 1024: A read once)

// One operand: element (r, k) at base + r*sr + k*sk (in elements), bf16 bits or float32.
struct Operand {
  const void* base;
  int64_t sr, sk;
  bool f32;
};

inline uint32_t bf16_bits(const Operand& o, int64_t r, int64_t k) {
  if (!o.f32) return static_cast<const uint16_t*>(o.base)[r * o.sr + k * o.sk];
  float x = static_cast<const float*>(o.base)[r * o.sr + k * o.sk];
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN stays NaN
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
}

// Sixteen values of row r from column j (`n` <= 16 of them, zero past), as bf16 bits in 16-bit lanes.
inline __m256i row16(const Operand& o, int64_t r, int64_t j, int64_t n) {
  const __mmask16 m = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
  if (o.f32) {
    const float* x = static_cast<const float*>(o.base) + r * o.sr + j;
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x));
  }
  return _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(o.base) + r * o.sr + j);
}

// In place: the 16x16 matrix of 32-bit values whose rows are r[0..15] is transposed.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + w]: column w of each 128-bit lane, rows 4g..4g+3
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int w = 0; w < 4; ++w) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[w], u[4 + w], 0x88), v4 = _mm512_shuffle_i32x4(u[w], u[4 + w], 0xdd);
    const __m512i v8 = _mm512_shuffle_i32x4(u[8 + w], u[12 + w], 0x88);
    const __m512i v12 = _mm512_shuffle_i32x4(u[8 + w], u[12 + w], 0xdd);
    r[w] = _mm512_shuffle_i32x4(v0, v8, 0x88);
    r[4 + w] = _mm512_shuffle_i32x4(v4, v12, 0x88);
    r[8 + w] = _mm512_shuffle_i32x4(v0, v8, 0xdd);
    r[12 + w] = _mm512_shuffle_i32x4(v4, v12, 0xdd);
  }
}

// Packs rows [r0, r0 + L) (zero past `rows`) and all K of `o` into pairs: out[p*L + j] =
// bits(r0 + j, 2p) | bits(r0 + j, 2p + 1) << 16, zero past K. For operands whose pairs are
// contiguous along each row (sk == 1) or strided both ways; `pack_lines` takes sr == 1.
void pack_panel(const Operand& o, int64_t r0, int64_t rows, int64_t K, int64_t L, uint32_t* out) {
  const int64_t P = (K + 1) / 2;
  const int64_t nr = std::min(L, rows - r0);
  if (nr < L || (K & 1)) std::fill(out, out + P * L, 0u);
  if (o.sk == 1) {
    // 16 rows x 16 pairs at a time, read as vectors (fp32 rows rounded to bf16 pairs),
    // transposed, stored as 16 lanes of 16 pair rows
    const int64_t pv = (K / 2) / 16 * 16;
    for (int64_t j0 = 0; j0 < nr; j0 += 16) {
      const int64_t nj = std::min<int64_t>(16, nr - j0);
      const __mmask16 keep = static_cast<__mmask16>((1u << nj) - 1);
      for (int64_t p0 = 0; p0 < pv; p0 += 16) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) {
          if (i >= nj) {
            r[i] = _mm512_setzero_si512();
          } else if (o.f32) {
            const float* x = static_cast<const float*>(o.base) + (r0 + j0 + i) * o.sr + 2 * p0;
            r[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
          } else {
            r[i] = _mm512_loadu_si512(static_cast<const uint16_t*>(o.base) + (r0 + j0 + i) * o.sr + 2 * p0);
          }
        }
        transpose16(r);
        for (int64_t q = 0; q < 16; ++q) _mm512_mask_storeu_epi32(out + (p0 + q) * L + j0, keep, r[q]);
      }
      for (int64_t j = j0; j < j0 + nj; ++j)
        for (int64_t p = pv; p < P; ++p) {
          const uint32_t lo = bf16_bits(o, r0 + j, 2 * p);
          const uint32_t hi = 2 * p + 1 < K ? bf16_bits(o, r0 + j, 2 * p + 1) : 0u;
          out[p * L + j] = lo | (hi << 16);
        }
    }
    return;
  }
  for (int64_t j = 0; j < nr; ++j)
    for (int64_t p = 0; p < P; ++p) {
      const uint32_t lo = bf16_bits(o, r0 + j, 2 * p);
      const uint32_t hi = 2 * p + 1 < K ? bf16_bits(o, r0 + j, 2 * p + 1) : 0u;
      out[p * L + j] = lo | (hi << 16);
    }
}

// An operand whose rows are contiguous (sr == 1: the reduction index k strides), packed in
// panels of L rows (L = 12 or 32) as pack_panel lays them out, pairs p in [p0, p1): the two
// k-lines of a pair read once, merged 16 lanes (or a 12-row panel) at a time.
void pack_lines(const Operand& o, int64_t rows, int64_t K, int64_t L, int64_t p0, int64_t p1, uint32_t* out) {
  const Operand t{o.base, o.sk, 1, o.f32};  // read as its transpose: row k, column r
  const int64_t P = (K + 1) / 2, npanel = (rows + L - 1) / L;
  const int64_t step = L == 32 ? 16 : L;
  const __mmask16 keep = static_cast<__mmask16>((1u << step) - 1);
  for (int64_t p = p0; p < p1; ++p) {
    const bool two = 2 * p + 1 < K;
    for (int64_t q = 0; q < npanel; ++q)
      for (int64_t off = 0; off < L; off += step) {
        const int64_t r = q * L + off;
        const int64_t n = std::max<int64_t>(0, std::min<int64_t>(step, rows - r));
        const __m512i lo = _mm512_cvtepu16_epi32(row16(t, 2 * p, r, n));
        const __m512i hi = two ? _mm512_cvtepu16_epi32(row16(t, 2 * p + 1, r, n)) : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(out + q * P * L + p * L + off, keep, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
  }
}

// C[rows<=MR, cols<=NR] (ldc) = or += alpha * Ap·Bp over `np` pairs of a packed A panel
// (12 words a pair, broadcast) and B panel (32 words a pair, two vectors); `next`: the C
// tile of the next call, prefetched while this one computes (or null).
void tile_kernel(const uint32_t* ap, const uint32_t* bp, int64_t np, float* c, int64_t ldc, int64_t rows,
                 int64_t cols, float alpha, bool add, const float* next) {
  __m512 acc[kMR][2];
  for (int i = 0; i < kMR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  if (next)
    for (int i = 0; i < kMR; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + i * ldc + 16), _MM_HINT_T0);
    }
  for (int64_t p = 0; p < np; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + p * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + p * kNR + 16);
    const uint32_t* a = ap + p * kMR;
#pragma GCC unroll 12
    for (int i = 0; i < kMR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int64_t i = 0; i < rows; ++i) {
    float* ci = c + i * ldc;
    __m512 r0, r1;  // alpha·acc + C in one rounding (fused multiply-add), as tile_kernel_at does
    if (add) {
      r0 = _mm512_fmadd_ps(acc[i][0], va, _mm512_maskz_loadu_ps(m0, ci));
      r1 = _mm512_fmadd_ps(acc[i][1], va, _mm512_maskz_loadu_ps(m1, ci + 16));
    } else {
      r0 = _mm512_mul_ps(acc[i][0], va);
      r1 = _mm512_mul_ps(acc[i][1], va);
    }
    _mm512_mask_storeu_ps(ci, m0, r0);
    _mm512_mask_storeu_ps(ci + 16, m1, r1);
  }
}
// The transposed tile: C[cols<=NR, rows<=MR] (ldc) = or += alpha * (A·Bp)ᵗ, A read in place:
// row i's pair p is the 32-bit word a[i*lda + p] (a bf16 matrix whose rows run along the
// reduction, as a row-major weight's do), so A needs no packing; Bp a packed 32-column panel.
// The 12x32 accumulator tile is transposed in registers (two 16x16 transposes) and stored
// as 32 rows of 12 values.
void tile_kernel_at(const uint32_t* a, int64_t lda, const uint32_t* bp, int64_t np, float* c, int64_t ldc,
                    int64_t rows, int64_t cols, float alpha, bool add) {
  __m512 acc[kMR][2];
  const uint32_t* ar[kMR];
  for (int i = 0; i < kMR; ++i) {
    acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    ar[i] = a + (i < rows ? i : 0) * lda;  // rows past the edge read row 0, their sums dropped
  }
  for (int64_t p = 0; p < np; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + p * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + p * kNR + 16);
#pragma GCC unroll 12
    for (int i = 0; i < kMR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(ar[i][p]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int h = 0; h < 2; ++h) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < kMR ? _mm512_castps_si512(acc[i][h]) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t t = 0; t < 16 && h * 16 + t < cols; ++t) {
      float* ct = c + (h * 16 + t) * ldc;
      const __m512 s = _mm512_castsi512_ps(r[t]);  // alpha·sum + C in one rounding, as tile_kernel does
      _mm512_mask_storeu_ps(ct, keep, add ? _mm512_fmadd_ps(s, va, _mm512_maskz_loadu_ps(keep, ct)) : _mm512_mul_ps(s, va));
    }
  }
}
#pragma GCC pop_options
#endif

#ifdef MEMOPD_HAVE_BF16_KERNEL
// body(i0, i1) over [lo, hi) split evenly on up to nt std::threads (the caller's one included)
template <class Body>
void run_split(int64_t nt, int64_t lo, int64_t hi, Body body) {
  if (nt <= 1 || hi - lo < 2) return body(lo, hi);
  std::vector<std::thread> pool;
  const int64_t step = (hi - lo + nt - 1) / nt;
  for (int64_t s = lo + step; s < hi; s += step) pool.emplace_back(body, s, std::min(hi, s + step));
  body(lo, std::min(hi, lo + step));
  for (auto& th : pool) th.join();
}

// The `rows` rows of operand o (K reduction values each) in panels of L rows of pairs
// (pack_panel's layout, panel q at out + q*P*L), on up to nt threads.
void pack_operand(const Operand& o, int64_t rows, int64_t K, int64_t L, uint32_t* out, int64_t nt) {
  const int64_t P = (K + 1) / 2, np = (rows + L - 1) / L;
  if (o.sr == 1)  // rows contiguous: two k-lines at a time
    run_split(nt, 0, P, [&](int64_t p0, int64_t p1) { pack_lines(o, rows, K, L, p0, p1, out); });
  else
    run_split(nt, 0, np, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) pack_panel(o, q * L, rows, K, L, out + q * P * L);
    });
}
#endif

bool cpu_has_bf16() {
#ifdef MEMOPD_HAVE_BF16_KERNEL
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

// The checks both GEMMs share, for an output of `rows` x `cols` floats (row stride ok when
// `ld_ok`): throws on a CPU without the kernel, bad sizes or null buffers; with K == 0 it
// zeroes the output (unless accumulating). True when the GEMM has work left to do.
bool gemm_prologue(const char* name, int64_t rows, int64_t cols, int64_t K, bool ld_ok, uintptr_t a, uintptr_t b,
                   uintptr_t c, int64_t ldc, bool accumulate) {
  const std::string n(name);
  if (!cpu_has_bf16()) throw std::runtime_error(n + ": this CPU has no AVX512-BF16");
  if (rows < 0 || cols < 0 || K < 0 || !ld_ok) throw std::invalid_argument(n + ": bad sizes");
  if (rows == 0 || cols == 0) return false;
  if (c == 0) throw std::invalid_argument(n + ": null output buffer");
  if (K == 0) {
    float* C = reinterpret_cast<float*>(c);
    if (!accumulate)
      for (int64_t i = 0; i < rows; ++i) std::fill(C + i * ldc, C + i * ldc + cols, 0.0f);
    return false;
  }
  if (a == 0 || b == 0) throw std::invalid_argument(n + ": null operand buffer");
  return true;
}

// C [M, N] (row stride ldc) = alpha·A·B (+ C if accumulate), A [M, K] and B [K, N] given by
// their element strides; a_f32 / b_f32: the operand is float32, rounded to bf16 on packing.
void bf16_gemm(uintptr_t a, int64_t a_sm, int64_t a_sk, bool a_f32, uintptr_t b, int64_t b_sk, int64_t b_sn,
               bool b_f32, uintptr_t c, int64_t ldc, int64_t M, int64_t N, int64_t K, float alpha, bool accumulate,
               int threads) {
  if (!gemm_prologue("bf16_gemm", M, N, K, ldc >= N, a, b, c, ldc, accumulate)) return;
  float* C = reinterpret_cast<float*>(c);
#ifdef MEMOPD_HAVE_BF16_KERNEL
  py::gil_scoped_release release;
  const Operand A{reinterpret_cast<const void*>(a), a_sm, a_sk, a_f32};
  const Operand B{reinterpret_cast<const void*>(b), b_sn, b_sk, b_f32};  // rows of B's panels: the columns n
  const int64_t P = (K + 1) / 2;
  const int64_t mp = (M + kMR - 1) / kMR, npan = (N + kNR - 1) / kNR;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, mp / 4));
  auto run = [&](int64_t lo, int64_t hi, auto body) { run_split(nt, lo, hi, body); };
  // A, the broadcast side, and B, the vector side: panels of 12 rows / 32 columns of pairs
  thread_local std::vector<uint32_t> abuf, bbuf;  // (only their pointers go to the threads)
  auto pack = [&](const Operand& o, int64_t rows, int64_t L, std::vector<uint32_t>& buf) {
    buf.resize(static_cast<size_t>((rows + L - 1) / L * P * L));
    pack_operand(o, rows, K, L, buf.data(), nt);
    return buf.data();
  };
  const uint32_t* ap = pack(A, M, kMR, abuf);
  const uint32_t* bp = pack(B, N, kNR, bbuf);
  const int64_t nkc = (P + kKCP - 1) / kKCP, kcp = (P + nkc - 1) / nkc;  // even cache blocks of pairs
  run(0, mp, [&](int64_t i0, int64_t i1) {
    for (int64_t kc = 0; kc < P; kc += kcp) {
      const int64_t np = std::min(kcp, P - kc);
      const bool add = accumulate || kc > 0;
      for (int64_t jc = 0; jc < npan; jc += kNCP) {
        const int64_t j1 = std::min(npan, jc + kNCP);
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = jc; j < j1; ++j) {
            const float* next = j + 1 < j1 ? C + i * kMR * ldc + (j + 1) * kNR
                                : i + 1 < i1 ? C + (i + 1) * kMR * ldc + jc * kNR : nullptr;
            tile_kernel(ap + i * P * kMR + kc * kMR, bp + j * P * kNR + kc * kNR, np, C + i * kMR * ldc + j * kNR,
                        ldc, std::min(kMR, M - i * kMR), std::min(kNR, N - j * kNR), alpha, add, next);
          }
      }
    }
  });
#else
  (void)a_sm; (void)a_sk; (void)a_f32; (void)b_sk; (void)b_sn; (void)b_f32; (void)alpha; (void)threads;
#endif
}


// The packed form of a [K, N] operand B for bf16_gemm_at (32-column panels of pairs), from
// its element strides, into `out` (bf16_packed_words(N, K) 32-bit words): packed once,
// it serves every GEMM against the same B (the hidden rows of a token block, against each
// weight chunk in turn).
int64_t bf16_packed_words(int64_t N, int64_t K) { return (N + kNR - 1) / kNR * ((K + 1) / 2) * kNR; }

void bf16_pack_b(uintptr_t b, int64_t b_sk, int64_t b_sn, bool b_f32, int64_t K, int64_t N, uintptr_t out,
                 int threads) {
  if (!cpu_has_bf16()) throw std::runtime_error("bf16_pack_b: this CPU has no AVX512-BF16");
  if (K < 0 || N < 0) throw std::invalid_argument("bf16_pack_b: bad sizes");
  if (K == 0 || N == 0) return;
  if (b == 0 || out == 0) throw std::invalid_argument("bf16_pack_b: null buffer");
#ifdef MEMOPD_HAVE_BF16_KERNEL
  py::gil_scoped_release release;
  const Operand B{reinterpret_cast<const void*>(b), b_sn, b_sk, b_f32};
  pack_operand(B, N, K, kNR, reinterpret_cast<uint32_t*>(out), std::max(1, threads));
#else
  (void)b_sk; (void)b_sn; (void)b_f32; (void)threads;
#endif
}

// Cᵗ: C [N, M] (row stride ldc) = alpha·(A·B)ᵗ (+ C if accumulate), A [M, K] bf16 with unit
// stride along K, an even K, a 4-byte aligned base and an even row stride lda (its pairs
// are then 32-bit words in place: no packing), B [K, N] packed by bf16_pack_b. For the
// logits: A a row-major weight chunk, B the block's hidden rows, C the [rows, chunk] logits.
void bf16_gemm_at(uintptr_t a, int64_t lda, uintptr_t bpacked, uintptr_t c, int64_t ldc, int64_t M, int64_t N,
                  int64_t K, float alpha, bool accumulate, int threads) {
  if (lda < K || (K & 1) || (lda & 1) || (a & 3))
    throw std::invalid_argument("bf16_gemm_at: A's pairs are not aligned 32-bit words (lda >= K, both even, "
                                "4-byte aligned base)");
  // the output is Cᵗ: N rows of M values
  if (!gemm_prologue("bf16_gemm_at", N, M, K, ldc >= M, a, bpacked, c, ldc, accumulate)) return;
  float* C = reinterpret_cast<float*>(c);
#ifdef MEMOPD_HAVE_BF16_KERNEL
  py::gil_scoped_release release;
  const uint32_t* A = reinterpret_cast<const uint32_t*>(a);
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bpacked);
  const int64_t P = K / 2, la = lda / 2;
  const int64_t mp = (M + kMR - 1) / kMR, npan = (N + kNR - 1) / kNR;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, mp / 4));
  const int64_t nkc = (P + kKCP - 1) / kKCP, kcp = (P + nkc - 1) / nkc;
  run_split(nt, 0, mp, [&](int64_t i0, int64_t i1) {
    for (int64_t kc = 0; kc < P; kc += kcp) {
      const int64_t np = std::min(kcp, P - kc);
      const bool add = accumulate || kc > 0;
      for (int64_t jc = 0; jc < npan; jc += kNCPAT) {  // B panels reused from L2, A's 12 rows from L1
        const int64_t j1 = std::min(npan, jc + kNCPAT);
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = jc; j < j1; ++j)
            tile_kernel_at(A + i * kMR * la + kc, la, bp + j * P * kNR + kc * kNR, np, C + j * kNR * ldc + i * kMR,
                           ldc, std::min(kMR, M - i * kMR), std::min(kNR, N - j * kNR), alpha, add);
      }
    }
  });
#else
  (void)lda; (void)ldc; (void)alpha; (void)threads;
#endif
}
}  // namespace

void register_bf16_gemm(py::module_& m) {
  m.def("bf16_gemm_available", &cpu_has_bf16,
        "Whether bf16_gemm runs on this CPU (AVX512-BF16 and a build with its kernel).");
  m.def("bf16_gemm", &bf16_gemm, py::arg("a"), py::arg("a_sm"), py::arg("a_sk"), py::arg("a_f32"), py::arg("b"),
        py::arg("b_sk"), py::arg("b_sn"), py::arg("b_f32"), py::arg("c"), py::arg("ldc"), py::arg("M"), py::arg("N"),
        py::arg("K"), py::arg("alpha"), py::arg("accumulate"), py::arg("threads"),
        "C[M, N] (float32, row stride ldc) = alpha A B (+ C if accumulate): A [M, K] and B [K, N] by data "
        "pointer and element strides, bf16 bits, or float32 (a_f32 / b_f32) rounded to bf16 (nearest even) "
        "when packed; products exact, fp32 accumulation.");
  m.def("bf16_packed_words", &bf16_packed_words, py::arg("N"), py::arg("K"),
        "32-bit words of bf16_pack_b's packed form of a [K, N] operand.");
  m.def("bf16_pack_b", &bf16_pack_b, py::arg("b"), py::arg("b_sk"), py::arg("b_sn"), py::arg("b_f32"), py::arg("K"),
        py::arg("N"), py::arg("out"), py::arg("threads"),
        "Packs B [K, N] (bf16 bits, or float32 rounded to bf16) for bf16_gemm_at into out.");
  m.def("bf16_gemm_at", &bf16_gemm_at, py::arg("a"), py::arg("lda"), py::arg("bpacked"), py::arg("c"), py::arg("ldc"),
        py::arg("M"), py::arg("N"), py::arg("K"), py::arg("alpha"), py::arg("accumulate"), py::arg("threads"),
        "C[N, M] (float32, row stride ldc) = alpha (A B)^T (+ C if accumulate): A [M, K] bf16 read in place (unit "
        "stride along K, even K and lda, 4-byte aligned), B packed by bf16_pack_b.");
}
