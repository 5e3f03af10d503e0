// Part of kernel_cpu.cc, included after kernel_cpu_core.h: the matmul on quantized weights,
// y = x @ ((q - zero) * scale), q int8 or int4 with f32 scales (and zero points) per group of
// K / G consecutive inputs and output column.
//
// Layout (`pack_quantized` in kernel_cpu.py): the columns in strips of 16 (the last padded),
// each a run of 32-byte loads: int8 rows 2p and 2p + 1 (K padded to pairs); int4 rows 4b to
// 4b + 3 (K padded to fours), byte 2j + t holding row 4b + t of column j in its low nibble and
// row 4b + 2 + t in its high one, each plus 8 (the bf16 dot product's operand order: a table
// lookup a nibble). The strips are stored in groups (`kGroup`), the group's loads side by side;
// scales and zero points [G, 16] f32 per strip.
//
// Every element is one fixed chain, whatever M and whichever path runs it (batch invariance,
// issue 26): per group g, p = the products x[k] q[k, n] summed down the group from zero (fused
// multiply-adds in k order, or, bf16 x with AVX512_BF16, vdpbf16ps in pair order: q is exact in
// bf16), t = p - zero * xs (xs: the row's sum of x over the group, in one order per row), and
// acc = fma(scale, t, acc) from acc = 0. Up to kQStreamRows rows (`QStream`) widen the strips in
// registers as they stream them (1 or 1/2 byte a weight from memory), more rows (`QGemm`) widen
// a tile of strips once into a scratch and run every panel of rows against it.
#ifndef JAXLLM_MATMUL_KERNEL_CPU_QUANT_H_
#define JAXLLM_MATMUL_KERNEL_CPU_QUANT_H_

#include "matmul/kernel_cpu_quant_sched.h"  // QAhead, QRuns, WithRows
#include "matmul/kernel_cpu_quant_vec.h"    // F16, QRow, BfPair, WidenStrip

// One layer's packed quantized weights.
struct QLayer {
  const void* q = nullptr;
  const void* after = nullptr;   // the next layer's q (none: the last layer)
  int64_t group = 0;             // bytes of a group of strips (`RawStrip`)
  const float* scale = nullptr;  // [S, G, 16]
  const float* zero = nullptr;   // [S, G, 16], or none (symmetric)
  int64_t P = 0, G = 1, gp = 0;  // pairs of K, groups, pairs per group
};

// What a chain reads and writes for one strip: its q (packed, or widened in a tile), its
// scales and zero points, its results (rows ldy apart) and how many of its columns to store.
struct QStrip {
  const void* q;
  const float* s;
  const float* z;
  float* y;
  int64_t cols;
};

// Packed strips are stored in groups, the group's loads side by side, and a streaming task reads
// a group: one sequential run (strip after strip, a task read several short runs 32 bytes at a
// time, which the hardware fetched ahead too slowly). Groups of 2 int8 strips, 4 int4 ones: a
// line or two a load, and few enough bytes to stay in L1 from a panel of rows to the next (4
// int8 strips of a 576-input projection did not).
template <typename Q>
constexpr int64_t kGroup = std::is_same_v<Q, uint8_t> ? 4 : 2;
constexpr int64_t kQLoad = 32;  // values of a load

// xs[r * G + g]: row r's sum of x over group g (gs values), in one order: 8 lanes down the
// group, the lanes in turn, then the values past the last 8.
template <typename T>
static void GroupSums(const T* x, int64_t ldx, int64_t M, int64_t G, int64_t gs, float* xs) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const T* a = x + r * ldx + g * gs;
      v8 lanes = {};
      int64_t k = 0;
      for (; k + 8 <= gs; k += 8) lanes += Load8(a + k);
      float sum = 0.f;
      for (int i = 0; i < 8; ++i) sum += lanes[i];
      for (; k < gs; ++k) sum += ToF32(a[k]);
      xs[r * G + g] = sum;
    }
}

