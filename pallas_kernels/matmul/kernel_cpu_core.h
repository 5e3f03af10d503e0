// The matmul's core, shared by the kernels that run it (matmul/kernel_cpu.cc, and
// grouped_matmul/kernel_cpu.cc per expert): the packed-strip layout, the streaming
// (`KnStream`) and register-blocked (`Gemm`, and for bf16 x `BfGemm`: AMX or vdpbf16ps) paths
// and the result writer `Out`.
// See kernel_cpu.cc for the layout and the summation order every path keeps.
#ifndef JAXLLM_MATMUL_KERNEL_CPU_CORE_H_
#define JAXLLM_MATMUL_KERNEL_CPU_CORE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activation/silu_mul.h"
#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace ffi = xla::ffi;

constexpr int64_t kNr = 16;  // strip width: columns of a packed strip and of a register block

// Rows a strip stores for K: bf16 strips hold whole pairs.
template <typename T>
static inline int64_t StripRowsOf(int64_t K) {
  return std::is_same_v<T, uint16_t> ? K + K % 2 : K;
}
// W[k, j] of a packed strip s, as f32.
static inline float At(const float* s, int64_t k, int64_t j) { return s[k * kNr + j]; }
static inline float At(const uint16_t* s, int64_t k, int64_t j) {
  return ToF32(s[(k - k % 2) * kNr + 2 * j + k % 2]);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// Rows k .. k + kStep - 1 of a packed strip as f32: lo[t] columns 0-7 and hi[t] columns 8-15 of
// row k + t. bf16 (k even): each 32-bit lane holds a column's pair, split by a shift and a mask.
template <typename T>
constexpr int kStep = std::is_same_v<T, uint16_t> ? 2 : 1;
static inline void Rows(const float* s, int64_t k, __m256* lo, __m256* hi) {
  lo[0] = _mm256_loadu_ps(s + k * kNr), hi[0] = _mm256_loadu_ps(s + k * kNr + 8);
}
static inline void Rows(const uint16_t* s, int64_t k, __m256* lo, __m256* hi) {
  const __m256i mask = _mm256_set1_epi32(0xFFFF0000);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + k * kNr + 16 * h));
    __m256* out = h ? hi : lo;
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    out[1] = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
  }
}
#endif

