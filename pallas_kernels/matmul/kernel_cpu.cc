// Matmul over stacked per-layer weights for XLA:CPU, called through the XLA FFI:
// y [M, N] f32 = x [M, K] f32 @ W[layer], W bf16 (as bf16 or its uint16 bits) or f32, read in place.
//
// Why not XLA's dot: a layer scan slices (copies) each layer's weights before its dot, and XLA:CPU
// runs bf16 weights slower than f32 ones on AVX2 (3x at M = 1, ~1.4x at M = 64). Here bf16 is
// converted in registers or in cache, so it runs at f32 speed with half the bytes.
//   Up to 4 rows (decoding a few sequences is a stream over the weights at memory speed):
//     kn: W [L, K, N] (y = x @ W[l]). Tasks split K into contiguous row blocks, each summing
//         into its own [M, N] partial, so every task streams whole rows; the caller adds them.
//     nk: W [L, N, K] (y = x @ W[l].T, e.g. an embedding used as LM head). Tasks split N.
//   More rows: a register-blocked 6 x 16 kernel over f32 tiles in cache (`Gemm`).
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
// bf16 with AVX2 works on groups of 16 columns held de-interleaved, [8 even | 8 odd]: a shift
// and a mask turn 16 bf16 into those two f32 vectors with no shuffles. `Interleave` restores
// the order of every whole group at the end.
constexpr bool kSplitBf16 = true;
static inline void Split(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)));
}
// Weight rows this far ahead are requested early: the hardware prefetcher alone left the
// smaller projections at ~20 GB/s (28 with this).
constexpr int64_t kPrefetchRows = 16;
static inline void Prefetch(const uint16_t* p) {
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

// Every whole group of 16 in the M rows of y [M, N]: [even | odd] back to column order, or
// (split) column order to [even | odd].
static void Interleave(float* y, int64_t M, int64_t N, bool split = false) {
  float tmp[16];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c + 16 <= N; c += 16) {
      float* g = y + m * N + c;
      for (int j = 0; j < 16; ++j) {
        const int i = (j & 1) * 8 + j / 2;
        split ? tmp[i] = g[j] : tmp[j] = g[i];
      }
      std::memcpy(g, tmp, sizeof tmp);
    }
}

constexpr int64_t kRows = 4;     // weight rows read together
constexpr int64_t kCols = 4096;  // columns per pass (kn): whole rows of our weights, read in order

// acc[m, 0:n] += x[m, k0:k1] @ w[k0:k1, 0:n] (rows ldw apart), four weight rows at a time.
template <typename T>
static void KnBlock(const float* x, int64_t ldx, int64_t M, const T* w, int64_t ldw, int64_t k0,
                    int64_t k1, int64_t n, float* acc, int64_t lda) {
  for (int64_t k = k0; k < k1; k += kRows) {
    const int64_t rows = std::min(kRows, k1 - k);
    // Rows past the block's end repeat its last row, with a zero multiplier.
    const T *__restrict w0 = w + k * ldw,
            *__restrict w1 = w + (k + std::min<int64_t>(1, rows - 1)) * ldw,
            *__restrict w2 = w + (k + std::min<int64_t>(2, rows - 1)) * ldw,
            *__restrict w3 = w + (k + std::min<int64_t>(3, rows - 1)) * ldw;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * ldx + k;
      const float x0 = xm[0], x1 = rows > 1 ? xm[1] : 0.f, x2 = rows > 2 ? xm[2] : 0.f,
                  x3 = rows > 3 ? xm[3] : 0.f;
      float* __restrict a = acc + m * lda;
      int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        const __m256 b0 = _mm256_set1_ps(x0), b1 = _mm256_set1_ps(x1), b2 = _mm256_set1_ps(x2),
                     b3 = _mm256_set1_ps(x3);
        for (; c + 16 <= n; c += 16) {
          __m256 ae = _mm256_loadu_ps(a + c), ao = _mm256_loadu_ps(a + c + 8), e, o;
          if (m == 0) {
            for (const uint16_t* p : {w0, w1, w2, w3}) Prefetch(p + c + kPrefetchRows * ldw);
          }
          Split(w0 + c, e, o), ae = _mm256_fmadd_ps(b0, e, ae), ao = _mm256_fmadd_ps(b0, o, ao);
          Split(w1 + c, e, o), ae = _mm256_fmadd_ps(b1, e, ae), ao = _mm256_fmadd_ps(b1, o, ao);
          Split(w2 + c, e, o), ae = _mm256_fmadd_ps(b2, e, ae), ao = _mm256_fmadd_ps(b2, o, ao);
          Split(w3 + c, e, o), ae = _mm256_fmadd_ps(b3, e, ae), ao = _mm256_fmadd_ps(b3, o, ao);
          _mm256_storeu_ps(a + c, ae), _mm256_storeu_ps(a + c + 8, ao);
        }
      }
#endif
      for (; c < n; ++c)
        a[c] += x0 * ToF32(w0[c]) + x1 * ToF32(w1[c]) + x2 * ToF32(w2[c]) + x3 * ToF32(w3[c]);
    }
  }
}

