// Part of kernel_cpu_core.h, included after `Rows`, `At` and `FmaF`: the streaming paths, which
// read each packed strip from memory once for up to kStreamRows rows of x (`KnStream`). A file
// of its own so that the core stays readable.
#ifndef JAXLLM_MATMUL_KERNEL_CPU_STREAM_H_
#define JAXLLM_MATMUL_KERNEL_CPU_STREAM_H_

// y[m, 0:cols] = x[m] @ strip for m < R and the U strips s + u * len (cols columns of the
// last one stored): U strips side by side give a single row 2 U independent chains to hide
// the FMA latency; one sequential read per strip.
template <int R, int U, typename T>
static void StripRows(const float* x, int64_t K, const T* s, int64_t len, float* y,
                      int64_t ldy, int64_t cols) {
  float out[R][U][kNr];
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int kS = kStep<T>;
  __m256 acc[R][U][2];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u][0] = acc[r][u][1] = _mm256_setzero_ps();
  for (; k + kS <= K; k += kS)
    for (int u = 0; u < U; ++u) {
      __m256 lo[kS], hi[kS];
      Rows(s + u * len, k, lo, hi);
      for (int t = 0; t < kS; ++t)
        for (int r = 0; r < R; ++r) {
          const __m256 b = _mm256_set1_ps(x[r * K + k + t]);
          acc[r][u][0] = _mm256_fmadd_ps(b, lo[t], acc[r][u][0]);
          acc[r][u][1] = _mm256_fmadd_ps(b, hi[t], acc[r][u][1]);
        }
    }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u)
      _mm256_storeu_ps(out[r][u], acc[r][u][0]), _mm256_storeu_ps(out[r][u] + 8, acc[r][u][1]);
#else
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) std::fill(out[r][u], out[r][u] + kNr, 0.f);
#endif
  for (; k < K; ++k)  // the chains' last links (an odd K of bf16 strips), in the same order
    for (int u = 0; u < U; ++u)
      for (int64_t j = 0; j < kNr; ++j) {
        const float w = At(s + u * len, k, j);
        for (int r = 0; r < R; ++r) out[r][u][j] = FmaF(x[r * K + k], w, out[r][u][j]);
      }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u)
      std::memcpy(y + r * ldy + u * kNr, out[r][u], sizeof(float) * (u < U - 1 ? kNr : cols));
}

// Rows of a streamed register block: on AVX2 the 16 ymm registers hold 2 R chains, a strip's
// row and the broadcast of x (f32: R = 6), and for bf16 pairs the mask that splits them (5).
constexpr int kSr = 6;
template <typename T>
constexpr int64_t kStreamBlock = std::is_same_v<T, uint16_t> ? 5 : kSr;
// k per chunk of the streamed row blocks (even: whole bf16 pairs): a chunk of a strip (16 KB
// f32, 8 KB bf16) stays in L1 while each row block of x runs against it. The chunk after it is
// fetched a line per step ahead of the reads: with a block's compute between its loads, the
// hardware prefetcher alone does not keep enough of the strip in flight.
constexpr int64_t kSc = 256;

