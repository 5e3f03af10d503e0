// Matmul over stacked per-layer weights for XLA:CPU, called through the XLA FFI:
// y [M, N] f32 = x [M, K] f32 @ W[layer], W bf16 (as bf16 or its uint16 bits) or f32, read in place.
//
// Why not XLA's dot: a layer scan slices (copies) each layer's weights before its dot, and XLA:CPU
// runs bf16 weights slower than f32 ones on AVX2 (3x at M = 1, ~1.4x at M = 64). Here bf16 is
// converted in registers or in cache, so it runs at f32 speed with half the bytes.
//   kn: W packed [L, S, K, 16] (`pack` in kernel_cpu.py): the N columns in S strips of 16,
//       each strip [K, 16] contiguous, the last one zero-padded. bf16 strips keep their 16
//       columns in the order 0 8 1 9 ... 7 15, which the shift-and-mask conversion below turns
//       into columns 0-7 and 8-15. Up to 4 rows the tasks stream whole strips (one sequential
//       read each, no partial sums); more rows run the register-blocked `Gemm`, which needs
//       f32 strips: f32 weights are read as they are, bf16 ones converted a tile at a time.
//   nk: W [L, N, K] (y = x @ W[l].T, e.g. an embedding used as LM head). Up to 4 rows tasks
//       split N, each streaming whole rows; more rows run `Gemm` with x^T as the packed side.
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
// shuffles (hence the column order of packed bf16 strips, and `SplitOrder` for nk).
constexpr bool kSplitBf16 = true;
static inline void Split(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)));
}
// Weight rows this far ahead are requested early (nk): the hardware prefetcher alone left the
// smaller projections at ~20 GB/s (28 with this).
constexpr int64_t kPrefetchRows = 16;
static inline void Prefetch(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}
static inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr bool kSplitBf16 = false;
#endif

constexpr int64_t kNr = 16;  // strip width: columns of a packed strip and of a register block
constexpr int64_t kRows = 4;  // nk: weight rows read together

// Position j of a packed bf16 strip holds column Col(j) (the order `Split` undoes).
static inline int64_t Col(int64_t j) { return (j & 1) * 8 + j / 2; }

// Each whole group of 16 in the M rows of x [M, K] reordered as a bf16 strip is (nk: x meets
// rows of W, where `Split` separates even and odd elements).
static void SplitOrder(float* x, int64_t M, int64_t K) {
  float tmp[16];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c + 16 <= K; c += 16) {
      float* g = x + m * K + c;
      for (int64_t j = 0; j < 16; ++j) tmp[Col(j)] = g[j];
      std::memcpy(g, tmp, sizeof tmp);
    }
}

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
      __m256 lo, hi;  // columns 0-7 and 8-15
      if constexpr (std::is_same_v<T, uint16_t>) {
        Split(s + (k + u) * kNr, lo, hi);
      } else {
        lo = _mm256_loadu_ps(s + (k + u) * kNr), hi = _mm256_loadu_ps(s + (k + u) * kNr + 8);
      }
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

// Many rows: y = x @ W[l] (kn) or, for nk, y^T = W[l] @ x^T, so that W is read in place either
// way. A 6 x 16 register block runs down K for every 6 rows of one operand (x for kn, W's rows
// for nk) against a strip of 16 columns of the other, in f32: kn's packed W (bf16 converted a
// tile of 2-4 strips at a time), or for nk x^T, packed into strips once per 64 rows of x.
constexpr int64_t kTile = 64, kMr = 6, kMc = 48, kPackAhead = 16, kKc = 256;
typedef float v8 __attribute__((vector_size(32)));

// out(r, i) = sum_k a[r * lda + k] * b[k * kNr + i] for r < R, i < cols, k < K (b: one strip);
// stored to (or, with add, added to) y[r * rs + i * cs].
template <int R>
static void Micro(const float* a, int64_t lda, int64_t K, const float* b, float* y, int64_t rs,
                  int64_t cs, int64_t cols, bool add) {
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
  if (cs == 1 && cols == kNr) {  // whole rows of y: vector stores
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        v8 v = acc[r][h];
        if (add) {
          v8 old;
          std::memcpy(&old, y + r * rs + 8 * h, sizeof old);
          v += old;
        }
        std::memcpy(y + r * rs + 8 * h, &v, sizeof v);
      }
    return;
  }
  for (int r = 0; r < R; ++r) {
    float out[kNr];
    std::memcpy(out, acc[r], sizeof out);
    for (int64_t i = 0; i < cols; ++i) {
      float& dst = y[r * rs + i * cs];
      dst = (add ? dst : 0.f) + out[i];
    }
  }
}

