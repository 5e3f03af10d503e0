// Part of kernel_cpu_core.h, included after kernel_cpu_dpbf16.h: the AMX GEMM, bf16 x against
// bf16 W, compiled only where the CPU has AMX-BF16 (and AVX512_BF16, the fallback).
//
// The packed bf16 strips ([K / 2 pairs, 16 columns, 2]) are AMX's B tiles as they are: 16
// pair-rows of 64 bytes. An A tile is 16 rows x 16 pairs of x, a C tile 16 x 16 f32. Each
// element is one chain of `tdpbf16ps` down K, 16 pairs at a time from k = 0, from zero; a row's
// tile dot products do not depend on the other rows of its tile nor on how many are configured,
// and a last tile with fewer pairs gives the bits of one zero-padded to 16 (probed on this
// Xeon), so a row's bits do not depend on M (issue 26). They are NOT those of the vdpbf16ps
// chain (`DpGemm`): vdpbf16ps rounds after each product (odd first), tdpbf16ps sums more at
// once (~40% of elements differ in the last bits), so AMX runs at every M, or, where the
// kernel may not use AMX (Linux refused the permission), `DpGemm` does, logged once.
#ifndef JAXLLM_MATMUL_KERNEL_CPU_AMX_H_
#define JAXLLM_MATMUL_KERNEL_CPU_AMX_H_

#include "cpu_amx.h"

#if defined(JAXLLM_DPBF16) && defined(JAXLLM_AMX)
constexpr int64_t kAmxPairs = 16;  // k-pairs per tile

// Tiles: C 0, 1 (rows [0, r0), strips 0, 1) and 2, 3 (rows [16, 16 + r1)); A 4 (r0 rows), 5
// (r1 rows); B 6, 7 (strips 0, 1). The tile state is per thread and tasks run on any thread of
// XLA's pool, so each task configures its own and releases it when done (keeping a thread's
// configuration across tasks was slower, and the other kernel library may have replaced it).
static void AmxConfigure(int r0, int r1) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};  // bytes per row
    uint8_t rows[16] = {};
  } cfg;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, kAmxPairs, kAmxPairs};
  for (int t = 0; t < 8; ++t)
    if (rows[t] > 0) cfg.rows[t] = rows[t], cfg.colsb[t] = 64;
  CompilerFence();
  _tile_loadconfig(&cfg);
}

