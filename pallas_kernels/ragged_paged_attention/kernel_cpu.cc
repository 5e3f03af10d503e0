// Paged decode attention for XLA:CPU (one query per sequence), called through the XLA FFI.
//
// XLA:CPU runs the pure-JAX reference's page gather, transposes and small batched dots at
// 2-4 GB/s; this loop reads each sequence's pages in place once (10-20 GB/s here). Same layout
// and semantics as reference.py with one query per sequence (q row s = sequence s):
//   q [T, Hq, D] f32, k/v cache [L, NB, Hkv, BS, D] f32, layer [], kv_lens [S],
//   block_tables [S, B], num_seqs [1], window [] (<= 0: none); attrs sm_scale, soft_cap (0: none).
// Rows past num_seqs come out as zeros. Work is split over (sequence, kv head) tasks run on
// XLA's own intra-op thread pool (a separate OpenMP pool would spin against XLA's threads).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"

namespace ffi = xla::ffi;

typedef float v8 __attribute__((vector_size(32)));

// What every (sequence, kv head) task reads: one layer's pages and the step's inputs.
struct Step {
  const float *q, *k, *v;  // q [T, Hq, D]; k, v: the layer's pages [NB, Hkv, BS, D]
  const int32_t *lens, *tables;
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

// Sequence s, kv head h: its G query heads against its pages, one page at a time with an
// online softmax, so each page's K and V rows are read from memory once for all G heads.
template <int64_t kD>
static void Task(const Step& st, int64_t s, int64_t h) {
  const int64_t G = st.G, BS = st.BS, D = kD > 0 ? kD : st.D;
  const int64_t len = std::min<int64_t>(st.lens[s], st.B * BS);
  if (len <= 0) return;
  const int64_t lo = st.window > 0 ? std::max<int64_t>(0, len - st.window) : 0;  // query: len-1
  thread_local std::vector<float> buf;
  buf.assign(G * D + G * BS + 2 * G, 0.f);
  float *acc = buf.data(), *scores = acc + G * D, *m = scores + G * BS, *sum = m + G;
  std::fill(m, m + G, -INFINITY);
  const float* q = st.q + (s * st.Hq + h * G) * D;
  const int32_t* table = st.tables + s * st.B;
  for (int64_t b = lo / BS, last = (len - 1) / BS; b <= last; ++b) {
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
    const int64_t j0 = std::max(lo, b * BS) - b * BS, j1 = std::min(len, (b + 1) * BS) - b * BS;
    for (int64_t g = 0; g < G; ++g) {
      float* sc = scores + g * BS;
      float mx = m[g];
      for (int64_t j = j0; j < j1; ++j) {
        float x = Dot<kD>(q + g * D, k + j * D, D) * st.sm_scale;
        if (st.soft_cap > 0.f) x = st.soft_cap * std::tanh(x / st.soft_cap);
        mx = std::max(mx, sc[j] = x);
      }
      float* a = acc + g * D;
      if (mx > m[g]) {  // rescale what was summed under the old maximum
        const float c = std::exp(m[g] - mx);
        sum[g] *= c;
        for (int64_t d = 0; d < D; ++d) a[d] *= c;
        m[g] = mx;
      }
      for (int64_t j = j0; j < j1; ++j) sum[g] += (sc[j] = std::exp(sc[j] - mx));  // vectorized
      AddRows<kD>(sc, v, j0, j1, D, a);
    }
  }
  float* o = st.out + (s * st.Hq + h * G) * D;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] / sum[g];
}

static ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                  ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                                  ffi::Buffer<ffi::S32> block_tables,
                                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                                  ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                                  float soft_cap) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged decode: unexpected ranks");
  }
  const int64_t T = qd[0], Hq = qd[1], D = qd[2];
  const int64_t L = cd[0], NB = cd[1], Hkv = cd[2], BS = cd[3];
  const int64_t S = td[0], B = td[1];
  if (cd[4] != D || Hq % Hkv != 0) {
    return ffi::Error::InvalidArgument("paged decode: head_dim or head counts do not match");
  }
  const int32_t l = layer.typed_data()[0];
  const int64_t n = std::min<int64_t>({static_cast<int64_t>(num_seqs.typed_data()[0]), S, T});
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged decode: layer out of range");

  const int64_t page = Hkv * BS * D;  // floats per page of one layer
  const Step st{q.typed_data(), k_cache.typed_data() + l * NB * page,
                v_cache.typed_data() + l * NB * page, kv_lens.typed_data(),
                block_tables.typed_data(), out->typed_data(), Hq, Hkv, Hq / Hkv, BS, B, D,
                window.typed_data()[0], sm_scale, soft_cap};
  std::memset(st.out, 0, sizeof(float) * T * Hq * D);
  ParallelFor(pool, n * Hkv, [&](int64_t task) {
    const int64_t s = task / Hkv, h = task % Hkv;
    switch (D) {
      case 64: return Task<64>(st, s, h);
      case 128: return Task<128>(st, s, h);
      default: return Task<0>(st, s, h);
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