// Every element of y is one chain of fused multiply-adds down K in order, from zero:
// acc = fma(x[m, k], W[k, n], acc) for k = 0 .. K - 1, whatever M and whichever path runs it
// (streaming or blocked, f32 or bf16 strips), so a row's result never depends on the rows that
// share the call (batch invariance: issue 26). Paths differ only in how many chains run side by
// side. An FMA is exactly rounded, so the vector and scalar forms give the same bits.
#if defined(__FMA__)
static inline float FmaF(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
static inline float FmaF(float a, float b, float c) { return a * b + c; }
#endif
static inline v8 Fma8(v8 a, v8 b, v8 c) {
#if defined(__AVX2__) && defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

#include "matmul/kernel_cpu_stream.h"  // StripRows, StripBlocks, KnStream: few rows

// Many rows: a 6 x 16 register block runs down K for every 6 rows of x against a strip (6 x 32
// against two strips with AVX-512), in f32 (bf16 strips converted a tile of 2-4 strips at a
// time). x is packed first, per block of rows, k-major (`PackPanels`): one pointer feeds all of
// a block's broadcasts, read in order (against 6 rows read K apart, the block ran ~20% faster
// on AVX2). A strip's K-chunk (kKc x 16 f32) stays in L1 while every block of x runs against it:
// 32 KB on AVX2 (a chain stops and resumes half as often as at 256), 16 KB for AVX-512's pair
// of strips.
#ifdef __AVX512F__
constexpr int64_t kKc = 256;
#else
constexpr int64_t kKc = 512;
#endif
constexpr int64_t kTile = 64, kMr = 6, kMc = 48;

// A region to fetch into L2 a few cache lines at a time, spread over the micro-kernel calls of a
// task: the next tile's weights. With few rows (decode), a tile's first pass over its weights
// otherwise waits on memory: an f32 [64, 768] x [768, 4096] took 2.10 ms without, 1.94-2.00 with
// (bf16: within noise, 0.95-0.97 ms).
struct Prefetch {
  const char* p = nullptr;
  int64_t lines = 0, per_call = 0;

  // Spreads the region over the calls for `rows` rows (one per register block) of `iters`
  // iterations each, one line per iteration; what is left goes to the calls after them.
  void Spread(int64_t rows, int64_t iters) {
    const int64_t calls = (rows + kMr - 1) / kMr;
    per_call = std::min(iters, (lines + calls - 1) / calls);
  }
  // The lines for the next call.
  Prefetch Take() {
    const Prefetch t{p, std::min(lines, per_call), 0};
    p += 64 * t.lines;
    lines -= t.lines;
    return t;
  }
  inline void At(int64_t i) const {
    if (i < lines) __builtin_prefetch(p + 64 * i, 0, 2);
  }
};

// f(std::integral_constant<int, R>{}) for 1 <= R <= kMr: a block's row count as a template
// argument.
template <typename F>
static inline void WithBlockRows(int64_t R, const F& f) {
  static_assert(kMr == 6, "the cases below");
  switch (R) {
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// f(r, std::integral_constant<int, R>{}) for rows [r, r + R) of [0, rows), R = kMr but the
// last: the row count of a register block (f32 and bf16 alike) as a template argument.
template <typename F>
static inline void ForRowBlocks(int64_t rows, const F& f) {
  for (int64_t r = 0; r < rows; r += kMr)
    WithBlockRows(std::min(kMr, rows - r), [&](auto R) { f(r, R); });
}

// The `Gemm`'s blocks of a chunk of rows: as even as kMr allows (64 rows: 6 blocks of 6 and 2 of
// 5 after the first 48, not 6, 6, 4), so every block keeps enough chains to hide the FMA latency.
// f(r, std::integral_constant<int, R>{}) for rows [r, r + R) of [0, rows).
template <typename F>
static inline void ForEvenBlocks(int64_t rows, const F& f) {
  const int64_t n = (rows + kMr - 1) / kMr;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t r = b * rows / n;
    WithBlockRows((b + 1) * rows / n - r, [&](auto R) { f(r, R); });
  }
}

// Rows [0, M) of x [M, K] as the `Gemm` reads them: per chunk of kMc rows, each block of
// `ForEvenBlocks` [K, R] (row r of the block at k: xp[r0 * K + k * R + r]).
static void PackPanels(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, float* xp) {
  ParallelFor(pool, (M + kMc - 1) / kMc, [&](int64_t c) {
    const int64_t m0 = c * kMc;
    ForEvenBlocks(std::min(kMc, M - m0), [&](int64_t r, auto R) {
      const float* rows = x + (m0 + r) * K;
      float* panel = xp + (m0 + r) * K;
      for (int64_t k = 0; k < K; ++k)
        for (int i = 0; i < R; ++i) panel[k * R + i] = rows[i * K + k];
    });
  });
}

// y[r * ldy + i] = the chains of rows r < R, columns i < cols, run on over k < K (a: the block's
// panel, a[k * R + r]; b: one strip) from what y holds (add: the chunks before) or from zero.
// Not inlined: inlined into `BlockRows`'s cases the same loop measured ~8% slower on AVX2.
template <int R>
__attribute__((noinline)) static void Micro(const float* a, int64_t K, const float* b, float* y, int64_t ldy,
                  int64_t cols, bool add, const Prefetch& pf) {
  v8 acc[R][2] = {};
  if (add)
    for (int r = 0; r < R; ++r) {
      float in[kNr] = {};
      std::memcpy(in, y + r * ldy, sizeof(float) * cols);
      std::memcpy(acc[r], in, sizeof in);
    }
  for (int64_t k = 0; k < K; ++k) {
    pf.At(k);
    v8 w0, w1;
    std::memcpy(&w0, b + k * kNr, sizeof w0);
    std::memcpy(&w1, b + k * kNr + 8, sizeof w1);
    for (int r = 0; r < R; ++r) {
      const v8 av = Splat8(a[k * R + r]);
      acc[r][0] = Fma8(av, w0, acc[r][0]);
      acc[r][1] = Fma8(av, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(float) * cols);
}

#ifdef __AVX512F__
// Micro for two whole strips b0, b1 at once: 6 x 32 in 512-bit registers (half the
// instructions per product of the 256-bit block).
template <int R>
static void Micro2(const float* a, int64_t K, const float* b0, const float* b1,
                   float* y, int64_t ldy, bool add, const Prefetch& pf) {
  __m512 acc[R][2];  // the chains, run on from y (add) as in Micro
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = add ? _mm512_loadu_ps(y + r * ldy + h * kNr) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.At(k);
    const __m512 w0 = _mm512_loadu_ps(b0 + k * kNr), w1 = _mm512_loadu_ps(b1 + k * kNr);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[k * R + r]);
      acc[r][0] = _mm512_fmadd_ps(av, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(y + r * ldy + h * kNr, acc[r][h]);
}
#endif

// Rows [0, rows) of x (at most kMc; xp: their panels) against the tile's columns [0, cols): K in
// chunks of kKc, then, as in BLIS, each strip of the chunk (kKc x kNr, contiguous) stays in L1
// while every block of x runs against it.
static void BlockRows(const float* xp, int64_t rows, int64_t K, const float* tile, int64_t cols,
                      float* y, int64_t ldy, Prefetch& pf) {
  pf.Spread(rows, std::min(K, kKc));
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool add = k0 > 0;
    int64_t s = 0;
#ifdef __AVX512F__
    for (; s + 2 * kNr <= cols; s += 2 * kNr) {
      const float* b = tile + s * K + k0 * kNr;
      const float* b1 = b + kNr * K;  // the next strip
      ForEvenBlocks(rows, [&](int64_t r, auto R) {
        Micro2<R>(xp + r * K + k0 * R, kc, b, b1, y + r * ldy + s, ldy, add, pf.Take());
      });
    }
#endif
    for (; s < cols; s += kNr) {
      const float* b = tile + s * K + k0 * kNr;  // strip s / kNr, row k0
      const int64_t c = std::min(kNr, cols - s);
      ForEvenBlocks(rows, [&](int64_t r, auto R) {
        Micro<R>(xp + r * K + k0 * R, kc, b, y + r * ldy + s, ldy, c, add, pf.Take());
      });
    }
  }
}

// n packed bf16 strips (K rows) -> f32 strips [K, 16].
static void Unpack(const uint16_t* src, int64_t K, int64_t n, float* dst) {
  const int64_t len = StripRowsOf<uint16_t>(K) * kNr;
  for (int64_t i = 0; i < n; ++i, src += len, dst += K * kNr) {
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; k + 2 <= K; k += 2) {
      __m256 lo[2], hi[2];
      Rows(src, k, lo, hi);
      for (int t = 0; t < 2; ++t)
        _mm256_storeu_ps(dst + (k + t) * kNr, lo[t]),
            _mm256_storeu_ps(dst + (k + t) * kNr + 8, hi[t]);
    }
#endif
    for (; k < K; ++k)
      for (int64_t j = 0; j < kNr; ++j) dst[k * kNr + j] = At(src, k, j);
  }
}

// Tasks: tiles of 2-4 strips, each against all rows, `chunk` (kMc) at a time: their K-chunk
// (48 KB) and their y (added to once per chunk) stay in L2 (at 2048 rows, running all rows per
// chunk was 14% slower than XLA's dot). tile(c0, cols) readies a task's weights and returns rows(m0, m, pf),
// which runs rows [m0, m0 + m) against them, prefetching pf (the first rows only: the thread's
// next tile; w holds col_bytes per column).
template <typename Tile>
static void ForTiles(ffi::ThreadPool& pool, int64_t M, int64_t N, const void* w,
                     int64_t col_bytes, const Tile& tile, int64_t chunk = kMc) {
  // Tiles half as wide when few 64-column ones would not share evenly between the threads
  // (9 tiles on 2 threads: one does 5; 10-15% at N = 576 and 960, 64 rows).
  const int64_t tiles = (N + kTile - 1) / kTile, threads = pool.num_threads();
  const int64_t tw = tiles % threads && tiles < 8 * threads ? kTile / 2 : kTile;
  const int64_t padded = (N + kNr - 1) / kNr * kNr;  // columns stored
  ParallelForAhead(pool, (N + tw - 1) / tw, [&](int64_t t, int64_t next) {
    const int64_t c0 = t * tw;
    Prefetch pf;
    if (next >= 0) {
      pf.p = static_cast<const char*>(w) + next * tw * col_bytes;
      pf.lines = std::min(tw, padded - next * tw) * col_bytes / 64;
    }
    const auto rows = tile(c0, std::min(tw, N - c0));
    for (int64_t m0 = 0; m0 < M; m0 += chunk)
      rows(m0, std::min(chunk, M - m0), m0 ? Prefetch{} : pf);
  });
}

// f32 rows [rows, cols] (ld apart) -> bf16 bits rounded to nearest even (ldd apart).
static void RoundRows(const float* src, int64_t ld, int64_t rows, int64_t cols, uint16_t* dst,
                      int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r, src += ld, dst += ldd) {
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) Store8(Load8(src + c), dst + c);
    for (; c < cols; ++c) dst[c] = ToBF16(src[c]);
  }
}

// Per row and strip of 16 columns: the maximum of f32 rows [rows, cols] (ld apart; columns
// from c0, a multiple of 16) and its first column, into best / col [rows, S] (ldb apart). With a
// NaN in a strip, its column is unspecified.
static void StripMax(const float* src, int64_t ld, int64_t rows, int64_t c0, int64_t cols,
                     float* best, int32_t* col, int64_t ldb) {
  for (int64_t r = 0; r < rows; ++r, src += ld, best += ldb, col += ldb)
    for (int64_t c = 0; c < cols; c += kNr) {
      const int64_t n = std::min(kNr, cols - c), s = (c0 + c) / kNr;
      int64_t at = 0;
#ifdef __AVX512F__
      const __mmask16 valid = (1u << n) - 1;  // missing columns read as -inf
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, src + c);
      const float m = _mm512_reduce_max_ps(v);
      const __mmask16 eq = _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ);
      at = eq ? __builtin_ctz(eq) : 0;
#else
      for (int64_t j = 1; j < n; ++j) at = src[c + j] > src[c + at] ? j : at;
#endif
      best[s] = src[c + at];
      col[s] = static_cast<int32_t>(c0 + c + at);
    }
}