// C tiles for rows r < r0 (+ r1: R2) against strip b0 (and b1: S2) into y0 (y1): n0 (n1) of
// their 16 columns, rows ldy apart, over T k-tiles of x rows a (lda apart) against the strips
// (P pairs). The last tile, when P is not a multiple of 16, comes from the zero-padded copies
// a_tail (rows 64 bytes apart) and t0, t1 (the strips'). A strip with fewer than 16 columns
// left is stored through the scratch c_tmp.
template <bool R2, bool S2>
static void AmxBlock(const uint16_t* a, int64_t lda, int64_t T, bool tail, const uint16_t* a_tail,
                     const uint16_t* b0, const uint16_t* b1, const uint16_t* t0,
                     const uint16_t* t1, int r0, int r1, float* y0, int64_t n0, float* y1,
                     int64_t n1, int64_t ldy, float* c_tmp) {
  _tile_zero(0);
  if constexpr (S2) _tile_zero(1);
  if constexpr (R2) _tile_zero(2);
  if constexpr (R2 && S2) _tile_zero(3);
  auto step = [&](const uint16_t* ak, int64_t a_stride, const uint16_t* bk0, const uint16_t* bk1) {
    _tile_loadd(4, ak, a_stride);
    _tile_loadd(6, bk0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (R2) _tile_loadd(5, ak + 16 * a_stride / 2, a_stride);
    if constexpr (R2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (S2) _tile_loadd(7, bk1, 64);
    if constexpr (S2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (R2 && S2) _tile_dpbf16ps(3, 5, 7);
  };
  const int64_t full = T - tail, b_len = kAmxPairs * 2 * kNr;  // values per B tile
  for (int64_t t = 0; t < full; ++t)
    step(a + t * 2 * kAmxPairs, 2 * lda, b0 + t * b_len, b1 + t * b_len);
  if (tail) step(a_tail, 64, t0, t1);
  // A C tile's rows [r, r + rows) into ys (stored(pointer, stride in bytes)), n columns.
  auto store = [&](auto stored, float* ys, int64_t n, int64_t r, int rows) {
    ys += r * ldy;
    if (n == kNr) return stored(ys, 4 * ldy);
    stored(c_tmp, 4 * kNr);
    for (int i = 0; i < rows; ++i) std::memcpy(ys + i * ldy, c_tmp + i * kNr, 4 * n);
  };
  store([](float* p, int64_t ld) { _tile_stored(0, p, ld); }, y0, n0, 0, r0);
  if constexpr (S2) store([](float* p, int64_t ld) { _tile_stored(1, p, ld); }, y1, n1, 0, r0);
  if constexpr (R2) store([](float* p, int64_t ld) { _tile_stored(2, p, ld); }, y0, n0, 16, r1);
  if constexpr (R2 && S2)
    store([](float* p, int64_t ld) { _tile_stored(3, p, ld); }, y1, n1, 16, r1);
}

// x bf16 [M, lda] (K values, zero-padded to even lda) against bf16 packed strips, as `DpGemm`.
// Gated (out.gated): W's N columns are N / 2 gate columns, then their up columns (N / 2 a
// multiple of 16), each gate strip paired with its up strip in one block.
static void AmxGemm(ffi::ThreadPool& pool, const uint16_t* x, int64_t lda, int64_t M, int64_t N,
                    const uint16_t* w, const Out& out) {
  const int64_t P = lda / 2, T = (P + kAmxPairs - 1) / kAmxPairs, left = P % kAmxPairs;
  const int64_t b_len = kAmxPairs * 2 * kNr, strip_len = 2 * P * kNr;
  const int64_t up = out.gated ? N / 2 / kNr * strip_len : 0;  // gate strip -> its up strip
  const int64_t n = out.gated ? N / 2 : N;                      // the tiles' columns
  ForTiles(pool, M, n, w, 2 * P * sizeof(uint16_t), [&](int64_t c0, int64_t cols) {
    const int64_t strips = (cols + kNr - 1) / kNr;
    const uint16_t* tile = w + c0 * 2 * P;  // strip c0 / kNr
    // The strips' last pairs as whole B tiles (the strip after, or nothing, follows them): the
    // tile's strips, then (gated) their up strips.
    thread_local uint16_t b_tail[2 * kTile / kNr][kAmxPairs * 2 * kNr];
    if (left)
      for (int64_t s = 0; s < (out.gated ? 2 : 1) * strips; ++s) {
        const uint16_t* src = tile + (s < strips ? s * strip_len : up + (s - strips) * strip_len);
        std::memset(b_tail[s], 0, sizeof b_tail[s]);
        std::memcpy(b_tail[s], src + (T - 1) * b_len, left * 4 * kNr);
      }
    // No prefetch of the thread's next tile: a few lines per k-tile made 1-5 rows 5-10% slower.
    // All rows in one call, 32 at a time (48-row calls left a third of the rows in 16-row
    // blocks, which load as much per product as 32-row ones do), each block's results finished
    // while they are in L1; the tiles configured once per call (and again for a part block).
    return [=](int64_t m0, int64_t m, Prefetch) {
      thread_local uint16_t a_tail[2 * 16][2 * kAmxPairs];  // the rows' last pairs
      thread_local float c_tmp[16 * kNr];
      auto n_of = [&](int64_t s) { return std::clamp<int64_t>(cols - s * kNr, 0, kNr); };
      int configured = -1;  // r0 + 32 r1 of the configuration
      for (int64_t r = 0; r < m; r += 32) {
        const int r0 = std::min<int64_t>(16, m - r), r1 = std::min<int64_t>(16, m - r - r0);
        const uint16_t* a = x + (m0 + r) * lda;
        if (left)
          for (int i = 0; i < r0 + r1; ++i) {
            std::memset(a_tail[i], 0, sizeof a_tail[i]);
            std::memcpy(a_tail[i], a + i * lda + (T - 1) * 2 * kAmxPairs, left * 4);
          }
        if (configured != r0 + 32 * r1) AmxConfigure(r0, r1), configured = r0 + 32 * r1;
        const auto [yr, ldy] = out.Rows(m0 + r, c0);
        // Blocks of two strips: s and s + 1, or, gated, gate strip s and its up strip.
        for (int64_t s = 0; s < strips; s += out.gated ? 1 : 2) {
          const uint16_t* b0 = tile + s * strip_len;
          const bool two = out.gated || s + 1 < strips;
          const uint16_t* b1 = out.gated ? b0 + up : two ? b0 + strip_len : b0;
          const int64_t s1 = out.gated ? strips + s : s + 1;  // b1's tail
          float* y1 = out.gated ? yr + kTile + s * kNr : yr + (s + 1) * kNr;
          const int64_t n1 = out.gated ? n_of(s) : n_of(s + 1);
          auto block = [&](auto R2, auto S2) {
            AmxBlock<R2, S2>(a, lda, T, left, a_tail[0], b0, b1, b_tail[s], b_tail[s1], r0, r1,
                             yr + s * kNr, n_of(s), y1, n1, ldy, c_tmp);
          };
          using Yes = std::true_type;
          using No = std::false_type;
          if (r1) two ? block(Yes{}, Yes{}) : block(Yes{}, No{});
          else two ? block(No{}, Yes{}) : block(No{}, No{});
        }
        out.Finish({yr, ldy}, m0 + r, r0 + r1, c0, cols);
      }
      _tile_release();
    };
  }, M);
}
#endif

// bf16 x against bf16 W: AMX where the CPU has it and the process may use it, else vdpbf16ps.
#ifdef JAXLLM_DPBF16
// bf16 x [rows, K] as BfGemm takes it, rows of whole pairs (K + K % 2 apart): x itself for an
// even K, else a zero-padded copy held in `keep`.
static const uint16_t* WholePairs(const uint16_t* x, int64_t rows, int64_t K,
                                  std::vector<uint16_t>& keep) {
  if (K % 2 == 0) return x;
  keep.assign(rows * (K + 1), 0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&keep[r * (K + 1)], x + r * K, 2 * K);
  return keep.data();
}

static void BfGemm(ffi::ThreadPool& pool, const uint16_t* x, int64_t lda, int64_t M, int64_t K,
                   int64_t N, const uint16_t* w, const Out& out) {
#ifdef JAXLLM_AMX
  if (AmxAllowed() && (!out.gated || N / 2 % kNr == 0)) return AmxGemm(pool, x, lda, M, N, w, out);
#endif
  if (out.gated)
    return Ungated(pool, M, N, out, [&](const Out& o) { BfGemm(pool, x, lda, M, K, N, w, o); });
  DpGemm(pool, x, lda, M, K, N, w, out);
}
#endif

#endif  // JAXLLM_MATMUL_KERNEL_CPU_AMX_H_
