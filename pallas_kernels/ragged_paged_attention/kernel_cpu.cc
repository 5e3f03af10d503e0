// Ragged paged attention for XLA:CPU, called through the XLA FFI.
//
// XLA:CPU runs the pure-JAX reference's page gather, transposes and small batched dots at
// 2-4 GB/s; this loop reads each sequence's pages in place (10-20 GB/s here). Same layout and
// semantics as reference.py's write_kv followed by ragged_paged_attention:
//   q [T, Hq, D] f32, k/v [T, Hkv, D] f32 (this step's), k/v cache [L, NB, Hkv, BS, D] f32,
//   bf16 (written rounded to nearest even, read converted in registers: half the bytes) or
//   float8 e4m3fn / e5m2 (kernel_cpu_fp8.h: written divided by the layer's scale, saturated
//   and rounded as the reference's quantize_kv; read converted and scaled back),
//   layer [], slot_mapping [T] (block * BS + offset; < 0: padding), kv_lens [S],
//   block_tables [S, B], cu_q_lens [S + 1], num_seqs [1], window [] (<= 0: none), chunk []
//   (Llama 4's chunked local attention, <= 0: none: a query sees only keys of its own chunk);
//   sinks [Hq] or [0] (none: attention sinks, one logit per query head in the softmax's
//   denominator: a query's running maximum starts at its head's sink and its sum at 1);
//   attend_to [T] or [0] (none: causal; the last key position each query sees, >= its own:
//   Gemma 3's bidirectional image tokens); kv_scales [2] or [0] (none: 1, 1): k_scale and
//   v_scale, run-time values (they ride the layer scan). The scales are applied outside the
//   inner loops: k_scale joins sm_scale (q . (k * ks) = (q . k) * ks) and v_scale multiplies
//   the output (sum p (v * vs) = vs sum p v);
//   attrs sm_scale, soft_cap (0: none); results out [T, Hq, D] (f32, or bf16 rounded to nearest
//   even: XLA's convert of a bf16 model's f32 out took 33 us a decode layer) and the two caches,
//   which alias the cache arguments: k/v are written in place. (As XLA ops, the scatter's index
//   arithmetic and bounds checks were nine small ops per layer, ~0.5 ms of a 30-layer decode
//   token.)
// bf16 pages run on AMX tiles where the CPU has them (kernel_cpu_amx.h: q and the probabilities
// rounded to bf16 for the products), else, and for f32 pages, on vectors (`Task`).
// Rows of no sequence come out as zeros. Work is split over (sequence, up to kQueriesPerTask
// queries, all kv heads or a range of them) tasks run on XLA's own intra-op thread pool (a
// separate OpenMP pool would spin against XLA's threads).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"
#include "ragged_paged_attention/kernel_cpu_write.h"

namespace ffi = xla::ffi;

// What every task reads: one layer's pages (C: float, bf16 bits or float8) and the step's
// inputs.
template <typename C>
struct Step {
  const float* q;  // [T, Hq, D]
  const C *k, *v;  // the layer's pages [NB, Hkv, BS, D]
  const int32_t *lens, *tables, *cu;
  float* out;        // [T, Hq, D], or
  uint16_t* out16;   // bf16 (one of the two is null)
  int64_t Hq, Hkv, G, BS, B, D;
  int32_t window, chunk;
  float sm_scale, soft_cap;  // sm_scale times k_scale
  const float* sinks;  // [Hq], or null: none
  const int32_t* attend;  // [T], or null: causal
  float v_scale;
};

// A task's queries i0..i1-1 of sequence s: the row in q of the sequence's first query, and the
// first and last query positions (the sequence's length, capped by its block table, ends with
// its q_len new queries).
struct Span {
  int64_t first, p0, p1, len;
};
template <typename C>
static Span SpanOf(const Step<C>& st, int64_t s, int64_t i0, int64_t i1) {
  const int64_t len = std::min<int64_t>(st.lens[s], st.B * st.BS);
  const int64_t first = st.cu[s], q_len = st.cu[s + 1] - first;
  return {first, len - q_len + i0, len - q_len + i1 - 1, len};
}