// Strips side by side in a streaming chain block: enough chains to cover the FMA or dot-product
// latency with few rows, within the registers (AVX2: 16, F16 two of them); rows of a streaming
// panel (kQFewRows) and of a register block of the many-row path (kQMr, by kQU strips).
#ifdef __AVX512F__
template <int R>
constexpr int kQStreamU = R <= 4 ? 4 : 2;
constexpr int kQFewRows = 8, kQMr = 6, kQU = 2;
#else
template <int R>
constexpr int kQStreamU = R == 1 ? 4 : R == 2 ? 2 : 1;
constexpr int kQFewRows = 4, kQMr = 4, kQU = 1;
#endif
// Up to this many rows stream the strips, widened in registers again for each panel, rather
// than widened once into a tile (`QGemm`): the widening fills the dot products' idle issue slots
// (as fast or faster, measured, up to here; AVX2's f32 FMAs leave fewer to int4's unpacking).
#ifdef __AVX512F__
constexpr int64_t kQStreamRows = 128;
#else
constexpr int64_t kQStreamRows = 16;
#endif

// The panels of rows [m0, m0 + m), near-equal: when they stream (M <= kQStreamRows), all M rows
// in panels of at most kQFewRows, else a chunk of ForTiles (kMc rows) in panels of at most kQMr
// (8 rows: 4 and 4, not 6 and 2, whose 4 chains wait on the dot product's latency).
struct QPanels {
  int64_t m0, m, n;
  QPanels(int64_t m0, int64_t m, int64_t M)
      : m0(m0), m(m), n(M <= kQStreamRows ? (m + kQFewRows - 1) / kQFewRows
                                          : (m + kQMr - 1) / kQMr) {}
  int64_t Start(int64_t j) const { return m0 + j * m / n; }
};

// Rows [0, M) of x (K values a row, T: f32 or bf16 bits) as the chains read them, in the panels
// of `QPanels`: a panel of R rows [P][R][2] in X (f32, or bf16 bits with kBf), each row's pair p
// next to the other rows' (one pointer for all of a panel's rows), zero past K (to P pairs: the
// weights' padded rows).
template <typename X, typename T>
static void Panels(ffi::ThreadPool& pool, const T* x, int64_t M, int64_t K, int64_t P, X* out) {
  const int64_t chunk = M <= kQStreamRows ? M : kMc;  // as the paths split the rows
  ParallelFor(pool, (M + chunk - 1) / chunk, [&](int64_t c) {
    const QPanels panels(c * chunk, std::min(chunk, M - c * chunk), M);
    for (int64_t j = 0; j < panels.n; ++j) {
      const int64_t r0 = panels.Start(j);
      WithRows<8>(panels.Start(j + 1) - r0, [&](auto R) {
        X* panel = out + r0 * 2 * P;
        const T* rows = x + r0 * K;
        for (int64_t i = 0; i < K / 2; ++i)  // whole pairs: a copy (or widening) a pair
          for (int r = 0; r < R; ++r) {
            X* to = panel + (i * R + r) * 2;
            const T* from = rows + r * K + 2 * i;
            if constexpr (std::is_same_v<X, T>) std::memcpy(to, from, 2 * sizeof(X));
            else to[0] = ToF32(from[0]), to[1] = ToF32(from[1]);
          }
        for (int64_t k = K / 2 * 2; k < 2 * P; ++k)  // an odd K's last value, then zeros
          for (int r = 0; r < R; ++r) {
            X v = 0;
            if (k < K) {
              if constexpr (std::is_same_v<X, T>) v = rows[r * K + k];
              else v = ToF32(rows[r * K + k]);
            }
            panel[(k / 2 * R + r) * 2 + k % 2] = v;
          }
      });
    }
  });
}

