// Part of kernel_cpu.cc, included after `Task`: attention over bf16 pages on AMX tiles, where
// the CPU has them and Linux grants them (`AmxAllowed`), for head sizes 64 and 128.
//
// Why: the vector path (`Task`) scores and sums one query at a time in 8-lane FMAs: a 64 x 128
// token prefill's attention ran at ~19 GMAC/s, ~16% of the step, while vLLM-CPU's AMX attention
// took ~9% of its shorter one. Here a task's queries (x their group's query heads) are the rows
// of tiles: q . k is one tile product per 16 keys and 32 head values, p . v one per 32 keys and
// 16 head values. A 2048-token prefill step of 128-token prompts took 0.55-0.65x the vector
// path's time, 16 prompts of 1024 tokens ran 1.65x faster end to end; a decode step (a few rows
// per kv head: little work per tile) measured 0.96-1.13x, by the hour (docs/performance.md).
//
// Numerics (bf16 caches only; f32 caches keep `Task`): q and the softmax's probabilities are
// rounded to bf16 for the products (as vLLM-CPU and transformers' bf16 attention do); the
// products are summed by tdpbf16ps into f32. The softmax is `Task`'s: f32, a block of pages at
// a time, online. A query's bits do not depend on the queries that share its task (issue 26): a
// tile element depends on its row and column only, the key tiles are aligned to the block, and
// a query's masked keys enter the sums as exact zeros (probability 0; rows past the task's keys
// are zeroed, not read), so a decode step and a prompt chunk give the same bits.
#ifndef JAXLLM_RAGGED_PAGED_ATTENTION_KERNEL_CPU_AMX_H_
#define JAXLLM_RAGGED_PAGED_ATTENTION_KERNEL_CPU_AMX_H_

#include "cpu_amx.h"

#ifdef JAXLLM_AMX
// Every tile 16 rows of 64 bytes. Scores: C 0 and 1, A 4 and 6 (keys), B 5 (q); p . v: C 0-3,
// A 4 (probabilities), B 5 and 6 (values). Rows past a task's are zeros.
static void AttentionTiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  CompilerFence();
  _tile_loadconfig(&cfg);
}

// r[0..15] (16 x 16 32-bit values) transposed in place: r[j] becomes column j.
static inline void Transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // lane L: r_i[4L], r_i+1[4L], +1, +1
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // lane L: columns 4L + 2, 4L + 3
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], lane L: rows i .. i + 3 of column 4L + c
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// The first key tiles' pages (kv heads h0..h1-1) of a task, into L2: a task's first keys are
// otherwise read cold, and a decode task has only a few tiles.
static void FetchFirstPages(const Step<uint16_t>& st, int64_t s, int64_t h0, int64_t h1,
                            int64_t i0, int64_t i1) {
  const int64_t BS = st.BS;
  const Span span = SpanOf(st, s, i0, i1);
  const int64_t p1 = span.p1, j0 = FirstKey(st, std::max<int64_t>(span.p0, 0));
  if (p1 < 0) return;
  const int64_t page = st.Hkv * BS * st.D, bytes = (h1 - h0) * BS * st.D * sizeof(uint16_t);
  for (int64_t pg = j0 / BS; pg <= std::min(p1 / BS, j0 / BS + 64 / BS); ++pg) {
    const int64_t off = st.tables[s * st.B + pg] * page + h0 * BS * st.D;
    PrefetchBytes<2>(st.k + off, bytes);
    PrefetchBytes<2>(st.v + off, bytes);
  }
}

