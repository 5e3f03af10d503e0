// The plain random draw for XLA:CPU, called through the XLA FFI: per row of f32 logits, the token
// `reference.draw` defines (greedy rows: the first maximum; random rows: temperature, min_p and
// an inverse-CDF draw over 64-token block masses driven by the row's uniform). XLA:CPU ran the
// same passes at ~1.5 ns an element (3.2 ms of a 64-row step over a 32000 vocabulary: the max,
// the exps and the masses as separate fused loops over [8, V], eight times); here a row is two
// passes in cache.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace ffi = xla::ffi;

#ifdef __AVX512F__
using Vec = v16;
#else
using Vec = v8;
#endif
constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);
constexpr int64_t kBlock = 64;  // tokens per block mass, as the XLA sampler's

static inline Vec LoadV(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exp(x) of x <= 0; 0 below -87, where ExpV saturates (exact exp is below 1.7e-38 there: no draw
// can land on such a token beside the maximum's 1).
static inline Vec Exp0(Vec x) { return x < -87.f ? Vec{} : ExpV(x); }
static inline float Exp0(float x) {
  Vec v = Vec{} + x;
  return Exp0(v)[0];
}

static float RowMax(const float* x, int64_t n) {
  Vec mv = Vec{} - INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec v = LoadV(x + j);
    mv = v > mv ? v : mv;
  }
  float best = -INFINITY;
  for (int64_t l = 0; l < kLanes; ++l) best = std::max(best, mv[l]);
  for (; j < n; ++j) best = std::max(best, x[j]);
  return best;
}

// The first index of the row's maximum.
static int32_t FirstMax(const float* x, int64_t n) {
  const float best = RowMax(x, n);
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == best) return static_cast<int32_t>(j);
  return 0;
}

// sum of exp(x[j] * inv - m) over x[j] * inv >= tau, j < n (n <= kBlock).
static float BlockMass(const float* x, int64_t n, float inv, float m, float tau) {
  Vec acc{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec s = LoadV(x + j) * inv;
    acc += s >= tau ? Exp0(s - m) : Vec{};
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  for (; j < n; ++j) {
    const float s = x[j] * inv;
    sum += s >= tau ? Exp0(s - m) : 0.f;
  }
  return sum;
}

// The first of n weights (w(i) >= 0) whose running sum exceeds target, never one of weight 0;
// if rounding leaves none, the last positive one (-1: none). before: the sum of the weights
// ahead of it.
template <typename W>
static int64_t FirstAbove(int64_t n, const W& w, float target, float* before) {
  float run = 0.f;
  int64_t last = -1;
  float before_last = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w(i);
    if (wi > 0.f) {
      if (run + wi > target) {
        *before = run;
        return i;
      }
      last = i, before_last = run;
    }
    run += wi;
  }
  *before = before_last;
  return last;
}

static int32_t Draw(const float* x, int64_t n, float temperature, float min_p, float u,
                    std::vector<float>& mass) {
  const float inv = 1.f / temperature;
  const float m = RowMax(x, n) * inv;  // the maximum of x * inv: scaling is monotone
  const float tau = m + std::log(min_p);  // min_p 0: -inf, every token
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  mass.resize(blocks);
  float z = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    mass[b] = BlockMass(x + b * kBlock, std::min(kBlock, n - b * kBlock), inv, m, tau);
    z += mass[b];
  }
  const float target = u * z;
  float before = 0.f;
  const int64_t b = FirstAbove(blocks, [&](int64_t i) { return mass[i]; }, target, &before);
  if (b < 0) return FirstMax(x, n);  // no mass (a NaN row): as greedy
  const float* xb = x + b * kBlock;
  float unused;
  const int64_t j = FirstAbove(std::min(kBlock, n - b * kBlock), [&](int64_t i) {
    const float s = xb[i] * inv;
    return s >= tau ? Exp0(s - m) : 0.f;
  }, target - before, &unused);
  return static_cast<int32_t>(b * kBlock + std::max<int64_t>(j, 0));
}

enum Mode : int32_t { kSkip = 0, kGreedy = 1, kRandom = 2 };

static ffi::Error DrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                           ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::F32> min_p,
                           ffi::Buffer<ffi::F32> uniforms, ffi::Buffer<ffi::S32> mode,
                           ffi::ResultBuffer<ffi::S32> out) {
  auto d = logits.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("draw: logits must be [N, V]");
  const int64_t N = d[0], V = d[1];
  for (int64_t c : {temperature.element_count(), min_p.element_count(), uniforms.element_count(),
                    mode.element_count(), out->element_count()})
    if (c != N) return ffi::Error::InvalidArgument("draw: every per-row operand must be [N]");
  const float* x = logits.typed_data();
  const int32_t* md = mode.typed_data();
  int32_t* tokens = out->typed_data();
  // Tasks of 4 rows: a row is ~10 us at V = 32000, the pool's hand-off ~1-2 us.
  constexpr int64_t kRows = 4;
  ParallelFor(pool, (N + kRows - 1) / kRows, [&](int64_t t) {
    thread_local std::vector<float> mass;
    for (int64_t r = t * kRows; r < std::min(N, t * kRows + kRows); ++r) {
      const float* row = x + r * V;
      tokens[r] = md[r] == kGreedy   ? FirstMax(row, V)
                  : md[r] == kRandom ? Draw(row, V, temperature.typed_data()[r],
                                            min_p.typed_data()[r], uniforms.typed_data()[r], mass)
                                     : 0;
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDraw, DrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [N, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // uniforms [N], in [0, 1)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // mode [N]: 0 skip, 1, 2
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens [N]