// The first key a query at pos sees: 0, or its sliding window's first, or its attention
// chunk's first, whichever is later (non-decreasing in pos: a task's first query bounds all).
template <typename C>
static inline int64_t FirstKey(const Step<C>& st, int64_t pos) {
  const int64_t w = st.window > 0 ? std::max<int64_t>(0, pos - st.window + 1) : 0;
  return st.chunk > 0 ? std::max<int64_t>(w, pos / st.chunk * st.chunk) : w;
}

// Row o of out (f32, or bf16 rounded to nearest even): a query head's sums acc [D] / sum.
template <typename C>
static void StoreOut(const Step<C>& st, int64_t o, const float* acc, float sum, int64_t D) {
  if (st.out16 != nullptr)
    for (int64_t d = 0; d < D; ++d) st.out16[o + d] = ToBF16(acc[d] / sum * st.v_scale);
  else
    for (int64_t d = 0; d < D; ++d) st.out[o + d] = acc[d] / sum * st.v_scale;
}

// The last key position the query in row t at position pos sees: its own, or with attend_to
// a later one of this step's (capped by the sequence's length, the keys there are).
template <typename C>
static inline int64_t LastKey(const Step<C>& st, int64_t t, int64_t pos, int64_t len) {
  return st.attend == nullptr ? pos : std::min<int64_t>(std::max<int64_t>(pos, st.attend[t]),
                                                        len - 1);
}

// q . k over D values (kD: D known at compile time, so the loop unrolls; 0: runtime D).
template <int64_t kD, typename C>
static inline float Dot(const float* q, const C* k, int64_t D) {
  if constexpr (kD > 0) D = kD;
  v8 s0 = {}, s1 = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {  // two chains: an FMA's latency is longer than its issue
    s0 += Load8(q + d) * Load8(k + d);
    s1 += Load8(q + d + 8) * Load8(k + d + 8);
  }
  for (; d + 8 <= D; d += 8) s0 += Load8(q + d) * Load8(k + d);
  s0 += s1;
  float r = 0.f;
  for (int i = 0; i < 8; ++i) r += s0[i];
  for (; d < D; ++d) r += q[d] * ToF32(k[d]);
  return r;
}

// Pairwise sums of two vectors: [a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, ..., b6+b7].
static inline v8 PairSums(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

// Scaled scores of kH query heads (q: kH rows of D) against 4 keys (k: 4 rows of D) into
// sc[h * ldsc + r]: each key chunk is loaded (and converted) once for all kH heads, 4 kH
// independent FMA chains, then one transposing reduction per head.
template <int64_t kD, int kH, typename C>
static inline void Scores4(const float* q, const C* k, int64_t D, float sm_scale, float* sc,
                           int64_t ldsc) {
  if constexpr (kD > 0) D = kD;
  v8 acc[kH][4] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    v8 x[4];
    for (int r = 0; r < 4; ++r) x[r] = Load8(k + r * D + d);
    for (int h = 0; h < kH; ++h) {
      const v8 qh = Load8(q + h * D + d);
      for (int r = 0; r < 4; ++r) acc[h][r] += qh * x[r];
    }
  }
  for (int h = 0; h < kH; ++h) {
    // [a0123 a4567 b0123 b4567 c0123 c4567 d0123 d4567], then [a b c d a b c d]
    const v8 s = PairSums(PairSums(acc[h][0], acc[h][1]), PairSums(acc[h][2], acc[h][3]));
    const v8 t = PairSums(s, s);
    for (int r = 0; r < 4; ++r) {
      float x = t[r];
      for (int64_t e = d; e < D; ++e) x += q[h * D + e] * ToF32(k[r * D + e]);
      sc[h * ldsc + r] = x * sm_scale;
    }
  }
}

