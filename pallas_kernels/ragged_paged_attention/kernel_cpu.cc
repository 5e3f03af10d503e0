// Paged decode attention for XLA:CPU (one query per sequence), called through the XLA FFI.
//
// XLA:CPU runs the pure-JAX reference's page gather, transposes and small batched dots at
// 2-4 GB/s; this loop reads each sequence's pages in place once, at memory speed. Same layout
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

static ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                                  ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer,
                                  ffi::Buffer<ffi::S32> kv_lens,
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
  const int64_t G = Hq / Hkv;
  const int32_t l = layer.typed_data()[0];
  const int32_t win = window.typed_data()[0];
  const int64_t n = std::min<int64_t>({static_cast<int64_t>(num_seqs.typed_data()[0]), S, T});
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged decode: layer out of range");

  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* tables = block_tables.typed_data();
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * T * Hq * D);
  const int64_t page = Hkv * BS * D;  // floats per page of one layer
  const float* kl = kp + l * NB * page;
  const float* vl = vp + l * NB * page;

  ParallelFor(pool, n * Hkv, [&](int64_t task) {
      std::vector<float> scores, acc(G * D), inv(G);
      const int64_t s = task / Hkv, h = task % Hkv;
      const int64_t len = std::min<int64_t>(lens[s], B * BS);
      if (len <= 0) return;
      const int64_t lo = win > 0 ? std::max<int64_t>(0, len - win) : 0;  // query at len - 1
      const int64_t nk = len - lo;
      scores.resize(G * nk);
      const float* qs = qp + (s * Hq + h * G) * D;
      for (int64_t j = lo; j < len; ++j) {
        const int32_t blk = tables[s * B + j / BS];
        const float* k = kl + blk * page + (h * BS + j % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          dot *= sm_scale;
          if (soft_cap > 0.f) dot = soft_cap * std::tanh(dot / soft_cap);
          scores[g * nk + (j - lo)] = dot;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * nk;
        const float m = *std::max_element(sg, sg + nk);
        float sum = 0.f;
        for (int64_t j = 0; j < nk; ++j) sum += (sg[j] = std::exp(sg[j] - m));
        inv[g] = 1.f / sum;
      }
      for (int64_t j = lo; j < len; ++j) {
        const int32_t blk = tables[s * B + j / BS];
        const float* v = vl + blk * page + (h * BS + j % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * nk + (j - lo)];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      float* o = op + (s * Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv[g];
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
