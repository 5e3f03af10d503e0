// silu(gate) * up on 8 floats and on a row, shared by the activation kernel and the matmuls'
// gated results (the gate/up projection's output, activated while it is in cache).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_vec.h"

// sigmoid(g) from e = exp(-|g|) <= 1 (no overflow either way).
template <typename V>
static inline V Sigmoid(V g) {
  const V e = ExpV(g < 0 ? g : -g), r = 1.f / (1.f + e);
  return g < 0 ? e * r : r;
}

// silu(g) * u lane-wise; kRound: g and u rounded to bf16, silu computed in f32 and rounded, the
// product rounded (as torch's bf16 silu and multiply).
template <bool kRound, typename V>
static inline V SiluMul(V g, V u) {
  if constexpr (kRound) {
    g = RoundBF16(g);
    return RoundBF16(RoundBF16(g * Sigmoid(g)) * RoundBF16(u));
  }
  return g * Sigmoid(g) * u;
}

// o[0:F] = silu(g[0:F]) * u[0:F] in O's type (float, or bf16 bits rounded as SiluMul<true>):
// 16 lanes at a time where the CPU has them (the bf16 roundings are shuffles, which only one
// port runs: 8 lanes at a time took 4.9 ms for a 2048-token MoE layer's 4M values), then 8,
// then the tail through the 8-lane code, one lane used.
template <typename O>
static inline void SiluMulRow(const float* g, const float* u, O* o, int64_t F) {
  constexpr bool kRound = !std::is_same_v<O, float>;
  int64_t f = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (; f + 16 <= F; f += 16) Store16(SiluMul<kRound>(Load16(g + f), Load16(u + f)), o + f);
#endif
  for (; f + 8 <= F; f += 8) Store8(SiluMul<kRound>(Load8(g + f), Load8(u + f)), o + f);
  for (; f < F; ++f) {
    const float r = SiluMul<kRound>(v8{} + g[f], v8{} + u[f])[0];
    if constexpr (kRound) o[f] = ToBF16(r); else o[f] = r;
  }
}
