// Part of kernel_cpu_quant.h: 16-float rows (`F16`, one AVX-512 register, two AVX2 ones, or
// portable vectors elsewhere) and the widening of a strip's load of packed quantized rows into
// them (`QRow`) or, for vdpbf16ps, into bf16 pairs (`BfPair`). Integers of 8 bits and fewer are
// exact in f32 and bf16, so every path multiplies by the same values.
#ifndef JAXLLM_MATMUL_KERNEL_CPU_QUANT_VEC_H_
#define JAXLLM_MATMUL_KERNEL_CPU_QUANT_VEC_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_vec.h"

// Fma(a, b, c) = a * b + c and Fnma(a, b, c) = c - a * b, rounded once where the ISA fuses them
// (an ISA without FMA rounds twice, in every path alike).
#if defined(__AVX512F__)
struct F16 {
  __m512 v;
};
static inline F16 F16Zero() { return {_mm512_setzero_ps()}; }
static inline F16 F16Splat(float a) { return {_mm512_set1_ps(a)}; }
static inline F16 F16Load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void F16Store(F16 a, float* p) { _mm512_storeu_ps(p, a.v); }
static inline F16 F16Fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline F16 F16Fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
#elif defined(__AVX2__) && defined(__FMA__)
struct F16 {
  __m256 lo, hi;
};
static inline F16 F16Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline F16 F16Splat(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline F16 F16Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void F16Store(F16 a, float* p) {
  _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi);
}
static inline F16 F16Fma(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline F16 F16Fnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
#else
struct F16 {
  v8 lo, hi;
};
static inline F16 F16Zero() { return {v8{}, v8{}}; }
static inline F16 F16Splat(float a) { return {Splat8(a), Splat8(a)}; }
static inline F16 F16Load(const float* p) { return {Load8(p), Load8(p + 8)}; }
static inline void F16Store(F16 a, float* p) { Store8(a.lo, p), Store8(a.hi, p + 8); }
static inline F16 F16Fma(F16 a, F16 b, F16 c) { return {a.lo * b.lo + c.lo, a.hi * b.hi + c.hi}; }
static inline F16 F16Fnma(F16 a, F16 b, F16 c) {
  return {c.lo - a.lo * b.lo, c.hi - a.hi * b.hi};
}
#endif

// What one 32-value load of a strip holds: int8 and the widened forms one pair of rows (2p,
// 2p + 1), int4 two pairs (rows 4b .. 4b + 3).
template <typename Q>
constexpr int kPairsPer = std::is_same_v<Q, uint8_t> ? 2 : 1;

// Row t of a strip's load at p as f32 (t < 2, int4 t < 4), 16 columns: returned by value, so
// that the chains keep them in registers (an array written through a pointer stayed in memory).
template <int t>
static inline F16 QRow(const float* p) { return F16Load(p + 16 * t); }

template <int t>
static inline F16 QRow(const int8_t* p) {
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * t))))};
#elif defined(__AVX2__)
  auto half = [](const int8_t* a) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)a)));
  };
  return {half(p + 16 * t), half(p + 16 * t + 8)};
#else
  typedef int8_t v8i8 __attribute__((vector_size(8)));
  auto half = [](const int8_t* a) {
    v8i8 b;
    std::memcpy(&b, a, sizeof b);
    return __builtin_convertvector(b, v8);
  };
  return {half(p + 16 * t), half(p + 16 * t + 8)};
#endif
}

// int4: byte 2j + u holds row 4b + u of column j (low nibble) and row 4b + 2 + u (high), each
// plus 8; as 16-bit words, column j's word has rows 0-3 at bits 0, 8, 4 and 12.
template <int t>
static inline F16 QRow(const uint8_t* p) {
  constexpr int kShift = t == 0 ? 0 : t == 1 ? 8 : t == 2 ? 4 : 12;
#if defined(__AVX512F__)
  // vpermps reads an index's low 4 bits: the row's nibble shifted down, no mask.
  const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(d, kShift), values)};
#elif defined(__AVX2__)
  auto half = [](const uint8_t* a) {
    const __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)a));
    const __m256i v = _mm256_and_si256(_mm256_srli_epi32(d, kShift), _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8)));
  };
  return {half(p), half(p + 16)};
#else
  typedef uint16_t v8u16b __attribute__((vector_size(16)));
  auto half = [](const uint8_t* a) {
    v8u16b b;
    std::memcpy(&b, a, sizeof b);
    return __builtin_convertvector(((__builtin_convertvector(b, v8i) >> kShift) & 15) - 8, v8);
  };
  return {half(p), half(p + 16)};
#endif
}

#ifdef JAXLLM_DPBF16
// Pair t of a strip's load at p as vdpbf16ps' operand: 16 lanes of (q[2p, j], q[2p + 1, j])
// in bf16.
template <int t>
static inline __m512bh BfPair(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int t>
static inline __m512bh BfPair(const int8_t* p) {
  // The values are exact in bf16: their f32 high halves, interleaved column by column.
  const __m512i high = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19,
                                        49, 17, 47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35,
                                        3, 33, 1);
  return (__m512bh)_mm512_permutex2var_epi16((__m512i)QRow<0>(p).v, high,
                                             (__m512i)QRow<1>(p).v);
}

template <int t>
static inline __m512bh BfPair(const uint8_t* p) {
  // Byte 2j + u as word 2j + u is the operand's order already: vpermw looks each word's low
  // nibble up (it reads 5 bits: the table repeats), or (t = 1) its high nibble shifted down.
  const __m512i values = _mm512_set_epi16(
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040,
      0xC080, 0xC0A0, 0xC0C0, 0xC0E0, (short)0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040,
      0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0,
      (short)0xC100);
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  return (__m512bh)_mm512_permutexvar_epi16(t ? _mm512_srli_epi16(w, 4) : w, values);
}
#endif

// f(integral_constant<t>) for t < n.
template <int n, typename F>
static inline void Unroll(const F& f) {
  if constexpr (n > 0) {
    Unroll<n - 1>(f);
    f(std::integral_constant<int, n - 1>{});
  }
}

// A packed strip's P pairs (its loads `step` values apart) widened for the chains: f32 rows
// [2P, 16] (kBf false) or bf16 pairs [P, 16, 2].
template <bool kBf, typename Q, typename T>
static void WidenStrip(const Q* q, int64_t step, int64_t P, T* dst) {
  constexpr int kPairs = kPairsPer<Q>;
  for (int64_t i = 0; i < P; i += kPairs, q += step, dst += 32 * kPairs) {
#ifdef JAXLLM_DPBF16
    if constexpr (kBf) {
      Unroll<kPairs>([&](auto t) {
        _mm512_storeu_si512(dst + 32 * t, (__m512i)BfPair<t>(q));
      });
      continue;
    }
#endif
    if constexpr (!kBf) Unroll<2 * kPairs>([&](auto t) { F16Store(QRow<t>(q), dst + 16 * t); });
  }
}

#endif  // JAXLLM_MATMUL_KERNEL_CPU_QUANT_VEC_H_