// The chains of a panel's R rows (xp, `Panels`) against U strips of Q (int8_t, uint8_t packed;
// float, uint16_t widened), into st[u].y + r * ldy; xs: the rows' group sums (G apart; unread
// without zero points). Not inlined: inlined into the tile loop, GCC ran out of registers for
// its counters and kept them in memory.
template <bool kBf, typename Q, int R, int U, typename X>
__attribute__((noinline)) static void QChains(const X* xp, const float* xs, const QStrip* st,
                                              int64_t ldy, const QLayer& w, const QAhead& ahead) {
  constexpr int kPairs = kPairsPer<Q>;  // pairs a load of 32 values holds
  // Values from a load to the next: packed strips are stored in groups, widened ones alone.
  constexpr int64_t kStep = sizeof(Q) == 1 ? kGroup<Q> * kQLoad : kQLoad;
  const Q* q[U];
  for (int u = 0; u < U; ++u) q[u] = static_cast<const Q*>(st[u].q);
  const bool zero = st[0].z != nullptr;
  // The totals across groups in memory (touched once a group): in registers beside the sums,
  // GCC spilled the strips' operands in the inner loop instead.
  alignas(64) float acc[R][U][kNr];
  // A strip's scales (and zero points) are short runs of lines that the hardware does not fetch
  // ahead: each group's from memory would stall its chains' end, so fetch them 4 groups ahead.
  auto fetch_scales = [&](int64_t g) {
    if (g < w.G)
      for (int u = 0; u < U; ++u) {
        QAhead::Fetch(reinterpret_cast<const char*>(st[u].s + g * kNr));
        if (zero) QAhead::Fetch(reinterpret_cast<const char*>(st[u].z + g * kNr));
      }
  };
  for (int64_t g = 0; g < 4; ++g) fetch_scales(g);
  for (int64_t g = 0; g < w.G; ++g) {
    fetch_scales(g + 4);
    F16 p[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) p[r][u] = F16Zero();
    const int64_t end = std::min(w.P, (g + 1) * w.gp);
    for (int64_t i0 = g * w.gp; i0 < end; i0 += 32) {  // the fetches ahead out of the inner loop
      ahead.At(i0, 32);
      for (int64_t i = i0; i < std::min(end, i0 + 32); i += kPairs) {
        const int64_t at = i / kPairs * kStep;
#ifdef JAXLLM_DPBF16
        if constexpr (kBf) {  // the strips widened first: each row's broadcast serves them all
          Unroll<kPairs>([&](auto t) {
            __m512bh b[U];
            for (int u = 0; u < U; ++u) b[u] = BfPair<t>(q[u] + at);
            for (int r = 0; r < R; ++r) {
              uint32_t pair;
              std::memcpy(&pair, xp + ((i + t) * R + r) * 2, sizeof pair);
              const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
              for (int u = 0; u < U; ++u) p[r][u].v = _mm512_dpbf16_ps(p[r][u].v, xv, b[u]);
            }
          });
          continue;
        }
#endif
        if constexpr (!kBf)  // a strip at a time: few registers for its rows (AVX2)
          for (int u = 0; u < U; ++u)
            Unroll<kPairs>([&](auto t) {
              const F16 w0 = QRow<2 * t>(q[u] + at), w1 = QRow<2 * t + 1>(q[u] + at);
              const X* xi = xp + (i + t) * R * 2;
              for (int r = 0; r < R; ++r)
                p[r][u] = F16Fma(F16Splat(xi[2 * r + 1]), w1,
                                 F16Fma(F16Splat(xi[2 * r]), w0, p[r][u]));
            });
      }
    }
    // acc = fma(scale, p - zero * xs, acc): unrolled, one form per kind of weights.
    auto finish = [&](auto zeros) __attribute__((always_inline)) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const F16 s = F16Load(st[u].s + g * kNr);
        const F16 z = zeros ? F16Load(st[u].z + g * kNr) : F16Zero();
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const F16 t = zeros ? F16Fnma(z, F16Splat(xs[r * w.G + g]), p[r][u]) : p[r][u];
          F16Store(F16Fma(s, t, g ? F16Load(acc[r][u]) : F16Zero()), acc[r][u]);
        }
      }
    };
    if (zero) finish(std::true_type{});
    else finish(std::false_type{});
    asm volatile("" : : "r"(acc) : "memory");  // keeps acc there
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) std::memcpy(st[u].y + r * ldy, acc[r][u], 4 * st[u].cols);
}

// The weights a chain reads: q widened (f32 rows, or bf16 pairs) or as packed.
template <bool kBf>
using QTile = std::conditional_t<kBf, uint16_t, float>;

template <typename Q>
static inline const Q* RawStrip(const QLayer& w, int64_t s) {
  return static_cast<const Q*>(w.q) + s / kGroup<Q> * w.group + s % kGroup<Q> * kQLoad;
}

// Strip s of the layer, its q at `q`, its results into y (cols of its columns).
static inline QStrip StripOf(const QLayer& w, const void* q, int64_t s, float* y, int64_t cols) {
  const int64_t sg = s * w.G * kNr;
  return {q, w.scale + sg, w.zero != nullptr ? w.zero + sg : nullptr, y, cols};
}