static inline float Max8(v8 x) {
  float r = x[0];
  for (int i = 1; i < 8; ++i) r = std::max(r, x[i]);
  return r;
}
static inline float Sum8(v8 x) {
  float r = 0.f;
  for (int i = 0; i < 8; ++i) r += x[i];
  return r;
}

// One head's online-softmax step over its scores sc[j0..j1) (a block of keys): soft cap, the new
// running maximum m (rescaling what sum and acc [D] hold), the exponentials into sc and their
// sum into sum. Eight lanes at a time: a scalar max or sum is a chain of dependent adds.
static inline void Softmax(float soft_cap, float* sc, int64_t j0, int64_t j1, float& m,
                           float& sum, float* acc, int64_t D) {
  if (soft_cap > 0.f)
    for (int64_t j = j0; j < j1; ++j) sc[j] = soft_cap * std::tanh(sc[j] / soft_cap);
  v8 mv = Splat8(m);
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    const v8 x = Load8(sc + j);
    mv = mv > x ? mv : x;
  }
  float mx = Max8(mv);
  for (; j < j1; ++j) mx = std::max(mx, sc[j]);
  if (mx > m) {  // rescale what was summed under the old maximum
    const float c = std::exp(m - mx);
    sum *= c;
    for (int64_t d = 0; d < D; ++d) acc[d] *= c;
    m = mx;
  }
  v8 sv = {};
  for (j = j0; j + 8 <= j1; j += 8) {
    const v8 e = Exp8(Load8(sc + j) - mx);
    std::memcpy(sc + j, &e, sizeof e);
    sv += e;
  }
  float s = Sum8(sv);
  for (; j < j1; ++j) s += (sc[j] = std::exp(sc[j] - mx));
  sum += s;
}

// acc[h][0:D] += sum_r p[h * ldp + r] * v[r] over rows r0..r1-1 of one page's values v [BS, D],
// for kH heads: each value chunk is loaded (and converted) once for all heads; 32 columns at a
// time, so the 4 kH sums stay in registers.
template <int64_t kD, int kH, typename C>
static inline void AddRows(const float* p, int64_t ldp, const C* v, int64_t r0, int64_t r1,
                           int64_t D, float* __restrict acc) {
  if constexpr (kD > 0 && kD % 32 == 0) {
    for (int64_t c = 0; c < kD; c += 32) {
      v8 r[kH][4];
      for (int h = 0; h < kH; ++h)
        for (int i = 0; i < 4; ++i) r[h][i] = Load8(acc + h * kD + c + 8 * i);
      for (int64_t j = r0; j < r1; ++j) {
        v8 x[4];
        for (int i = 0; i < 4; ++i) x[i] = Load8(v + j * kD + c + 8 * i);
        for (int h = 0; h < kH; ++h) {
          const v8 pj = Splat8(p[h * ldp + j]);
          for (int i = 0; i < 4; ++i) r[h][i] += pj * x[i];
        }
      }
      for (int h = 0; h < kH; ++h) std::memcpy(acc + h * kD + c, r[h], sizeof r[h]);
    }
  } else {
    for (int h = 0; h < kH; ++h)
      for (int64_t j = r0; j < r1; ++j)
        for (int64_t d = 0; d < D; ++d) acc[h * D + d] += p[h * ldp + j] * ToF32(v[j * D + d]);
  }
}

// Scores of kH query heads (q: kH rows of D) against rows r0..r1-1 of one page's keys k [BS, D]
// into sc[h * ldsc + r].
template <int64_t kD, int kH, typename C>
static inline void Scores(const float* q, const C* k, int64_t r0, int64_t r1, int64_t D,
                          float sm_scale, float* sc, int64_t ldsc) {
  if constexpr (kD > 0) D = kD;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) Scores4<kD, kH>(q, k + r * D, D, sm_scale, sc + r, ldsc);
  for (; r < r1; ++r)
    for (int h = 0; h < kH; ++h) sc[h * ldsc + r] = Dot<kD>(q + h * D, k + r * D, D) * sm_scale;
}