// The chains of rows r < R (x packed: x[k * R + r], one pointer for every broadcast) against
// strip s, run on over k in [k0, k1) from acc (add: the chunks before) or from zero, back into
// acc: StripRows's order (each k a fused multiply-add, in order), stopped and resumed at chunk
// edges through memory (exactly).
template <int R, typename T>
static void StripChunk(const float* x, const T* s, int64_t k0, int64_t k1, float (*acc)[kNr],
                       bool add) {
  int64_t k = k0;
  if (!add)
    for (int r = 0; r < R; ++r) std::fill(acc[r], acc[r] + kNr, 0.f);
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int kS = kStep<T>;
  __m256 a[R][2];
  for (int r = 0; r < R; ++r)
    a[r][0] = _mm256_loadu_ps(acc[r]), a[r][1] = _mm256_loadu_ps(acc[r] + 8);
  if constexpr (kS == 1) {
    for (; k < k1; ++k) {
      __builtin_prefetch(s + (k + kSc) * kNr, 0, 2);  // the strip's next chunk
      __m256 lo[1], hi[1];
      Rows(s, k, lo, hi);
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_set1_ps(x[k * R + r]);
        a[r][0] = _mm256_fmadd_ps(b, lo[0], a[r][0]);
        a[r][1] = _mm256_fmadd_ps(b, hi[0], a[r][1]);
      }
    }
  } else {
    // A pair row at a time: its two f32 rows are split from the loads in turn (the second
    // from the loads again, from L1), so that 2 R chains, one split row, the broadcast and the
    // mask fit the 16 registers (R = 5: kStreamBlock).
    const __m256i mask = _mm256_set1_epi32(0xFFFF0000);
    for (; k + 2 <= k1; k += 2) {
      __builtin_prefetch(s + (k + kSc) * kNr, 0, 2);  // the strip's next chunk
      const __m256i* p = reinterpret_cast<const __m256i*>(s + k * kNr);
      __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(p), 16));
      __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(p + 1), 16));
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_set1_ps(x[k * R + r]);
        a[r][0] = _mm256_fmadd_ps(b, lo, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(b, hi, a[r][1]);
      }
      asm("" : "+r"(p));  // loads again, not kept from above
      lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(p), mask));
      hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(p + 1), mask));
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_set1_ps(x[(k + 1) * R + r]);
        a[r][0] = _mm256_fmadd_ps(b, lo, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(b, hi, a[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(acc[r], a[r][0]), _mm256_storeu_ps(acc[r] + 8, a[r][1]);
#endif
  for (; k < k1; ++k)  // the chains' last links (an odd K of bf16 strips), in the same order
    for (int64_t j = 0; j < kNr; ++j) {
      const float w = At(s, k, j);
      for (int r = 0; r < R; ++r) acc[r][j] = FmaF(x[k * R + r], w, acc[r][j]);
    }
}

// The row blocks of M <= kStreamRows rows: at most kSr rows each, of even size (so that each
// keeps enough chains to hide the FMA latency); block b is rows [Start(b), Start(b + 1)).
// With AVX2 the stream beats the `Gemm` up to its 48-row chunk (the `Gemm` pays for its tiles
// and, on bf16 strips, their conversion); with AVX-512 the `Gemm` runs 512-bit blocks, and the
// stream (256-bit) keeps to 16 rows, the verify steps' range, where that was not measured.
#ifdef __AVX512F__
constexpr int64_t kStreamRows = 16;
#else
constexpr int64_t kStreamRows = 48;
#endif
template <typename T>
struct RowBlocks {
  int64_t M, n;
  explicit RowBlocks(int64_t M) : M(M), n((M + kStreamBlock<T> - 1) / kStreamBlock<T>) {}
  int64_t Start(int64_t b) const { return b * M / n; }
};

// x [M, K] -> per row block, its rows packed [K, rows] (at Start(b) * K).
template <typename T>
static void PackBlocks(const float* x, int64_t M, int64_t K, float* xp) {
  const RowBlocks<T> blocks(M);
  for (int64_t b = 0; b < blocks.n; ++b) {
    const int64_t r0 = blocks.Start(b), R = blocks.Start(b + 1) - r0;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) xp[r0 * K + k * R + r] = x[(r0 + r) * K + k];
  }
}

// y[m, 0:cols] = x[m] @ strip s for m < M <= kStreamRows (xp: `PackBlocks`): K in chunks of
// kSc, each chunk of the strip against every row block in turn. The strip is read from memory
// once.
template <typename T>
static void StripBlocks(const float* xp, int64_t M, int64_t K, const T* s, float* y, int64_t ldy,
                        int64_t cols) {
  float acc[kStreamRows][kNr];
  const RowBlocks<T> blocks(M);
  for (int64_t k0 = 0; k0 < K; k0 += kSc) {
    const int64_t k1 = std::min(K, k0 + kSc);
    for (int64_t b = 0; b < blocks.n; ++b) {
      const int64_t r0 = blocks.Start(b);
      const float* xb = xp + r0 * K;
      float(*ab)[kNr] = acc + r0;
      static_assert(kSr == 6, "the cases below");
      switch (blocks.Start(b + 1) - r0) {
        case 6: StripChunk<6>(xb, s, k0, k1, ab, k0 > 0); break;
        case 5: StripChunk<5>(xb, s, k0, k1, ab, k0 > 0); break;
        case 4: StripChunk<4>(xb, s, k0, k1, ab, k0 > 0); break;
        case 3: StripChunk<3>(xb, s, k0, k1, ab, k0 > 0); break;
        case 2: StripChunk<2>(xb, s, k0, k1, ab, k0 > 0); break;
        default: StripChunk<1>(xb, s, k0, k1, ab, k0 > 0); break;
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) std::memcpy(y + r * ldy, acc[r], sizeof(float) * cols);
}

// Few rows, packed W: tasks are runs of whole strips, several per thread so that a thread that
// starts late takes fewer. One row runs 4 strips side by side, two rows 2 (for the chains);
// more run each strip against all rows in blocks (`StripBlocks`): every path reads each strip
// once, whatever M.
template <typename T>
static void KnStream(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                     const T* w, float* y) {
  const int64_t strips = (N + kNr - 1) / kNr, len = StripRowsOf<T>(K) * kNr;
  const int64_t per = std::max<int64_t>(4, strips / (4 * pool.num_threads()) / 4 * 4);
  thread_local std::vector<float> packed;  // the calling thread's: fresh memory page-faults
  if (M > 2) packed.resize(M * K), PackBlocks<T>(x, M, K, packed.data());
  const float* xp = packed.data();
  ParallelFor(pool, (strips + per - 1) / per, [&](int64_t t) {
    const int64_t end = std::min(strips, t * per + per);
    auto cols = [&](int64_t last) { return std::min(kNr, N - last * kNr); };
    for (int64_t s = t * per; s < end;) {
      const T* p = w + s * len;
      float* ys = y + s * kNr;
      const int64_t left = end - s;
      if (M == 1 && left >= 4) {
        StripRows<1, 4>(x, K, p, len, ys, N, cols(s + 3)), s += 4;
      } else if (M == 2 && left >= 2) {
        StripRows<2, 2>(x, K, p, len, ys, N, cols(s + 1)), s += 2;
      } else {
        if (M == 1) StripRows<1, 1>(x, K, p, len, ys, N, cols(s));
        else if (M == 2) StripRows<2, 1>(x, K, p, len, ys, N, cols(s));
        else StripBlocks(xp, M, K, p, ys, N, cols(s));
        ++s;
      }
    }
  });
}

#endif  // JAXLLM_MATMUL_KERNEL_CPU_STREAM_H_
