// The write half of the paged attention kernel (kernel_cpu.cc): this step's K/V rows into
// their cache slots, as the reference's write_kv stores them in each cache dtype.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_parallel.h"
#include "cpu_vec.h"
#include "ragged_paged_attention/kernel_cpu_fp8.h"

namespace ffi = xla::ffi;

static inline void Store(float x, float* p) { *p = x; }
static inline void Store(float x, uint16_t* p) { *p = ToBF16(x); }

// This step's k/v rows [T, Hkv, D] into the layer's pages [NB, Hkv, BS, D] at their slots;
// padding (slot < 0) and slots past the cache are dropped, as the reference's scatter does.
// Eight values at a time, tokens split over the pool (a 2048-token prompt step writes 1M
// values: 2.5-5 ms one value at a time on one thread). With KV scales (kScaled) the values
// are divided by them first, as the reference's quantize_kv does.
template <bool kScaled, typename C>
static void WriteKV(ffi::ThreadPool& pool, const float* k, const float* v, const int32_t* slots,
                    int64_t T, int64_t NB, int64_t Hkv, int64_t BS, int64_t D, C* kc, C* vc,
                    float ks, float vs) {
  constexpr int64_t kTokensPerTask = 64;
  ParallelFor(pool, (T + kTokensPerTask - 1) / kTokensPerTask, [&](int64_t task) {
    for (int64_t t = task * kTokensPerTask; t < std::min(T, (task + 1) * kTokensPerTask); ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= NB * BS) continue;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = ((slot / BS * Hkv + h) * BS + slot % BS) * D, src = (t * Hkv + h) * D;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
          if constexpr (kScaled) {
            Store8(Load8(k + src + d) / Splat8(ks), kc + dst + d);
            Store8(Load8(v + src + d) / Splat8(vs), vc + dst + d);
          } else {
            Store8(Load8(k + src + d), kc + dst + d);
            Store8(Load8(v + src + d), vc + dst + d);
          }
        }
        for (; d < D; ++d) {
          Store(kScaled ? k[src + d] / ks : k[src + d], kc + dst + d);
          Store(kScaled ? v[src + d] / vs : v[src + d], vc + dst + d);
        }
      }
    }
  });
}

