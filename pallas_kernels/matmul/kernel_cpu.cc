// Matmul over stacked per-layer weights for XLA:CPU, called through the XLA FFI:
// y [M, N] f32 = x [M, K] f32 @ W[layer], W bf16 (as bf16 or its uint16 bits) or f32, read in place.
//
// Why not XLA's dot: a layer scan slices (copies) each layer's weights before its dot, and XLA:CPU
// runs bf16 weights slower than f32 ones on AVX2 (3x at M = 1, ~1.4x at M = 64). Here bf16 is
// converted in registers or in cache, so it runs at f32 speed with half the bytes.
//
// W is packed [L, S, K, 16] (`pack` in kernel_cpu.py): the N columns in S strips of 16, each
// strip [K, 16] contiguous, the last one zero-padded. bf16 strips keep their 16 columns in the
// order 0 8 1 9 ... 7 15, which the shift-and-mask conversion below turns into columns 0-7 and
// 8-15. Up to 4 rows the tasks stream whole strips (one sequential read each, no partial sums);
// more rows run the register-blocked `Gemm`, which needs f32 strips: f32 weights are read as
// they are, bf16 ones converted a tile at a time.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"

namespace ffi = xla::ffi;

static inline float Bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline float ToF32(float v) { return v; }
static inline float ToF32(uint16_t v) { return Bf16(v); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// 16 bf16 as two f32 vectors, elements [0 2 4 .. 14] and [1 3 .. 15]: a shift and a mask, no
// shuffles (hence the column order of packed bf16 strips).
static inline void Split(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)));
}
// 16 packed values -> columns 0-7 and 8-15 as f32.
static inline void Load16(const uint16_t* p, __m256& lo, __m256& hi) { Split(p, lo, hi); }
static inline void Load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
}
#endif

constexpr int64_t kNr = 16;  // strip width: columns of a packed strip and of a register block

// Position j of a packed bf16 strip holds column Col(j) (the order `Split` undoes).
static inline int64_t Col(int64_t j) { return (j & 1) * 8 + j / 2; }

// y[m, 0:cols] = x[m] @ strip (one packed strip [K, 16], cols <= 16 of it stored) for m < R.
// U independent accumulator pairs per row hide the FMA latency; one sequential read.
template <int R, int U, typename T>
static void StripRows(const float* x, int64_t K, const T* s, float* y, int64_t ldy,
                      int64_t cols) {
  float out[R][kNr];
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R][U][2];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u][0] = acc[r][u][1] = _mm256_setzero_ps();
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; ++u) {
      __m256 lo, hi;
      Load16(s + (k + u) * kNr, lo, hi);
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_set1_ps(x[r * K + k + u]);
        acc[r][u][0] = _mm256_fmadd_ps(b, lo, acc[r][u][0]);
        acc[r][u][1] = _mm256_fmadd_ps(b, hi, acc[r][u][1]);
      }
    }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u)
      for (int h = 0; h < 2; ++h) acc[r][0][h] = _mm256_add_ps(acc[r][0][h], acc[r][u][h]);
    _mm256_storeu_ps(out[r], acc[r][0][0]), _mm256_storeu_ps(out[r] + 8, acc[r][0][1]);
  }
#else
  for (int r = 0; r < R; ++r) std::fill(out[r], out[r] + kNr, 0.f);
#endif
  for (; k < K; ++k)
    for (int64_t j = 0; j < kNr; ++j) {
      const float w = ToF32(s[k * kNr + j]);
      const int64_t c = std::is_same_v<T, uint16_t> ? Col(j) : j;
      for (int r = 0; r < R; ++r) out[r][c] += x[r * K + k] * w;
    }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, out[r], sizeof(float) * cols);
}

// Few rows, packed W: tasks are runs of whole strips, several per thread so that a thread that
// starts late takes fewer.
template <typename T>
static void KnStream(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                     const T* w, float* y) {
  const int64_t strips = (N + kNr - 1) / kNr;
  const int64_t per = std::max<int64_t>(1, strips / (4 * pool.num_threads()));
  ParallelFor(pool, (strips + per - 1) / per, [&](int64_t t) {
    for (int64_t s = t * per, end = std::min(strips, s + per); s < end; ++s) {
      const T* p = w + s * K * kNr;
      float* ys = y + s * kNr;
      const int64_t cols = std::min(kNr, N - s * kNr);
      switch (M) {
        case 1: StripRows<1, 4>(x, K, p, ys, N, cols); break;
        case 2: StripRows<2, 2>(x, K, p, ys, N, cols); break;
        case 3: StripRows<3, 1>(x, K, p, ys, N, cols); break;
        default: StripRows<4, 1>(x, K, p, ys, N, cols); break;
      }
    }
  });
}

// Many rows: a 6 x 16 register block runs down K for every 6 rows of x against a strip, in f32
// (bf16 strips converted a tile of 2-4 strips at a time).
constexpr int64_t kTile = 64, kMr = 6, kMc = 48, kKc = 256;
typedef float v8 __attribute__((vector_size(32)));

