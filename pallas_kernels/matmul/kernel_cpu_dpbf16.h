// Part of kernel_cpu_core.h, included after `Out`, `ForTiles`, `ForRowBlocks` and `Prefetch`: the
// native bf16 dot-product GEMM, compiled only where the CPU has AVX512_BF16. A file of its own
// so that kernel_cpu.cc stays readable at one screenful per path.
#ifndef JAXLLM_MATMUL_KERNEL_CPU_DPBF16_H_
#define JAXLLM_MATMUL_KERNEL_CPU_DPBF16_H_

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define JAXLLM_DPBF16 1
// bf16 x against bf16 W, many rows: vdpbf16ps adds the products of a pair of bf16 (k, k + 1) to
// each f32 lane. The products are exact and the sums f32, as in the f32 path. The strips' pairs
// are its operand as they are; x is read as pairs in place. It runs every M (few rows too), so
// that each element is the same chain of vdpbf16ps down K whatever the batch (issue 26), where
// AMX does not run (kernel_cpu_amx.h).
constexpr int64_t kDpPc = 1024;  // k-pairs per chunk (rows per block: kMr)

// y[r, 0:cols] (=, or with add +=) sum over pairs p < P of x pairs a[r * lda + 2p ..] times the
// S paired strips b (ldb apart), for r < R.
template <int R, int S>
static void DpMicro(const uint16_t* a, int64_t lda, int64_t P, const uint32_t* b, int64_t ldb,
                    float* y, int64_t ldy, int64_t cols, bool add, const Prefetch& pf) {
  __m512 acc[R][S];  // the chains, run on from y (add: the chunks before), as in Micro
  for (int s = 0; s < S; ++s) {
    const __mmask16 mask = (1u << std::min(kNr, cols - s * kNr)) - 1;
    for (int r = 0; r < R; ++r)
      acc[r][s] = add ? _mm512_maskz_loadu_ps(mask, y + r * ldy + s * kNr) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < P; ++p) {
    pf.At(p);
    __m512bh w[S];
    for (int s = 0; s < S; ++s) w[s] = (__m512bh)_mm512_loadu_si512(b + s * ldb + p * kNr);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xv, w[s]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const __mmask16 mask = (1u << std::min(kNr, cols - s * kNr)) - 1;
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + s * kNr, mask, acc[r][s]);
  }
}

template <int S>
static void DpRows(const uint16_t* a, int64_t lda, int64_t rows, int64_t P, const uint32_t* b,
                   int64_t ldb, float* y, int64_t ldy, int64_t cols, bool add, Prefetch& pf) {
  ForRowBlocks(rows, [&](int64_t r, auto R) {
    DpMicro<R, S>(a + r * lda, lda, P, b, ldb, y + r * ldy, ldy, cols, add, pf.Take());
  });
}

// x bf16 [M, lda] (K values, zero-padded to even lda) against bf16 packed strips, as `Gemm`.
static void DpGemm(ffi::ThreadPool& pool, const uint16_t* x, int64_t lda, int64_t M, int64_t K,
                   int64_t N, const uint16_t* w, const Out& out) {
  const int64_t P = lda / 2;
  ForTiles(pool, M, N, w, 2 * P * sizeof(uint16_t), [&](int64_t c0, int64_t cols) {
    const int64_t strips = (cols + kNr - 1) / kNr;
    const uint32_t* tile = reinterpret_cast<const uint32_t*>(w + c0 * 2 * P);  // strip c0 / kNr
    // K in chunks of kDpPc pairs (1024: at most 128 KB of 4 strips, in L2; blocking for L1 was
    // 10-20% slower), each chunk of up to 4 strips against every 6-row block of x in turn.
    return [=](int64_t m0, int64_t m, Prefetch pf) {
      const auto [yt, ldy] = out.Rows(m0, c0);
      pf.Spread(m, std::min(P, kDpPc));
      for (int64_t p0 = 0; p0 < P; p0 += kDpPc) {
        const int64_t pc = std::min(kDpPc, P - p0);
        for (int64_t s = 0, g; s < strips; s += g) {
          g = strips - s >= 4 ? 4 : strips - s >= 2 ? 2 : 1;
          const uint32_t* b = tile + (s * P + p0) * kNr;
          const int64_t c = std::min(g * kNr, cols - s * kNr);
          const uint16_t* a = x + m0 * lda + 2 * p0;
          float* ys = yt + s * kNr;
          if (g == 4) DpRows<4>(a, lda, m, pc, b, P * kNr, ys, ldy, c, p0 > 0, pf);
          else if (g == 2) DpRows<2>(a, lda, m, pc, b, P * kNr, ys, ldy, c, p0 > 0, pf);
          else DpRows<1>(a, lda, m, pc, b, P * kNr, ys, ldy, c, p0 > 0, pf);
        }
      }
      out.Finish({yt, ldy}, m0, m, c0, cols);
    };
  });
}
#endif

#endif  // JAXLLM_MATMUL_KERNEL_CPU_DPBF16_H_