// Runs chains of up to U strips on the b strips at st (b <= U, b = U, 2 or 1).
template <bool kBf, typename Q, int R, int U, typename X>
static inline void QChainsOf(int64_t b, const X* xp, const float* xs, const QStrip* st,
                             int64_t ldy, const QLayer& w, const QAhead& ahead) {
  if (b == U) return QChains<kBf, Q, R, U>(xp, xs, st, ldy, w, ahead);
  if constexpr (U > 2)
    if (b == 2) return QChains<kBf, Q, R, 2>(xp, xs, st, ldy, w, ahead);
  QChains<kBf, Q, R, 1>(xp, xs, st, ldy, w, ahead);
}

// Few rows (panels of R0 rows, R0 - 1 for some): tasks of a group of strips (and, gated, their
// up strips after it), widened in registers as they stream, U strips at a time, each panel in
// turn (the strips in cache for all but the first), written in place (f32) or finished from
// the task's scratch; a run of them a thread (`QRuns`). With several panels a task fetches the
// next one's strips; the last task of a thread's share fetches the share's first in the next
// layer (the engine's next call on these weights, a layer on), which otherwise starts every
// call waiting on memory.
template <bool kBf, typename Q, int R0, typename X>
static void QStream(ffi::ThreadPool& pool, const X* xp, const float* xs, int64_t M, int64_t N,
                    const QLayer& w, const Out& out) {
  constexpr int U = kQStreamU<R0>;
  const int64_t n = out.gated ? N / 2 : N, strips = (n + kNr - 1) / kNr;
  const int64_t threads = pool.num_threads();
  const QPanels panels(0, M, M);
  // Tasks of a group of strips, one sequential read that stays in L1 from a panel to the next
  // (as many as make equal shares), then of 2 strips.
  const int64_t tb = kGroup<Q>;
  int64_t full = strips / tb;
  if (full > threads) full -= full % threads;
  const int64_t tasks = full + (strips - full * tb + 1) / 2;
  auto first = [&](int64_t t) { return t < full ? t * tb : full * tb + (t - full) * 2; };
  auto size = [&](int64_t t) { return std::min<int64_t>(t < full ? tb : 2, strips - first(t)); };
  const bool direct = out.y != nullptr && !out.gated;
  QRuns(pool, tasks, [&](int64_t t, int64_t next, int64_t run, int64_t end) {
    const int64_t s0 = first(t), B = size(t);
    const int64_t c0 = s0 * kNr, cols = std::min(B * kNr, n - c0);
    thread_local std::vector<float> scratch(kQStreamRows * 2 * kTile);  // as `Out::Rows`'
    float* y = direct ? out.y + c0 : scratch.data();  // (gated: up columns from kTile)
    const int64_t ldy = direct ? N : 2 * kTile;
    auto run_on = [&](int64_t s, float* ys) {  // strips [s, s + B) into ys
      // The next task's strips, or for a run's last task, the run's first in the next layer
      // (same strips, the layer after).
      QAhead ahead;
      if (next >= 0 && panels.n > 1)
        ahead = QAhead::Of(RawStrip<Q>(w, first(next) + s - s0), w.group, w.P);
      else if (t + 1 == end && w.after != nullptr)
        ahead = QAhead::Of(static_cast<const Q*>(w.after) +
                               (RawStrip<Q>(w, first(run) + s - s0) - RawStrip<Q>(w, 0)),
                           w.group, w.P);
      for (int64_t j = 0; j < panels.n; ++j)
        for (int64_t u0 = 0; u0 < B; u0 += U) {
          const int64_t r0 = panels.Start(j), b = std::min<int64_t>(U, B - u0);
          QStrip st[U];
          for (int64_t u = 0; u < b; ++u) {
            const int64_t at = s + u0 + u;
            st[u] = StripOf(w, RawStrip<Q>(w, at), at, ys + r0 * ldy + (u0 + u) * kNr,
                            std::min(kNr, N - at * kNr));
          }
          WithRows<kQFewRows>(panels.Start(j + 1) - r0, [&](auto R) {
            QChainsOf<kBf, Q, R, U>(b, xp + r0 * 2 * w.P, xs + r0 * w.G, st, ldy, w,
                                    j || u0 ? QAhead{} : ahead);
          });
        }
    };
    run_on(s0, y);
    if (out.gated) run_on(n / kNr + s0, y + kTile);
    if (!direct) out.Finish({scratch.data(), ldy}, 0, M, c0, cols);
  });
}