// The result of x @ W: y [M, N] f32, written in place; or bf16, or, for a greedy LM head, each
// row's maximum and its column per strip (best / col [M, S]); or, gated, silu(gate) * up of a
// gate/up projection (W's columns [0, N) the gate, [N, 2 N) the up), f32 or bf16 [M, N]. Those
// a tile's rows reach through a thread's f32 scratch, read back while it is in cache (a 64-row
// qkv projection's f32 result took XLA 70 us to convert; 64 rows of 32000 logits took 0.9 ms to
// slice and reduce; a 2048-token MoE layer's [4096, 2048] f32 gate/up was 32 MB written to
// fresh memory and read again by the activation).
struct Out {
  float* y = nullptr;
  uint16_t* yb = nullptr;  // the bf16 result
  float* best = nullptr;   // the per-strip maxima
  int32_t* col = nullptr;
  int64_t N = 0, S = 0;
  bool gated = false;  // the scratch holds a tile's gate columns, then (kTile on) its up columns

  // Where to write f32 rows [m0, m0 + kMc) of the tile at column c0: (pointer, row stride).
  std::pair<float*, int64_t> Rows(int64_t m0, int64_t c0) const {
    if (y != nullptr && !gated) return {y + m0 * N + c0, N};
    thread_local std::vector<float> scratch(kMc * 2 * kTile);
    return {scratch.data(), gated ? 2 * kTile : kTile};
  }
  // Gated: row r's columns [c0, c0 + cols) = silu(gate) * up of the f32 sums g and u.
  void Activate(const float* g, const float* u, int64_t r, int64_t c0, int64_t cols) const {
    if (yb != nullptr) SiluMulRow(g, u, yb + r * N + c0, cols);
    else SiluMulRow(g, u, y + r * N + c0, cols);
  }
  // After the tile's rows [m0, m0 + m) are complete in `rows`.
  void Finish(std::pair<float*, int64_t> rows, int64_t m0, int64_t m, int64_t c0,
              int64_t cols) const {
    if (gated) {
      for (int64_t r = 0; r < m; ++r) {
        const float* g = rows.first + r * rows.second;
        Activate(g, g + kTile, m0 + r, c0, cols);
      }
      return;
    }
    if (yb != nullptr) RoundRows(rows.first, rows.second, m, cols, yb + m0 * N + c0, N);
    if (best != nullptr)
      StripMax(rows.first, rows.second, m, c0, cols, best + m0 * S, col + m0 * S, S);
  }
};