// Prefetches bytes from p into the caches (hint: 3 = L1, 2 = L2).
template <int kHint>
static inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, kHint);
}

// Keys scored per softmax: a block of pages.
constexpr int64_t kBlockPages = 32;

// Sequence s, kv heads h0..h1-1, its queries i0..i1-1 (of q_len): their query heads, in groups
// of up to 3 per kv head (the most whose sums fit the registers), against the keys up to each
// query's position, a block of pages at a time with an online softmax (one per block). Each pass
// over a block reads its pages in memory order (page, then kv head), so the hardware prefetcher
// follows whole pages, not one head's rows of each.
template <int64_t kD, typename C>
static void Task(const Step<C>& st, int64_t s, int64_t h0, int64_t h1, int64_t i0, int64_t i1) {
  const int64_t G = st.G, BS = st.BS, D = kD > 0 ? kD : st.D, nq = i1 - i0;
  const int64_t H = (h1 - h0) * G, ld = kBlockPages * BS;  // query heads of the task
  const Span span = SpanOf(st, s, i0, i1);
  const int64_t first = span.first, p0 = span.p0, p1 = span.p1;
  if (p1 < 0) return;
  int64_t p_last = p1;  // the last key any query of the task sees
  if (st.attend != nullptr)
    for (int64_t i = std::max<int64_t>(-p0, 0); i < nq; ++i)
      p_last = std::max(p_last, LastKey(st, first + i0 + i, p0 + i, span.len));
  const int64_t groups = (G + 2) / 3;
  thread_local std::vector<float> buf;
  buf.assign(nq * H * (D + 2) + H * ld, 0.f);
  float *acc = buf.data(), *m = acc + nq * H * D, *sum = m + nq * H, *sc = sum + nq * H;
  std::fill(m, m + nq * H, -INFINITY);
  if (st.sinks != nullptr)  // the sink's term exp(sink - m) = 1 under the running max m = sink
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t x = 0; x < H; ++x) m[i * H + x] = st.sinks[h0 * G + x], sum[i * H + x] = 1.f;
  const int32_t* table = st.tables + s * st.B;
  const int64_t page = st.Hkv * BS * D, bytes = page * sizeof(C);  // a page (all kv heads)
  // For each kv head and group in order: call f(kv head, first query head g, group size n).
  auto each_group = [&](auto&& f) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t grp = 0, g = 0, n; grp < groups; ++grp, g += n) {  // sizes as even as can be
        n = G / groups + (grp < G % groups);
        f(h, g, n);
      }
  };
  // Blocks start at multiples of kBlockPages pages, not at the task's first key: a query's
  // softmax then runs over the same blocks (the same rescalings) whichever queries share its
  // task, so chunked prefill and decode give it the same bits (batch invariance: issue 26).
  const int64_t first_block =
      FirstKey(st, std::max<int64_t>(p0, 0)) / BS / kBlockPages * kBlockPages;
  for (int64_t b0 = first_block, last = p_last / BS; b0 <= last; b0 += kBlockPages) {
    const int64_t nb = std::min(kBlockPages, last + 1 - b0), base = b0 * BS;
    // The block's pages are fetched ahead for its first query; the task's others find them in
    // cache. Pages are random in memory, so the hardware prefetcher stops at each one: a
    // 64-sequence decode over 256 tokens took 1.41-1.75 ms a layer without, 1.14-1.42 with.
    bool fetch = true;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t pos = p0 + i;
      if (pos < 0) continue;
      const int64_t j0 = std::max(FirstKey(st, pos), base) - base;
      const int64_t j1 =
          std::min(LastKey(st, first + i0 + i, pos, span.len) + 1, base + nb * BS) - base;
      if (j0 >= j1) continue;
      const float* q = st.q + ((first + i0 + i) * st.Hq + h0 * G) * D;
      float *mi = m + i * H, *si = sum + i * H, *ai = acc + i * H * D;
      // One pass over the block's keys, one softmax per head, one pass over its values.
      for (int64_t pg = j0 / BS; pg * BS < j1; ++pg) {
        const int64_t r0 = std::max(j0 - pg * BS, int64_t{0}), r1 = std::min(j1 - pg * BS, BS);
        const C* k = st.k + table[b0 + pg] * page;
        if (fetch) {  // the next page's keys into L1, this page's values into L2
          if ((pg + 1) * BS < j1) PrefetchBytes<3>(st.k + table[b0 + pg + 1] * page, bytes);
          PrefetchBytes<2>(st.v + table[b0 + pg] * page, bytes);
        }
        each_group([&](int64_t h, int64_t g, int64_t n) {
          const int64_t x = (h - h0) * G + g;  // the group's first query head in the task
          const float* qg = q + x * D;
          const C* kh = k + h * BS * D;
          float* scg = sc + x * ld + pg * BS;
          switch (n) {
            case 3: Scores<kD, 3>(qg, kh, r0, r1, D, st.sm_scale, scg, ld); break;
            case 2: Scores<kD, 2>(qg, kh, r0, r1, D, st.sm_scale, scg, ld); break;
            default: Scores<kD, 1>(qg, kh, r0, r1, D, st.sm_scale, scg, ld); break;
          }
        });
      }
      for (int64_t x = 0; x < H; ++x)
        Softmax(st.soft_cap, sc + x * ld, j0, j1, mi[x], si[x], ai + x * D, D);
      for (int64_t pg = j0 / BS; pg * BS < j1; ++pg) {
        const int64_t r0 = std::max(j0 - pg * BS, int64_t{0}), r1 = std::min(j1 - pg * BS, BS);
        const C* v = st.v + table[b0 + pg] * page;
        if (fetch && (pg + 1) * BS < j1) PrefetchBytes<3>(st.v + table[b0 + pg + 1] * page, bytes);
        each_group([&](int64_t h, int64_t g, int64_t n) {
          const int64_t x = (h - h0) * G + g;
          const float* p = sc + x * ld + pg * BS;
          const C* vh = v + h * BS * D;
          switch (n) {
            case 3: AddRows<kD, 3>(p, ld, vh, r0, r1, D, ai + x * D); break;
            case 2: AddRows<kD, 2>(p, ld, vh, r0, r1, D, ai + x * D); break;
            default: AddRows<kD, 1>(p, ld, vh, r0, r1, D, ai + x * D); break;
          }
        });
      }
      fetch = false;
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (p0 + i < 0) continue;
    const int64_t o = ((first + i0 + i) * st.Hq + h0 * G) * D;
    for (int64_t x = 0; x < H; ++x)
      StoreOut(st, o + x * D, acc + (i * H + x) * D, sum[i * H + x], D);
  }
}