// Rows [0, rows) of a (lda apart, at most kMc) against the tile's columns [0, cols): K in
// chunks of kKc, then, as in BLIS, each strip of the chunk (kKc x kNr, contiguous: 16 KB)
// stays in L1 while every 6-row block of a runs against it. bf16 rows are converted once per
// chunk.
template <typename A>
static void BlockRows(const A* a, int64_t lda, int64_t rows, int64_t K, const float* tile,
                      int64_t cols, float* y, int64_t rs, int64_t cs) {
  thread_local std::vector<float> converted;
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const float* ar = nullptr;
    int64_t ld = lda;
    if constexpr (std::is_same_v<A, float>) {
      ar = a + k0;
    } else {
      converted.resize(rows * kKc);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < kc; ++k) converted[i * kKc + k] = ToF32(a[i * lda + k0 + k]);
      ar = converted.data(), ld = kKc;
    }
    const bool add = k0 > 0;
    for (int64_t s = 0; s < cols; s += kNr) {
      const float* b = tile + s * K + k0 * kNr;  // strip s / kNr, row k0
      const int64_t c = std::min(kNr, cols - s);
      for (int64_t r = 0; r < rows; r += kMr) {
        const float* arr = ar + r * ld;
        float* yr = y + r * rs + s * cs;
        switch (std::min(kMr, rows - r)) {
          case 6: Micro<6>(arr, ld, kc, b, yr, rs, cs, c, add); break;
          case 5: Micro<5>(arr, ld, kc, b, yr, rs, cs, c, add); break;
          case 4: Micro<4>(arr, ld, kc, b, yr, rs, cs, c, add); break;
          case 3: Micro<3>(arr, ld, kc, b, yr, rs, cs, c, add); break;
          case 2: Micro<2>(arr, ld, kc, b, yr, rs, cs, c, add); break;
          default: Micro<1>(arr, ld, kc, b, yr, rs, cs, c, add); break;
        }
      }
    }
  }
}

// All rows, kMc at a time: their K-chunk (48 KB) and their y (added to once per chunk) stay
// in L2 (at 2048 rows, running all rows per chunk was 14% slower than XLA's dot).
template <typename A>
static void Blocks(const A* a, int64_t lda, int64_t rows, int64_t K, const float* tile,
                   int64_t cols, float* y, int64_t rs, int64_t cs) {
  for (int64_t m0 = 0; m0 < rows; m0 += kMc)
    BlockRows(a + m0 * lda, lda, std::min(kMc, rows - m0), K, tile, cols, y + m0 * rs, rs, cs);
}

// tile = columns [c0, c0 + nc) of the row-major [K, ld] matrix src in strips of kNr columns,
// [tw / kNr][K][kNr], zero-padded to tw columns.
static void PackTile(const float* src, int64_t ld, int64_t K, int64_t c0, int64_t nc, int64_t tw,
                     float* tile) {
  for (int64_t k = 0; k < K; ++k) {
    if (k + kPackAhead < K)  // rows ld apart defeat the hardware prefetcher
      for (int64_t b = 0; b < nc * int64_t{sizeof(float)}; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(src + (k + kPackAhead) * ld + c0) + b);
    const float* row = src + k * ld + c0;
    for (int64_t s = 0; s < tw; s += kNr) {
      float* dst = tile + s * K + k * kNr;
      for (int64_t j = 0; j < kNr; ++j) dst[j] = s + j < nc ? row[s + j] : 0.f;
    }
  }
}

// n packed bf16 strip rows (16 values each) -> f32 in column order.
static void Unpack(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i < n; ++i) {
    __m256 lo, hi;
    Split(src + i * kNr, lo, hi);
    _mm256_storeu_ps(dst + i * kNr, lo), _mm256_storeu_ps(dst + i * kNr + 8, hi);
  }
#endif
  for (; i < n; ++i)
    for (int64_t j = 0; j < kNr; ++j) dst[i * kNr + Col(j)] = Bf16(src[i * kNr + j]);
}

template <typename T>
static void Gemm(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                 const T* w, float* y, bool transposed) {
  if (!transposed) {  // tasks: tiles of 2-4 packed strips
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
      Blocks(x, K, M, K, tile, nc, y + c0, N, 1);
    });
    return;
  }
  std::vector<float> xt(K * M);  // x^T [K, M]
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = x[m * K + k];
  constexpr int64_t kRowsPerTask = 8 * kMr;
  for (int64_t m0 = 0; m0 < M; m0 += kTile) {  // tasks: 48-row blocks of W
    const int64_t nm = std::min(kTile, M - m0);
    std::vector<float> tile(K * kTile);
    PackTile(xt.data(), M, K, m0, nm, kTile, tile.data());
    ParallelFor(pool, (N + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t t) {
      const int64_t n0 = t * kRowsPerTask, rows = std::min(kRowsPerTask, N - n0);
      Blocks(w + n0 * K, K, rows, K, tile.data(), nm, y + m0 * N + n0, 1, N);
    });
  }
}

