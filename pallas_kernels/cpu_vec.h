// 8-float vectors and the bf16 <-> f32 conversions and exp the native CPU kernels share.
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// x in all 8 lanes, as one broadcast: `v8{} + x` is an add the compiler must keep without
// -ffast-math (0 + -0 is +0), one per use in an inner loop.
static inline v8 Splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }

// 8 values as f32: f32 as they are, bf16 (its bits) widened and shifted.
static inline v8 Load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
static inline v8 Load8(const uint16_t* p) {
#ifdef __AVX2__  // one widening load (GCC splits the generic conversion into four instructions)
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  v8u16 h;
  std::memcpy(&h, p, sizeof h);
  const v8i bits = __builtin_convertvector(h, v8i) << 16;
  v8 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}
static inline float ToF32(float v) { return v; }
static inline float ToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// f32 -> bf16 bits rounded to nearest even, as astype(bfloat16); a NaN stays a NaN.
static inline uint16_t ToBF16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x7FFFFFFF) > 0x7F800000 ? (u >> 16) | 0x40 : (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}
#ifdef __AVX512F__
// 16-float vectors: the same lane-wise operations as v8's in half the instructions (an
// operation's bits per lane do not depend on the vector's width).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

static inline v16 Load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
#endif

// The int32, uint32 and uint16 vectors with V's lanes.
template <typename V>
struct Lanes;
template <>
struct Lanes<v8> { using I = v8i; using U = v8u; using H = v8u16; };
#ifdef __AVX512F__
template <>
struct Lanes<v16> { using I = v16i; using U = v16u; using H = v16u16; };
#endif

// f32 -> bf16 of a vector's values, as ToBF16 (subnormals kept): signed compares, native in
// AVX2.
template <typename V>
static inline void StoreBF16(V x, uint16_t* p) {
  using I = typename Lanes<V>::I;
  using H = typename Lanes<V>::H;
  I u;
  std::memcpy(&u, &x, sizeof u);
  const I r = (u & 0x7FFFFFFF) > 0x7F800000 ? u | 0x400000 : u + 0x7FFF + ((u >> 16) & 1);
  const H h = __builtin_convertvector((typename Lanes<V>::U)r >> 16, H);
  std::memcpy(p, &h, sizeof h);
}
static inline void Store8(v8 x, uint16_t* p) { StoreBF16(x, p); }
static inline void Store8(v8 x, float* p) { std::memcpy(p, &x, sizeof x); }
#ifdef __AVX512F__
static inline void Store16(v16 x, uint16_t* p) { StoreBF16(x, p); }
static inline void Store16(v16 x, float* p) { std::memcpy(p, &x, sizeof x); }
#endif

// x rounded to bf16 (nearest even), kept as f32; the AVX512_BF16 instruction also flushes
// subnormals (below 1.2e-38) to zero. (Rounding with integer operations instead, which two
// ports run where the instruction and the widening back are shuffles on one, measured slower.)
static inline v8 RoundBF16(v8 x) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh((__m256)x)), 16);
#else
  v8i u;
  std::memcpy(&u, &x, sizeof u);
  const v8i r = ((u & 0x7FFFFFFF) > 0x7F800000 ? u | 0x400000 : u + 0x7FFF + ((u >> 16) & 1)) &
                ~0xFFFF;
  v8 y;
  std::memcpy(&y, &r, sizeof y);
  return y;
#endif
}
#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline v16 RoundBF16(v16 x) {  // as v8's: the same instruction
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)x)),
                                16);
}
#endif

// exp(x) of floats x <= 0 (Cephes' expf polynomial, ~1e-7 relative): libm's expf is scalar.
template <typename V>
static inline V ExpV(V x) {
  using I = typename Lanes<V>::I;
  x = x < -87.f ? V{} - 87.f : x;
  // n = round(x / ln 2) (x <= 0: truncating x / ln 2 - 0.5 rounds; -ffast-math would fold the
  // usual add-and-subtract-2^23 trick away), r = x - n ln 2 in two parts, exp(x) = 2^n exp(r).
  const I n = __builtin_convertvector(x * 1.44269504f - 0.5f, I);
  const V nf = __builtin_convertvector(n, V);
  const V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
static inline v8 Exp8(v8 x) { return ExpV(x); }