template <typename T>
static void Kn(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, const T* w,
               float* y) {
  // Enough row blocks to keep both threads busy, each at least 16 rows (a multiple of kRows).
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(2 * pool.num_threads(), K / 16));
  const int64_t rows = (K / tasks + kRows - 1) / kRows * kRows;
  const int64_t used = (K + rows - 1) / rows;
  std::vector<float> partial((used - 1) * M * N, 0.f);
  std::memset(y, 0, sizeof(float) * M * N);
  ParallelFor(pool, used, [&](int64_t t) {
    float* acc = t == 0 ? y : partial.data() + (t - 1) * M * N;
    const int64_t k0 = t * rows, k1 = std::min(K, k0 + rows);
    for (int64_t c0 = 0; c0 < N; c0 += kCols)
      KnBlock(x, K, M, w + c0, N, k0, k1, std::min(kCols, N - c0), acc + c0, N);
  });
  for (int64_t t = 1; t < used; ++t) {
    const float* __restrict p = partial.data() + (t - 1) * M * N;
    for (int64_t i = 0; i < M * N; ++i) y[i] += p[i];
  }
  if (std::is_same_v<T, uint16_t> && kSplitBf16) Interleave(y, M, N);
}

// Many rows: y = x @ W[l] (kn) or, for nk, y^T = W[l] @ x^T, so that W's rows are read in place
// either way. The operand whose columns a 16-wide register block covers is copied once into an
// f32 tile of 64 columns in cache, stored as strips of 16 (W's columns for kn, x^T for nk); a
// 6 x 16 block then runs down K for every 6 rows of the other operand, read directly (x rows for
// kn, W rows for nk).
constexpr int64_t kTile = 64, kMr = 6, kNr = 16, kPackAhead = 16, kKc = 256;
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

// Rows [0, rows) of a (lda apart) against the tile's columns [0, cols): K in chunks of kKc,
// then, as in BLIS, each strip of the chunk (kKc x kNr, contiguous: 16 KB) stays in L1
// while every 6-row block of a runs against it. bf16 rows are converted once per chunk.
template <typename A>
static void Blocks(const A* a, int64_t lda, int64_t rows, int64_t K, const float* tile,
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

// tile = columns [c0, c0 + nc) of the row-major [K, ld] matrix src in f32 strips of kNr
// columns, [tw / kNr][K][kNr], zero-padded to tw columns.
template <typename T>
static void PackTile(const T* src, int64_t ld, int64_t K, int64_t c0, int64_t nc, int64_t tw,
                     float* tile) {
  for (int64_t k = 0; k < K; ++k) {
    if (k + kPackAhead < K)  // rows ld apart defeat the hardware prefetcher
      for (int64_t b = 0; b < nc * int64_t{sizeof(T)}; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(src + (k + kPackAhead) * ld + c0) + b);
    const T* row = src + k * ld + c0;
    for (int64_t s = 0; s < tw; s += kNr) {
      float* dst = tile + s * K + k * kNr;
      if (s + kNr <= nc) {
        for (int64_t j = 0; j < kNr; ++j) dst[j] = ToF32(row[s + j]);
      } else {
        for (int64_t j = 0; j < kNr; ++j) dst[j] = s + j < nc ? ToF32(row[s + j]) : 0.f;
      }
    }
  }
}

template <typename T>
static void Gemm(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                 const T* w, float* y, bool transposed) {
  if (!transposed) {  // tasks: 64-column tiles of W
    // Tiles half as wide when few 64-column ones would not share evenly between the threads
    // (9 tiles on 2 threads: one does 5; 10-15% at N = 576 and 960, 64 rows).
    const int64_t tiles = (N + kTile - 1) / kTile, threads = pool.num_threads();
    const int64_t tw = tiles % threads && tiles < 8 * threads ? kTile / 2 : kTile;
    ParallelFor(pool, (N + tw - 1) / tw, [&](int64_t t) {
      thread_local std::vector<float> tile;
      tile.resize(K * tw);
      const int64_t c0 = t * tw, nc = std::min(tw, N - c0);
      PackTile(w, N, K, c0, nc, tw, tile.data());
      Blocks(x, K, M, K, tile.data(), nc, y + c0, N, 1);
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
  if (std::is_same_v<T, uint16_t> && kSplitBf16) {  // x in the weights' [even | odd] groups
    split.assign(x, x + M * K);
    Interleave(split.data(), M, K, /*split=*/true);
    x = split.data();
  }
  ParallelFor(pool, (N + kChunk - 1) / kChunk, [&](int64_t t) {
    for (int64_t n = t * kChunk, end = std::min(N, n + kChunk); n < end; n += kRows)
      NkRows(x, M, K, w + n * K, std::min(kRows, end - n), y + n, N);
  });
}

// Up to kFewRows rows stream the weights (kn, nk); more run the register-blocked Gemm.
constexpr int64_t kFewRows = 4;

template <typename T>
static void Run(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                const T* w, float* y, bool transposed) {
  if (M > kFewRows) return Gemm(pool, x, M, K, N, w, y, transposed);
  transposed ? Nk(pool, x, M, K, N, w, y) : Kn(pool, x, M, K, N, w, y);
}

static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                             bool transposed) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3) return ffi::Error::InvalidArgument("matmul: ranks");
  const int64_t M = xd[0], K = xd[1], L = wd[0];
  const int64_t N = transposed ? wd[1] : wd[2];
  if ((transposed ? wd[2] : wd[1]) != K) return ffi::Error::InvalidArgument("matmul: K differs");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("matmul: layer out of range");
  const int64_t offset = l * K * N;
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
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<bool>("transposed"));