#include "ragged_paged_attention/kernel_cpu_amx.h"  // TaskAmx: bf16 pages on AMX tiles

// Queries per task: a page read for a task serves this many queries of a prompt from L1.
constexpr int64_t kQueriesPerTask = 16;

// Writes this step's K/V into layer l of the caches (C: float, bf16 bits or float8), then
// attends.
template <typename C>
static void Attend(ffi::ThreadPool& pool, const float* q, const float* k_new,
                   const float* v_new, C* k_cache, C* v_cache, int64_t l, const int32_t* slots,
                   const int32_t* lens, const int32_t* tables, const int32_t* cu, int64_t n,
                   float* out, uint16_t* out16, int64_t T, int64_t Hq, int64_t Hkv, int64_t NB,
                   int64_t BS, int64_t B, int64_t D, int32_t window, int32_t chunk,
                   float sm_scale, float soft_cap, const float* sinks, const int32_t* attend,
                   const float* scales) {
  const int64_t page = Hkv * BS * D;  // values per page of one layer
  C *kc = k_cache + l * NB * page, *vc = v_cache + l * NB * page;
  const float ks = scales != nullptr ? scales[0] : 1.f, vs = scales != nullptr ? scales[1] : 1.f;
  if (scales != nullptr)
    WriteKV<true>(pool, k_new, v_new, slots, T, NB, Hkv, BS, D, kc, vc, ks, vs);
  else
    WriteKV<false>(pool, k_new, v_new, slots, T, NB, Hkv, BS, D, kc, vc, ks, vs);
  const Step<C> st{q,  kc,     vc,     lens,  tables,        cu,       out,   out16,
                   Hq, Hkv,    Hq / Hkv, BS,  B,             D,        window, chunk,
                   sm_scale * ks, soft_cap, sinks, attend, vs};
  if (out16 != nullptr)
    std::memset(out16, 0, sizeof(uint16_t) * T * Hq * D);
  else
    std::memset(out, 0, sizeof(float) * T * Hq * D);
  struct Chunk { int64_t s, i0, i1; };
  std::vector<Chunk> chunks;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t i = 0, q_len = cu[s + 1] - cu[s]; i < q_len; i += kQueriesPerTask)
      chunks.push_back({s, i, std::min(i + kQueriesPerTask, q_len)});
  // Tasks cover all kv heads of a chunk (a page is read in one sweep) unless that leaves too
  // few to share: then the heads are split into ranges.
  const int64_t min_tasks = 4 * pool.num_threads();
  const int64_t n_chunks = std::max<int64_t>(static_cast<int64_t>(chunks.size()), 1);
  const int64_t split = std::min(Hkv, (min_tasks + n_chunks - 1) / n_chunks);
