// Ragged paged attention for XLA:CPU, called through the XLA FFI.
//
// XLA:CPU runs the pure-JAX reference's page gather, transposes and small batched dots at
// 2-4 GB/s; this loop reads each sequence's pages in place (10-20 GB/s here). Same layout and
// semantics as reference.py's write_kv followed by ragged_paged_attention:
//   q [T, Hq, D] f32, k/v [T, Hkv, D] f32 (this step's), k/v cache [L, NB, Hkv, BS, D] f32,
//   layer [], slot_mapping [T] (block * BS + offset; < 0: padding), kv_lens [S],
//   block_tables [S, B], cu_q_lens [S + 1], num_seqs [1], window [] (<= 0: none);
//   attrs sm_scale, soft_cap (0: none); results out [T, Hq, D] and the two caches, which alias
//   the cache arguments: k/v are written in place. (As XLA ops, the scatter's index arithmetic
//   and bounds checks were nine small ops per layer, ~0.5 ms of a 30-layer decode token.)
// Rows of no sequence come out as zeros. Work is split over (sequence, kv head, up to
// kQueriesPerTask queries) tasks run on XLA's own intra-op thread pool (a separate OpenMP pool
// would spin against XLA's threads).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"

namespace ffi = xla::ffi;

typedef float v8 __attribute__((vector_size(32)));

// What every task reads: one layer's pages and the step's inputs.
struct Step {
  const float *q, *k, *v;  // q [T, Hq, D]; k, v: the layer's pages [NB, Hkv, BS, D]
  const int32_t *lens, *tables, *cu;
  float* out;
  int64_t Hq, Hkv, G, BS, B, D;
  int32_t window;
  float sm_scale, soft_cap;
};

// q . k over D floats (kD: D known at compile time, so the loop unrolls; 0: runtime D).
template <int64_t kD>
static inline float Dot(const float* q, const float* k, int64_t D) {
  if constexpr (kD > 0) D = kD;
  v8 s0 = {}, s1 = {}, x, y;
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {  // two chains: an FMA's latency is longer than its issue
    std::memcpy(&x, q + d, sizeof x), std::memcpy(&y, k + d, sizeof y), s0 += x * y;
    std::memcpy(&x, q + d + 8, sizeof x), std::memcpy(&y, k + d + 8, sizeof y), s1 += x * y;
  }
  for (; d + 8 <= D; d += 8)
    std::memcpy(&x, q + d, sizeof x), std::memcpy(&y, k + d, sizeof y), s0 += x * y;
  s0 += s1;
  float r = 0.f;
  for (int i = 0; i < 8; ++i) r += s0[i];
  for (; d < D; ++d) r += q[d] * k[d];
  return r;
}

// Pairwise sums of two vectors: [a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, ..., b6+b7].
static inline v8 PairSums(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

// q . k[r] for the 8 rows r of k [8, D] at once: eight independent FMA chains, then one
// transposing reduction (three rounds of pairwise sums) instead of eight serial ones.
template <int64_t kD>
static inline v8 Dot8(const float* q, const float* k, int64_t D) {
  if constexpr (kD > 0) D = kD;
  v8 acc[8] = {}, x, y;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    std::memcpy(&x, q + d, sizeof x);
    for (int r = 0; r < 8; ++r) std::memcpy(&y, k + r * D + d, sizeof y), acc[r] += x * y;
  }
  v8 out = PairSums(PairSums(PairSums(acc[0], acc[1]), PairSums(acc[2], acc[3])),
                    PairSums(PairSums(acc[4], acc[5]), PairSums(acc[6], acc[7])));
  for (; d < D; ++d)
    for (int r = 0; r < 8; ++r) out[r] += q[d] * k[r * D + d];
  return out;
}

typedef int32_t v8i __attribute__((vector_size(32)));