// y[m, n0:n0+4] = x[m] . w[n0:n0+4] for every m (rows of w are K long).
template <typename T>
static void NkRows(const float* x, int64_t M, int64_t K, const T* w, int64_t rows, float* y,
                   int64_t ldy) {
  const T *__restrict w0 = w, *__restrict w1 = w + std::min<int64_t>(1, rows - 1) * K,
          *__restrict w2 = w + std::min<int64_t>(2, rows - 1) * K,
          *__restrict w3 = w + std::min<int64_t>(3, rows - 1) * K;
  for (int64_t m = 0; m < M; ++m) {
    const float* __restrict xm = x + m * K;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, uint16_t>) {  // x arrives in [even | odd] groups
      __m256 a[8] = {};  // even and odd sums per row: eight independent chains
      for (; k + 16 <= K; k += 16) {
        const __m256 xe = _mm256_loadu_ps(xm + k), xo = _mm256_loadu_ps(xm + k + 8);
        const uint16_t* rows4[4] = {w0 + k, w1 + k, w2 + k, w3 + k};
        for (int r = 0; r < 4; ++r) {
          if (m == 0) Prefetch(rows4[r] + kPrefetchRows * K);
          __m256 e, o;
          Split(rows4[r], e, o);
          a[2 * r] = _mm256_fmadd_ps(xe, e, a[2 * r]);
          a[2 * r + 1] = _mm256_fmadd_ps(xo, o, a[2 * r + 1]);
        }
      }
      s0 = HSum(_mm256_add_ps(a[0], a[1])), s1 = HSum(_mm256_add_ps(a[2], a[3]));
      s2 = HSum(_mm256_add_ps(a[4], a[5])), s3 = HSum(_mm256_add_ps(a[6], a[7]));
    }
#endif
    for (; k < K; ++k) {
      const float v = xm[k];
      s0 += v * ToF32(w0[k]);
      s1 += v * ToF32(w1[k]);
      s2 += v * ToF32(w2[k]);
      s3 += v * ToF32(w3[k]);
    }
    const float s[4] = {s0, s1, s2, s3};
    for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = s[r];
  }
}

template <typename T>
static void Nk(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, const T* w,
               float* y) {
  constexpr int64_t kChunk = 256;  // output columns per task
  std::vector<float> split;
  if (std::is_same_v<T, uint16_t> && kSplitBf16) {  // x in the order `Split` reads W's rows
    split.assign(x, x + M * K);
    SplitOrder(split.data(), M, K);
    x = split.data();
  }
  ParallelFor(pool, (N + kChunk - 1) / kChunk, [&](int64_t t) {
    for (int64_t n = t * kChunk, end = std::min(N, n + kChunk); n < end; n += kRows)
      NkRows(x, M, K, w + n * K, std::min(kRows, end - n), y + n, N);
  });
}

// Up to kFewRows rows stream the weights; more run the register-blocked Gemm.
constexpr int64_t kFewRows = 4;

template <typename T>
static void Run(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                const T* w, float* y, bool transposed) {
  if (M > kFewRows) return Gemm(pool, x, M, K, N, w, y, transposed);
  transposed ? Nk(pool, x, M, K, N, w, y) : KnStream(pool, x, M, K, N, w, y);
}

static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                             bool transposed) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != (transposed ? 3 : 4))
    return ffi::Error::InvalidArgument("matmul: ranks");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = yd[1];
  if (wd[2] != K) return ffi::Error::InvalidArgument("matmul: K differs");
  if (transposed ? wd[1] != N : wd[1] != (N + kNr - 1) / kNr || wd[3] != kNr)
    return ffi::Error::InvalidArgument("matmul: N differs");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("matmul: layer out of range");
  const int64_t offset = l * K * (transposed ? N : wd[1] * kNr);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::F32: {
      const float* wp = static_cast<const float*>(w.untyped_data()) + offset;
      Run(pool, xp, M, K, N, wp, yp, transposed);
      break;
    }
    case ffi::BF16:
    case ffi::U16: {
      const uint16_t* wp = static_cast<const uint16_t*>(w.untyped_data()) + offset;
      Run(pool, xp, M, K, N, wp, yp, transposed);
      break;
    }
    default:
      return ffi::Error::InvalidArgument("matmul: weights must be f32, bf16 or uint16 bf16 bits");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w (kn: packed)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<bool>("transposed"));