// Many rows: ForTiles' tiles of strips (and, gated, their up strips), widened once per task into
// a thread's scratch, then each panel of rows against kQU of them at a time.
template <bool kBf, typename Q, typename X>
static void QGemm(ffi::ThreadPool& pool, const X* panels_x, const float* xs, int64_t M,
                  int64_t N, const QLayer& w, const Out& out) {
  using T = QTile<kBf>;
  const int64_t wide = 32 * w.P;  // values of a widened strip
  const int64_t n = out.gated ? N / 2 : N, up = n / kNr;
  // ForTiles' prefetch pointer, 1 byte a column past q, tells the next tile's first column.
  ForTiles(pool, M, n, w.q, 1, [&](int64_t c0, int64_t cols) {
    const int64_t strips = (cols + kNr - 1) / kNr, total = out.gated ? 2 * strips : strips;
    auto strip = [=](int64_t t) { return c0 / kNr + (t < strips ? t : up + t - strips); };
    thread_local std::vector<T> tile;
    tile.resize(total * wide);
    for (int64_t t = 0; t < total; ++t)
      WidenStrip<kBf>(RawStrip<Q>(w, strip(t)), kGroup<Q> * kQLoad, w.P, &tile[t * wide]);
    const T* widened = tile.data();
    return [=, &out, &w](int64_t m0, int64_t m, Prefetch pf) {
      const auto [yr, ldy] = out.Rows(m0, c0);
      // The next tile's groups of strips (gated, their up strips' too), spread over this tile's
      // chains.
      const QPanels panels(m0, m, M);
      const int64_t calls = (total + kQU - 1) / kQU * panels.n;
      const int64_t next = (pf.p - static_cast<const char*>(w.q)) / kNr;  // its first strip
      const QAhead ahead = pf.p == nullptr ? QAhead{} : QAhead::Of(
          RawStrip<Q>(w, next / kGroup<Q> * kGroup<Q>), (strips + 3) / kGroup<Q> * w.group,
          calls * w.P, out.gated ? (up + next) / kGroup<Q> * w.group - next / kGroup<Q> * w.group
                                 : 0);
      int64_t call = 0;
      for (int64_t t0 = 0; t0 < total; t0 += kQU) {
        const int64_t U = std::min<int64_t>(kQU, total - t0);
        QStrip st[kQU];
        for (int64_t u = 0; u < U; ++u) {
          const int64_t t = t0 + u;
          st[u] = StripOf(w, widened + t * wide, strip(t),
                          yr + (t < strips ? t * kNr : kTile + (t - strips) * kNr),
                          std::min(kNr, N - strip(t) * kNr));
        }
        for (int64_t j = 0; j < panels.n; ++j) {
          const int64_t r = panels.Start(j) - m0;
          QStrip sr[kQU];
          for (int64_t u = 0; u < U; ++u) sr[u] = st[u], sr[u].y += r * ldy;
          const X* xp = panels_x + (m0 + r) * 2 * w.P;
          const float* xsr = xs + (m0 + r) * w.G;
          WithRows<kQMr>(panels.Start(j + 1) - m0 - r, [&](auto R) {
            const QAhead share = ahead.Share(call++, w.P);
            if (U == kQU) QChains<kBf, T, R, kQU>(xp, xsr, sr, ldy, w, share);
            else QChains<kBf, T, R, 1>(xp, xsr, sr, ldy, w, share);
          });
        }
      }
      out.Finish({yr, ldy}, m0, m, c0, cols);
    };
  });
}

// Rows [0, M) of x, in panels (`Panels`), against the layer's N columns into out: streaming or
// blocked (the same bits), gated in the tile where the gate ends on a strip boundary, else
// through a temporary.
template <bool kBf, typename Q, typename X>
static void QRowsThrough(ffi::ThreadPool& pool, const X* panels, const float* xs, int64_t M,
                         int64_t N, const QLayer& w, const Out& out) {
  if (out.gated && N / 2 % kNr != 0)
    return Ungated(pool, M, N, out, [&](const Out& o) {
      QRowsThrough<kBf, Q>(pool, panels, xs, M, N, w, o);
    });
  if (M > kQStreamRows) return QGemm<kBf, Q>(pool, panels, xs, M, N, w, out);
  WithRows<kQFewRows>(QPanels(0, M, M).Start(1), [&](auto R) {
    QStream<kBf, Q, R>(pool, panels, xs, M, N, w, out);
  });
}

#endif  // JAXLLM_MATMUL_KERNEL_CPU_QUANT_H_
