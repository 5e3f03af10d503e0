// float8 KV pages for the paged attention kernel (kernel_cpu.cc): e4m3fn and e5m2 values read
// as f32 (8 at a time, exactly: every float8 value is an f32 one) and f32 values written as
// the reference's `quantize_kv` stores them: saturated to the format's largest finite value,
// then rounded to nearest even, bit for bit what XLA's convert (jnp's astype) gives.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "cpu_vec.h"

// One float8 value's bits; distinct types so the kernel's templates pick the format.
struct F8E4M3 { uint8_t bits; };  // sign, 4 exponent bits (bias 7), 3 mantissa; no inf
struct F8E5M2 { uint8_t bits; };  // sign, 5 exponent bits (bias 15), 2 mantissa; IEEE-like

// A format's layout: mantissa bits, exponent bias, the largest finite value's bits (what
// saturation stores) and the bits of a NaN (what ml_dtypes and XLA store for one).
template <typename F>
struct F8Format;
template <>
struct F8Format<F8E4M3> {
  static constexpr int kMant = 3, kBias = 7;
  static constexpr uint8_t kMaxBits = 0x7E, kNaNBits = 0x7F;  // 448
};
template <>
struct F8Format<F8E5M2> {
  static constexpr int kMant = 2, kBias = 15;
  static constexpr uint8_t kMaxBits = 0x7B, kNaNBits = 0x7E;  // 57344
};

static inline float BitsToF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One value as f32: a normal one rebiased into f32's exponent, a subnormal one m * 2^-(bias
// + mant - 1) (exact in f32), the top exponent NaN (e4m3: only mantissa 111) or inf (e5m2).
template <typename F>
static inline float F8ToF32(uint8_t b) {
  using Fmt = F8Format<F>;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t e = (b & 0x7F) >> Fmt::kMant, m = b & ((1u << Fmt::kMant) - 1);
  const uint32_t top = (0x7Fu >> Fmt::kMant);
  if (e == top && (std::is_same_v<F, F8E5M2> || m == (1u << Fmt::kMant) - 1))
    return BitsToF32(sign | (m == 0 ? 0x7F800000u : 0x7FC00000u));
  if (e == 0) {
    const float x = static_cast<float>(m) * std::ldexp(1.f, 1 - Fmt::kBias - Fmt::kMant);
    return sign ? -x : x;
  }
  return BitsToF32(sign | (e + 127 - Fmt::kBias) << 23 | m << (23 - Fmt::kMant));
}
static inline float ToF32(F8E4M3 x) { return F8ToF32<F8E4M3>(x.bits); }
static inline float ToF32(F8E5M2 x) { return F8ToF32<F8E5M2>(x.bits); }

// 8 values as f32. With F16C both formats widen through f16 in hardware (subnormals
// included): e5m2 is an f16's top byte; e4m3's 7 bits below the sign placed under f16's
// exponent read as the value / 256 (the biases differ by 8; a subnormal the same way), and
// its NaN (bits 1111111) gets f16's all-ones exponent. (The byte sign-extended and shifted by
// 7 puts the sign in bit 15 and copies of it in bit 14, which the mask clears.)
static inline v8 Load8(const F8E4M3* p) {
#ifdef __F16C__
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
  const __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x3F80));
  h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x3F80)),
                                    _mm_set1_epi16(0x7C00)));
  return (v8)_mm256_cvtph_ps(h) * 256.f;
#else
  v8 x;
  for (int i = 0; i < 8; ++i) x[i] = ToF32(p[i]);
  return x;
#endif
}
static inline v8 Load8(const F8E5M2* p) {
#ifdef __F16C__
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (v8)_mm256_cvtph_ps(_mm_slli_epi16(b, 8));
#else
  v8 x;
  for (int i = 0; i < 8; ++i) x[i] = ToF32(p[i]);
  return x;
#endif
}

// 8 f32 values to float8 bits, lane-wise and branch-free: a NaN to the format's NaN, beyond
// the largest finite value (inf included) to it, below the smallest normal to the nearest
// multiple of the smallest subnormal (adding 2^23 leaves the multiple in the low bits,
// rounded to nearest even by the add), else the mantissa rounded to nearest even on the bits
// (a carry into the exponent is the right result), rebiased.
template <typename F>
static inline void StoreF8(v8 x, uint8_t* p) {
  using Fmt = F8Format<F>;
  constexpr int kShift = 23 - Fmt::kMant;
  v8i u;
  std::memcpy(&u, &x, sizeof u);
  const v8i sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
  const int32_t max_f32 = ((Fmt::kMaxBits >> Fmt::kMant) - Fmt::kBias + 127) << 23 |
                          (Fmt::kMaxBits & ((1 << Fmt::kMant) - 1)) << kShift;
  const v8i c = a > max_f32 ? v8i{} + max_f32 : a;  // saturated (not NaN: selected below)
  v8i normal = (c + ((1 << (kShift - 1)) - 1) + ((c >> kShift) & 1)) >> kShift;
  normal -= (127 - Fmt::kBias) << Fmt::kMant;
  v8 mag;
  std::memcpy(&mag, &c, sizeof mag);
  const v8 scaled = mag * std::ldexp(1.f, Fmt::kBias - 1 + Fmt::kMant) + 8388608.f;
  v8i sub;
  std::memcpy(&sub, &scaled, sizeof sub);
  sub -= 0x4B000000;  // the bits of 2^23
  v8i r = c < (128 - Fmt::kBias) << 23 ? sub : normal;
  r = a > 0x7F800000 ? v8i{} + Fmt::kNaNBits : r;
  r |= sign;
  typedef uint8_t v8u8 __attribute__((vector_size(8)));
  const v8u8 bytes = __builtin_convertvector(r, v8u8);
  std::memcpy(p, &bytes, sizeof bytes);
}
static inline void Store8(v8 x, F8E4M3* p) { StoreF8<F8E4M3>(x, &p->bits); }
static inline void Store8(v8 x, F8E5M2* p) { StoreF8<F8E5M2>(x, &p->bits); }
template <typename F>
static inline void StoreF8Scalar(float x, F* p) {  // a row's tail, through one lane
  uint8_t b[8];
  StoreF8<F>(Splat8(x), b);
  p->bits = b[0];
}
static inline void Store(float x, F8E4M3* p) { StoreF8Scalar(x, p); }
static inline void Store(float x, F8E5M2* p) { StoreF8Scalar(x, p); }