template <typename T>
static void Gemm(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                 const T* w, const Out& out) {
  thread_local std::vector<float> panels;  // the calling thread's: fresh memory page-faults
  panels.resize(M * K);
  PackPanels(pool, x, M, K, panels.data());
  const float* xp = panels.data();
  ForTiles(pool, M, N, w, StripRowsOf<T>(K) * sizeof(T), [&](int64_t c0, int64_t cols) {
    const T* strips = w + c0 * StripRowsOf<T>(K);  // strip c0 / kNr
    const float* tile;
    if constexpr (std::is_same_v<T, float>) {
      tile = strips;
    } else {
      thread_local std::vector<float> converted;
      converted.resize(K * kTile);
      Unpack(strips, K, (cols + kNr - 1) / kNr, converted.data());
      tile = converted.data();
    }
    return [=](int64_t m0, int64_t m, Prefetch pf) {
      const auto ys = out.Rows(m0, c0);
      BlockRows(xp + m0 * K, m, K, tile, cols, ys.first, ys.second, pf);
      out.Finish(ys, m0, m, c0, cols);
    };
  });
}

// A gated out (W's N columns: gate, then up) from a path without the gated form: run(plain)
// writes the f32 [M, N] product into a temporary, activated into out after.
template <typename Run>
static void Ungated(ffi::ThreadPool& pool, int64_t M, int64_t N, const Out& out, const Run& run) {
  std::vector<float> gu(M * N);
  Out plain;
  plain.y = gu.data(), plain.N = N;
  run(plain);
  const int64_t F = N / 2;
  ParallelFor(pool, M, [&](int64_t r) {
    const float* g = gu.data() + r * N;
    out.Activate(g, g + F, r, 0, F);
  });
}

#include "matmul/kernel_cpu_dpbf16.h"  // DpGemm, with AVX512_BF16
#include "matmul/kernel_cpu_amx.h"     // AmxGemm with AMX-BF16; BfGemm picks

// Up to FewRows rows stream the weights (`KnStream`, each strip read once for all rows); more
// run the register-blocked `Gemm` (both give the same bits).
template <typename T>
constexpr int64_t FewRows() { return kStreamRows; }

// Rows [0, M) of x (f32, K apart) against the strips w (N columns) into out, by the path their
// count takes: the matmul's dispatch, and the grouped matmul's for each group.
template <typename T>
static void RowsThrough(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                        const T* w, const Out& out) {
  if (out.gated)
    return Ungated(pool, M, N, out, [&](const Out& o) { RowsThrough(pool, x, M, K, N, w, o); });
  if (M > FewRows<T>()) return Gemm(pool, x, M, K, N, w, out);
  if (out.y != nullptr) return KnStream(pool, x, M, K, N, w, out.y);
  std::vector<float> yf(M * N);
  KnStream(pool, x, M, K, N, w, yf.data());
  out.Finish({yf.data(), N}, 0, M, 0, N);
}

#endif  // JAXLLM_MATMUL_KERNEL_CPU_CORE_H_