// exp(x) of 8 floats x <= 0 (Cephes' expf polynomial, ~1e-7 relative): libm's expf is scalar
// here and was a fifth of the kernel's time.
static inline v8 Exp8(v8 x) {
  x = x < -87.f ? v8{} - 87.f : x;
  // n = round(x / ln 2) (x <= 0: truncating x / ln 2 - 0.5 rounds; -ffast-math would fold the
  // usual add-and-subtract-2^23 trick away), r = x - n ln 2 in two parts, exp(x) = 2^n exp(r).
  const v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v8i);
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8 p = v8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8i bits = (n + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// acc[0:D] += sum_j p[j] * v[j] over rows j0..j1 of v [*, D]; with kD the sum stays in registers.
template <int64_t kD>
static inline void AddRows(const float* p, const float* v, int64_t j0, int64_t j1, int64_t D,
                           float* __restrict acc) {
  if constexpr (kD > 0 && kD % 8 == 0) {
    v8 r[kD / 8], x;
    std::memcpy(r, acc, sizeof r);
    for (int64_t j = j0; j < j1; ++j) {
      const v8 pj = v8{} + p[j];
      for (int64_t i = 0; i < kD / 8; ++i)
        std::memcpy(&x, v + j * kD + 8 * i, sizeof x), r[i] += pj * x;
    }
    std::memcpy(acc, r, sizeof r);
  } else {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * v[j * D + d];
  }
}

// One query head's online-softmax step over rows j0..j1-1 of a page (k, v [BS, D]): scores
// (in sc [BS]), then the running maximum m, sum of exponentials and weighted sum acc [D].
template <int64_t kD>
static inline void Update(const Step& st, const float* q, const float* k, const float* v,
                          int64_t j0, int64_t j1, float* sc, float& m, float& sum, float* acc) {
  const int64_t D = kD > 0 ? kD : st.D;
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    const v8 x = Dot8<kD>(q, k + j * D, D) * st.sm_scale;
    std::memcpy(sc + j, &x, sizeof x);
  }
  for (; j < j1; ++j) sc[j] = Dot<kD>(q, k + j * D, D) * st.sm_scale;
  float mx = m;
  for (j = j0; j < j1; ++j) {
    if (st.soft_cap > 0.f) sc[j] = st.soft_cap * std::tanh(sc[j] / st.soft_cap);
    mx = std::max(mx, sc[j]);
  }
  if (mx > m) {  // rescale what was summed under the old maximum
    const float c = std::exp(m - mx);
    sum *= c;
    for (int64_t d = 0; d < D; ++d) acc[d] *= c;
    m = mx;
  }
  for (j = j0; j + 8 <= j1; j += 8) {
    v8 e;
    std::memcpy(&e, sc + j, sizeof e);
    e = Exp8(e - mx);
    std::memcpy(sc + j, &e, sizeof e);
    for (int l = 0; l < 8; ++l) sum += e[l];
  }
  for (; j < j1; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
  AddRows<kD>(sc, v, j0, j1, D, acc);
}

// Sequence s, kv head h, its queries i0..i1-1 (of q_len): their G query heads each against
// the pages up to its own position, one page at a time with an online softmax, so a page's K and
// V rows are read from memory once for every query and head of the task (then from L1).
template <int64_t kD>
static void Task(const Step& st, int64_t s, int64_t h, int64_t i0, int64_t i1) {
  const int64_t G = st.G, BS = st.BS, D = kD > 0 ? kD : st.D, nq = i1 - i0;
  const int64_t len = std::min<int64_t>(st.lens[s], st.B * BS);
  const int64_t first = st.cu[s], q_len = st.cu[s + 1] - first;
  const int64_t p0 = len - q_len + i0, p1 = len - q_len + i1 - 1;  // first, last query position
  if (p1 < 0) return;
  auto start = [&](int64_t pos) {  // first key a query at pos sees
    return st.window > 0 ? std::max<int64_t>(0, pos - st.window + 1) : 0;
  };
  thread_local std::vector<float> buf;
  buf.assign(nq * G * (D + 2) + BS, 0.f);
  float *acc = buf.data(), *m = acc + nq * G * D, *sum = m + nq * G, *scores = sum + nq * G;
  std::fill(m, m + nq * G, -INFINITY);
  const int32_t* table = st.tables + s * st.B;
  for (int64_t b = start(std::max<int64_t>(p0, 0)) / BS, last = p1 / BS; b <= last; ++b) {
    const int64_t off = (table[b] * st.Hkv + h) * BS * D;
    const float *k = st.k + off, *v = st.v + off;
    // The next page's rows are requested while this page is used: one head's rows (BS * D
    // floats) are too short a run for the hardware prefetcher to get going.
    if (b < last) {
      const int64_t next = (table[b + 1] * st.Hkv + h) * BS * D;
      for (int64_t i = 0; i < BS * D; i += 16) {
        __builtin_prefetch(st.k + next + i);
        __builtin_prefetch(st.v + next + i);
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t pos = p0 + i;
      if (pos < 0) continue;
      const int64_t j0 = std::max(start(pos), b * BS) - b * BS;
      const int64_t j1 = std::min(pos + 1, (b + 1) * BS) - b * BS;
      if (j0 >= j1) continue;
      const float* q = st.q + ((first + i0 + i) * st.Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;  // this query head's state
        Update<kD>(st, q + g * D, k, v, j0, j1, scores, m[r], sum[r], acc + r * D);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (p0 + i < 0) continue;
    float* o = st.out + ((first + i0 + i) * st.Hq + h * G) * D;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[(i * G + g) * D + d] / sum[i * G + g];
  }
}

// Queries per task: a page read for a task serves this many queries of a prompt from L1.
constexpr int64_t kQueriesPerTask = 16;

// This step's k/v rows [T, Hkv, D] into the layer's pages [NB, Hkv, BS, D] at their slots;
// padding (slot < 0) and slots past the cache are dropped, as the reference's scatter does.
static void WriteKV(const float* k, const float* v, const int32_t* slots, int64_t T,
                    int64_t NB, int64_t Hkv, int64_t BS, int64_t D, float* kc, float* vc) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= NB * BS) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t dst = ((slot / BS * Hkv + h) * BS + slot % BS) * D, src = (t * Hkv + h) * D;
      std::memcpy(kc + dst, k + src, sizeof(float) * D);
      std::memcpy(vc + dst, v + src, sizeof(float) * D);
    }
  }
}

static ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                     ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                     ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                                     ffi::Buffer<ffi::S32> kv_lens,
                                     ffi::Buffer<ffi::S32> block_tables,
                                     ffi::Buffer<ffi::S32> cu_q_lens,
                                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                                     ffi::ResultBuffer<ffi::F32> out,
                                     ffi::ResultBuffer<ffi::F32> k_out,
                                     ffi::ResultBuffer<ffi::F32> v_out, float sm_scale,
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
      slots.element_count() != T) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  }
  const int32_t l = layer.typed_data()[0];
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], S);
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  for (int64_t s = 0; s < n; ++s) {
    if (cu[s] < 0 || cu[s] > cu[s + 1] || cu[s + 1] > T) {
      return ffi::Error::InvalidArgument("paged attention: cu_q_lens out of order or range");
    }
  }

  // The results alias the caches (XLA copies an argument first if it must keep it).
  const int64_t page = Hkv * BS * D;  // floats per page of one layer
  float *kc = k_out->typed_data() + l * NB * page, *vc = v_out->typed_data() + l * NB * page;
  WriteKV(k_new.typed_data(), v_new.typed_data(), slots.typed_data(), T, NB, Hkv, BS, D, kc, vc);
  const Step st{q.typed_data(), kc, vc, kv_lens.typed_data(),
                block_tables.typed_data(), cu, out->typed_data(), Hq, Hkv, Hq / Hkv, BS, B, D,
                window.typed_data()[0], sm_scale, soft_cap};
  std::memset(st.out, 0, sizeof(float) * T * Hq * D);
  struct Chunk { int64_t s, i0, i1; };
  std::vector<Chunk> chunks;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t i = 0, q_len = cu[s + 1] - cu[s]; i < q_len; i += kQueriesPerTask)
      chunks.push_back({s, i, std::min(i + kQueriesPerTask, q_len)});
  ParallelFor(pool, static_cast<int64_t>(chunks.size()) * Hkv, [&](int64_t task) {
    const Chunk& c = chunks[task / Hkv];
    const int64_t h = task % Hkv;
    switch (D) {
      case 64: return Task<64>(st, c.s, h, c.i0, c.i1);
      case 128: return Task<128>(st, c.s, h, c.i0, c.i1);
      default: return Task<0>(st, c.s, h, c.i0, c.i1);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (this step's)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_cache, aliased
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v_cache, aliased
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