// Sequence s, kv heads h0..h1-1, its queries i0..i1-1, as `Task` (same blocks, same softmax),
// the products on tiles. Scores come out transposed (keys x rows): the A tiles are 16 keys'
// rows as the pages hold them (loaded in place when a page holds whole groups of 16 keys), the
// B tile the rows' q (transposed once per task). Values are repacked per block as B tiles of
// p . v (16 pairs of keys x 16 head values: rows interleaved), once for all the task's rows,
// all kv heads of a page in turn (the page read in memory order, as `Task` reads it).
template <int64_t kD>
static void TaskAmx(const Step<uint16_t>& st, int64_t s, int64_t h0, int64_t h1, int64_t i0,
                    int64_t i1) {
  static_assert(kD % 64 == 0, "value tiles are taken 4 at a time");
  constexpr int64_t D = kD, KT = D / 32, DC = D / 16;  // q . k tiles per key, p . v per row
  const int64_t G = st.G, BS = st.BS, H = h1 - h0, nq = i1 - i0;
  const Span span = SpanOf(st, s, i0, i1);
  const int64_t first = span.first, p0 = span.p0, p1 = span.p1;
  if (p1 < 0) return;
  const int64_t R = nq * G, rows = (R + 15) / 16 * 16;  // a kv head's rows: query i, head g
  const int64_t ld = (kBlockPages * BS + 31) / 32 * 32;  // a block's keys, whole key tiles
  const int64_t qt_len = rows * KT * 16 * 2, vv_len = ld / 32 * DC * 512;  // a head's tiles
  const bool in_place = BS % 16 == 0;  // 16-key groups lie in one page
  thread_local std::vector<uint16_t> qt, pb, vv, gathered;
  thread_local std::vector<float> sc, ob, state, keys_rows;
  thread_local std::vector<int64_t> koff;
  thread_local std::vector<int32_t> page_rows;
  qt.resize(H * qt_len), pb.resize(H * rows * ld), sc.resize(H * rows * ld);
  ob.resize(H * rows * D), vv.resize(H * vv_len), keys_rows.resize(H * rows * ld);
  koff.resize(ld), page_rows.resize(ld), gathered.resize(32 * D);
  state.assign(H * R * (D + 2), 0.f);
  const int32_t* table = st.tables + s * st.B;
  const int64_t page = st.Hkv * BS * D, head = BS * D;  // values per page, per head of a page
  // Indices that interleave two rows' 32 values: [a0 b0 a1 b1 .. a15 b15], then a16 .. b31.
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int n = 0; n < 16; ++n) {
    lo_idx[2 * n] = n, lo_idx[2 * n + 1] = 32 + n;
    hi_idx[2 * n] = 16 + n, hi_idx[2 * n + 1] = 48 + n;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  // q rounded to bf16, as B tiles [head][row tile][k tile]: 16 pairs of head values x 16 rows.
  for (int64_t x = 0; x < H; ++x)
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int64_t c = 0; c < KT; ++c) {
        alignas(64) uint16_t q16[16][32] = {};
        for (int64_t r = r0; r < std::min(r0 + 16, R); ++r) {
          const float* q = st.q + ((first + i0 + r / G) * st.Hq + (h0 + x) * G + r % G) * D;
          for (int d = 0; d < 32; ++d) q16[r - r0][d] = ToBF16(q[32 * c + d]);
        }
        __m512i t[16];
        for (int r = 0; r < 16; ++r) t[r] = _mm512_load_si512(q16[r]);
        Transpose16(t);
        uint16_t* out = qt.data() + x * qt_len + (r0 / 16 * KT + c) * 512;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + 32 * p, t[p]);
      }
  for (int64_t x = 0; x < H; ++x) std::fill_n(state.data() + x * R * (D + 2) + R * D, R, -INFINITY);
  AttentionTiles();
  const int64_t first_block =
      FirstKey(st, std::max<int64_t>(p0, 0)) / BS / kBlockPages * kBlockPages;
  for (int64_t b0 = first_block, last = p1 / BS; b0 <= last; b0 += kBlockPages) {
    const int64_t nb = std::min(kBlockPages, last + 1 - b0), base = b0 * BS;
    const int64_t jlo = std::max(FirstKey(st, std::max<int64_t>(p0, 0)), base) - base;
    const int64_t jhi = std::min(p1 + 1, base + nb * BS) - base;  // the task's keys
    if (jlo >= jhi) continue;
    const int64_t t0 = jlo / 32, t1 = (jhi + 31) / 32;  // its key tiles
    // Head h0's row of each of the task's keys (-1 outside them: read as zeros), found page by
    // page (a division per key by the runtime page size cost more than the tiles), and at a
    // page's first key, its rows left: that page is fetched into L2 a tile ahead (pages are
    // random in memory, so the hardware prefetcher stops at each).
    std::fill(koff.begin(), koff.end(), -1);
    std::fill(page_rows.begin(), page_rows.end(), 0);
    for (int64_t j = jlo, pg = (base + jlo) / BS, at = (base + jlo) % BS; j < jhi; ++j) {
      koff[j] = table[pg] * page + (h0 * BS + at) * D;
      if (j == jlo || at == 0) page_rows[j] = BS - at;
      if (++at == BS) at = 0, ++pg;
    }
    auto fetch = [&](int64_t t) {
      for (int64_t j = 32 * t; j < std::min(32 * t + 32, jhi); ++j)
        if (page_rows[j] > 0) {  // rows [at, BS) of heads h0 .. h1 - 1: one span
          const int64_t bytes = ((H - 1) * BS + page_rows[j]) * D * sizeof(uint16_t);
          PrefetchBytes<2>(st.k + koff[j], bytes);
          PrefetchBytes<2>(st.v + koff[j], bytes);
        }
    };
    // Per key tile, all heads: its values repacked, its scores (the repacking and the scores
    // work while the next tiles arrive).
    fetch(t0);
    if (t0 + 1 < t1) fetch(t0 + 1);
    for (int64_t t = t0; t < t1; ++t) {
      if (t + 2 < t1) fetch(t + 2);
      for (int64_t x = 0; x < H; ++x) {
        for (int64_t pr = 0; pr < 16; ++pr) {  // values: pairs of key rows, interleaved
          const int64_t a = koff[32 * t + 2 * pr], b = koff[32 * t + 2 * pr + 1];
          for (int64_t c = 0; c < D; c += 32) {
            const __m512i u = a >= 0 ? _mm512_loadu_si512(st.v + a + x * head + c)
                                     : _mm512_setzero_si512();
            const __m512i w = b >= 0 ? _mm512_loadu_si512(st.v + b + x * head + c)
                                     : _mm512_setzero_si512();
            uint16_t* out = vv.data() + x * vv_len + (t * DC + c / 16) * 512 + 32 * pr;
            _mm512_storeu_si512(out, _mm512_permutex2var_epi16(u, lo, w));
            _mm512_storeu_si512(out + 512, _mm512_permutex2var_epi16(u, hi, w));
          }
        }
        const uint16_t* q = qt.data() + x * qt_len;
        float* scx = sc.data() + x * rows * ld;
        // Scores of the tile's 32 keys: C 0 and 1 = its two groups of 16 keys x rows, two
        // independent chains (tiles are not renamed: one C tile for both would serialise).
        const uint16_t* k[2];  // each group's rows, D apart
        for (int h = 0; h < 2; ++h) {
          const int64_t j = 32 * t + 16 * h;
          uint16_t* tmp = gathered.data() + h * 16 * D;
          if (j + 16 <= jlo || j >= jhi) {
            std::fill_n(tmp, 16 * D, uint16_t{0}), k[h] = tmp;
          } else if (in_place) {  // the page that holds the group (some key of it is the task's)
            const int64_t any = std::max(j, jlo);
            k[h] = st.k + koff[any] - (any - j) * D + x * head;
          } else {
            for (int i = 0; i < 16; ++i)
              if (koff[j + i] >= 0)
                std::memcpy(tmp + i * D, st.k + koff[j + i] + x * head, 2 * D);
              else
                std::memset(tmp + i * D, 0, 2 * D);
            k[h] = tmp;
          }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          _tile_zero(0);
          _tile_zero(1);
          for (int64_t c = 0; c < KT; ++c) {
            _tile_loadd(5, q + (r0 / 16 * KT + c) * 512, 64);
            _tile_loadd(4, k[0] + 32 * c, 2 * D);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, k[1] + 32 * c, 2 * D);
            _tile_dpbf16ps(1, 6, 5);
          }
          float* kr = keys_rows.data() + ((x * rows + r0) / 16 * (ld / 32) + t) * 512;
          _tile_stored(0, kr, 64);  // keys x rows, read back below (once the stores are done)
          _tile_stored(1, kr + 256, 64);
        }
      }
    }
    // Per head: its scores as rows x keys and its softmax (`soft`), its p . v (`pv`), added to
    // its sums (`add`), software-pipelined over the heads: a tile load right after the stores
    // of what it reads (or the reverse) waits for them to reach the cache (no forwarding).
    auto soft = [&](int64_t x) {
      float *acc = state.data() + x * R * (D + 2), *m = acc + R * D, *sum = m + R;
      float* scx = sc.data() + x * rows * ld;
      uint16_t* pbx = pb.data() + x * rows * ld;
      for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t t = t0; t < t1; ++t) {
          const float* kr = keys_rows.data() + ((x * rows + r0) / 16 * (ld / 32) + t) * 512;
          const int64_t n = std::min<int64_t>(16, R - r0);  // the tile's rows in use
          float* y = scx + r0 * ld + 32 * t;
          if (n <= 4) {  // (decode: a few query heads) their columns, gathered
            const __m512i col = _mm512_mullo_epi32(
                _mm512_set1_epi32(16),
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
            for (int64_t i = 0; i < n; ++i)
              for (int h = 0; h < 2; ++h)
                _mm512_storeu_ps(y + i * ld + 16 * h,
                                 _mm512_i32gather_ps(col, kr + 256 * h + i, 4));
            continue;
          }
          for (int h = 0; h < 2; ++h) {
            __m512i z[16];
            for (int i = 0; i < 16; ++i) z[i] = _mm512_loadu_si512(kr + 256 * h + 16 * i);
            Transpose16(z);  // rows x keys
            for (int i = 0; i < n; ++i) _mm512_storeu_si512(y + i * ld + 16 * h, z[i]);
          }
        }
      for (int64_t r = 0; r < rows; ++r) {  // each row's softmax over its own keys, as `Task`'s
        float* y = scx + r * ld;
        uint16_t* p = pbx + r * ld;
        std::fill(p + 32 * t0, p + 32 * t1, uint16_t{0});  // (rows past R too: no stale NaN)
        const int64_t pos = p0 + r / G;
        if (r >= R || pos < 0) continue;
        const int64_t j0 = std::max(FirstKey(st, pos), base) - base;
        const int64_t j1 = std::min(pos + 1, base + nb * BS) - base;
        if (j0 >= j1) continue;
        for (int64_t j = j0; j < j1; ++j) y[j] *= st.sm_scale;
        Softmax(st.soft_cap, y, j0, j1, m[r], sum[r], acc + r * D, D);
        for (int64_t j = j0; j < j1; ++j) p[j] = ToBF16(y[j]);
      }
    };
    auto pv = [&](int64_t x) {  // 64 head values (C 0-3) at a time
      const uint16_t *v = vv.data() + x * vv_len, *pbx = pb.data() + x * rows * ld;
      for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t c0 = 0; c0 < DC; c0 += 4) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t t = t0; t < t1; ++t) {
            _tile_loadd(4, pbx + r0 * ld + 32 * t, 2 * ld);
            const uint16_t* b = v + (t * DC + c0) * 512;
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 512, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, b + 1024, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, b + 1536, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
          float* o = ob.data() + (x * rows + r0) * D + 16 * c0;
          _tile_stored(0, o, 4 * D);
          _tile_stored(1, o + 16, 4 * D);
          _tile_stored(2, o + 32, 4 * D);
          _tile_stored(3, o + 48, 4 * D);
        }
    };
    auto add = [&](int64_t x) {
      float* acc = state.data() + x * R * (D + 2);
      const float* o = ob.data() + x * rows * D;
      for (int64_t i = 0; i < R * D; ++i) acc[i] += o[i];
    };
    for (int64_t x = 0; x < H + 2; ++x) {
      if (x < H) soft(x);
      if (x >= 1 && x - 1 < H) pv(x - 1);
      if (x >= 2) add(x - 2);
    }
  }
  _tile_release();
  for (int64_t x = 0; x < H * R; ++x) {
    const int64_t h = h0 + x / R, r = x % R;
    if (p0 + r / G < 0) continue;
    const float* acc = state.data() + (h - h0) * R * (D + 2);
    StoreOut(st, ((first + i0 + r / G) * st.Hq + h * G + r % G) * D, acc + r * D,
             acc[R * D + R + r], D);
  }
}
#endif

#endif  // JAXLLM_RAGGED_PAGED_ATTENTION_KERNEL_CPU_AMX_H_