// out(r, i) = sum_k a[r * lda + k] * b[k * kNr + i] for r < R, i < cols, k < K (b: one strip);
// stored to (or, with add, added to) y[r * ldy + i].
template <int R>
static void Micro(const float* a, int64_t lda, int64_t K, const float* b, float* y, int64_t ldy,
                  int64_t cols, bool add) {
  v8 acc[R][2] = {};
  for (int64_t k = 0; k < K; ++k) {
    v8 w0, w1;
    std::memcpy(&w0, b + k * kNr, sizeof w0);
    std::memcpy(&w1, b + k * kNr + 8, sizeof w1);
    for (int r = 0; r < R; ++r) {
      const float av = a[r * lda + k];
      acc[r][0] += av * w0;
      acc[r][1] += av * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kNr];
    std::memcpy(out, acc[r], sizeof out);
    float* yr = y + r * ldy;
    if (!add)
      std::memcpy(yr, out, sizeof(float) * cols);
    else if (cols == kNr)  // the usual case, as whole vectors
      for (int64_t i = 0; i < kNr; ++i) yr[i] += out[i];
    else
      for (int64_t i = 0; i < cols; ++i) yr[i] += out[i];
  }
}

// Rows [0, rows) of x (at most kMc) against the tile's columns [0, cols): K in chunks of kKc,
// then, as in BLIS, each strip of the chunk (kKc x kNr, contiguous: 16 KB) stays in L1 while
// every 6-row block of x runs against it.
static void BlockRows(const float* x, int64_t rows, int64_t K, const float* tile, int64_t cols,
                      float* y, int64_t ldy) {
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool add = k0 > 0;
    for (int64_t s = 0; s < cols; s += kNr) {
      const float* b = tile + s * K + k0 * kNr;  // strip s / kNr, row k0
      const int64_t c = std::min(kNr, cols - s);
      for (int64_t r = 0; r < rows; r += kMr) {
        const float* xr = x + r * K + k0;
        float* yr = y + r * ldy + s;
        switch (std::min(kMr, rows - r)) {
          case 6: Micro<6>(xr, K, kc, b, yr, ldy, c, add); break;
          case 5: Micro<5>(xr, K, kc, b, yr, ldy, c, add); break;
          case 4: Micro<4>(xr, K, kc, b, yr, ldy, c, add); break;
          case 3: Micro<3>(xr, K, kc, b, yr, ldy, c, add); break;
          case 2: Micro<2>(xr, K, kc, b, yr, ldy, c, add); break;
          default: Micro<1>(xr, K, kc, b, yr, ldy, c, add); break;
        }
      }
    }
  }
}

// n packed bf16 strip rows (16 values each) -> f32 in column order.
static void Unpack(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i < n; ++i) {
    __m256 lo, hi;
    Load16(src + i * kNr, lo, hi);
    _mm256_storeu_ps(dst + i * kNr, lo), _mm256_storeu_ps(dst + i * kNr + 8, hi);
  }
#endif
  for (; i < n; ++i)
    for (int64_t j = 0; j < kNr; ++j) dst[i * kNr + Col(j)] = Bf16(src[i * kNr + j]);
}

// Tasks: tiles of 2-4 strips, each against all rows, kMc at a time: their K-chunk (48 KB) and
// their y (added to once per chunk) stay in L2 (at 2048 rows, running all rows per chunk was 14%
// slower than XLA's dot).
template <typename T>
static void Gemm(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                 const T* w, float* y) {
  // Tiles half as wide when few 64-column ones would not share evenly between the threads
  // (9 tiles on 2 threads: one does 5; 10-15% at N = 576 and 960, 64 rows).
  const int64_t tiles = (N + kTile - 1) / kTile, threads = pool.num_threads();
  const int64_t tw = tiles % threads && tiles < 8 * threads ? kTile / 2 : kTile;
  ParallelFor(pool, (N + tw - 1) / tw, [&](int64_t t) {
    const int64_t c0 = t * tw, nc = std::min(tw, N - c0);
    const T* strips = w + c0 * K;  // strip c0 / kNr
    const float* tile;
    if constexpr (std::is_same_v<T, float>) {
      tile = strips;
    } else {
      thread_local std::vector<float> converted;
      converted.resize(K * tw);
      Unpack(strips, (nc + kNr - 1) / kNr * K, converted.data());
      tile = converted.data();
    }
    for (int64_t m0 = 0; m0 < M; m0 += kMc)
      BlockRows(x + m0 * K, std::min(kMc, M - m0), K, tile, nc, y + m0 * N + c0, N);
  });
}

// Up to kFewRows rows stream the weights; more run the register-blocked Gemm.
constexpr int64_t kFewRows = 4;

static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != 4)
    return ffi::Error::InvalidArgument("matmul: ranks");
  const int64_t M = xd[0], K = xd[1], L = wd[0], S = wd[1], N = yd[1];
  if (wd[2] != K) return ffi::Error::InvalidArgument("matmul: K differs");
  if (S != (N + kNr - 1) / kNr || wd[3] != kNr)
    return ffi::Error::InvalidArgument("matmul: N differs");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("matmul: layer out of range");
  auto run = [&](const auto* wl) {  // the layer's strips
    if (M > kFewRows) return Gemm(pool, x.typed_data(), M, K, N, wl, y->typed_data());
    KnStream(pool, x.typed_data(), M, K, N, wl, y->typed_data());
  };
  switch (w.element_type()) {
    case ffi::F32:
      run(static_cast<const float*>(w.untyped_data()) + l * S * K * kNr);
      break;
    case ffi::BF16:
    case ffi::U16:
      run(static_cast<const uint16_t*>(w.untyped_data()) + l * S * K * kNr);
      break;
    default:
      return ffi::Error::InvalidArgument("matmul: weights must be f32, bf16 or uint16 bf16 bits");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