#ifdef JAXLLM_AMX
  // (Sinks and attend_to run on vectors: the tiles' path starts its softmax without sinks and
  // ends each query's keys at its own position.)
  const bool amx = std::is_same_v<C, uint16_t> && (D == 64 || D == 128) && sinks == nullptr &&
                   attend == nullptr && AmxAllowed();
#endif
  // A task learns the one its thread runs next, whose first pages it fetches (AMX path).
  ParallelForAhead(pool, static_cast<int64_t>(chunks.size()) * split, [&](int64_t task,
                                                                         int64_t next) {
    const Chunk& c = chunks[task / split];
    const int64_t part = task % split, h0 = Hkv * part / split, h1 = Hkv * (part + 1) / split;
#ifdef JAXLLM_AMX
    if constexpr (std::is_same_v<C, uint16_t>)
      if (amx) {
        if (next >= 0) {
          const Chunk& n = chunks[next / split];
          const int64_t p = next % split;
          FetchFirstPages(st, n.s, Hkv * p / split, Hkv * (p + 1) / split, n.i0, n.i1);
        }
        return D == 64 ? TaskAmx<64>(st, c.s, h0, h1, c.i0, c.i1)
                       : TaskAmx<128>(st, c.s, h0, h1, c.i0, c.i1);
      }
#endif
    switch (D) {
      case 64: return Task<64>(st, c.s, h0, h1, c.i0, c.i1);
      case 128: return Task<128>(st, c.s, h0, h1, c.i0, c.i1);
      default: return Task<0>(st, c.s, h0, h1, c.i0, c.i1);
    }
  });
}

// Whether bf16 pages run on AMX tiles here (`TaskAmx`: q and the probabilities rounded to
// bf16 for the products), for callers that must know which numerics they get.
extern "C" int JaxllmAttentionTiles() {
#ifdef JAXLLM_AMX
  return AmxAllowed();
#else
  return 0;
#endif
}

static ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                     ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                     ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                                     ffi::Buffer<ffi::S32> kv_lens,
                                     ffi::Buffer<ffi::S32> block_tables,
                                     ffi::Buffer<ffi::S32> cu_q_lens,
                                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                                     ffi::Buffer<ffi::S32> chunk,
                                     ffi::Buffer<ffi::F32> sinks,
                                     ffi::Buffer<ffi::S32> attend_to,
                                     ffi::Buffer<ffi::F32> kv_scales,
                                     ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> k_out,
                                     ffi::Result<ffi::AnyBuffer> v_out, float sm_scale,
                                     float soft_cap) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: unexpected ranks");
  }
  const int64_t T = qd[0], Hq = qd[1], D = qd[2];
  const int64_t L = cd[0], NB = cd[1], Hkv = cd[2], BS = cd[3];
  const int64_t S = td[0], B = td[1];
  if (cd[4] != D || Hq % Hkv != 0 || cu_q_lens.element_count() != S + 1 ||
      k_new.element_count() != T * Hkv * D || v_new.element_count() != T * Hkv * D ||
      slots.element_count() != T || v_cache.element_count() != k_cache.element_count() ||
      (sinks.element_count() != 0 && sinks.element_count() != Hq) ||
      (attend_to.element_count() != 0 && attend_to.element_count() != T) ||
      (kv_scales.element_count() != 0 && kv_scales.element_count() != 2)) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  }
  const auto dtype = k_cache.element_type();
  if ((dtype != ffi::F32 && dtype != ffi::BF16 && dtype != ffi::F8E4M3FN &&
       dtype != ffi::F8E5M2) || v_cache.element_type() != dtype)
    return ffi::Error::InvalidArgument(
        "paged attention: the caches must be f32, bf16, f8e4m3fn or f8e5m2, both alike");
  const int32_t l = layer.typed_data()[0];
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], S);
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  for (int64_t s = 0; s < n; ++s) {
    if (cu[s] < 0 || cu[s] > cu[s + 1] || cu[s + 1] > T) {
      return ffi::Error::InvalidArgument("paged attention: cu_q_lens out of order or range");
    }
  }
  const bool out16 = out->element_type() == ffi::BF16;
  if (!out16 && out->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("paged attention: out must be f32 or bf16");
  // The results alias the caches (XLA copies an argument first if it must keep it).
  auto run = [&](auto* kc, auto* vc) {
    Attend(pool, q.typed_data(), k_new.typed_data(), v_new.typed_data(), kc, vc, l,
           slots.typed_data(), kv_lens.typed_data(), block_tables.typed_data(), cu, n,
           out16 ? nullptr : out->typed_data<float>(),
           out16 ? static_cast<uint16_t*>(out->untyped_data()) : nullptr, T, Hq, Hkv, NB, BS, B,
           D, window.typed_data()[0], chunk.typed_data()[0], sm_scale,
           soft_cap, sinks.element_count() ? sinks.typed_data() : nullptr,
           attend_to.element_count() ? attend_to.typed_data() : nullptr,
           kv_scales.element_count() ? kv_scales.typed_data() : nullptr);
  };
  auto as = [&](auto* type) {  // the caches' (aliased) buffers as that element type
    using C = std::remove_pointer_t<decltype(type)>;
    run(static_cast<C*>(k_out->untyped_data()), static_cast<C*>(v_out->untyped_data()));
  };
  if (dtype == ffi::F32)
    as(static_cast<float*>(nullptr));
  else if (dtype == ffi::BF16)
    as(static_cast<uint16_t*>(nullptr));
  else if (dtype == ffi::F8E4M3FN)
    as(static_cast<F8E4M3*>(nullptr));
  else
    as(static_cast<F8E5M2*>(nullptr));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (this step's)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::AnyBuffer>()         // k_cache, f32/bf16/fp8
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // chunk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // attend_to [T] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scales [2] or [0]
                                  .Ret<ffi::AnyBuffer>()         // out, f32 or bf16
                                  .Ret<ffi::AnyBuffer>()         // k_cache, aliased
                                  .Ret<ffi::AnyBuffer>()         // v_cache, aliased
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
