// Single-thread microbenchmark of the CPU matmul's register-blocked path (`BlockRows`, what
// `Gemm` runs per tile and chunk of rows) on f32 strips, without XLA or the thread pool: the
// thread's CPU time per call (best of the reps, 4 layers of weights in turn so they come from
// memory), GFLOP/s, and a checksum of y (equal checksums: equal sums). Build against a
// checkout's kernels, -DPACKED for one whose Gemm packs x (`PackPanels`, `ForEvenBlocks`):
//   g++ -O3 -march=native -fno-math-errno -fno-trapping-math -ffp-contract=fast -std=c++17 \
//     -I$(python -c 'import jax; print(jax.ffi.include_dir())') -I<checkout>/pallas_kernels \
//     [-DPACKED] scripts/bench_gemm_core.cc -o bench_gemm && ./bench_gemm 64 768 2304 30
#include "matmul/kernel_cpu_core.h"

#include <cstdio>
#include <ctime>
#include <random>

// Gemm's work for one layer, tiles x chunks as `ForTiles` runs them, on the calling thread.
// Not inlined into main, so that the kernel is compiled as in the library.
__attribute__((noinline)) static void Run(const float* x, int64_t M, int64_t K, int64_t N,
                                          const float* w, float* y, std::vector<float>& xp) {
#ifdef PACKED
  xp.resize(M * K);
  for (int64_t m0 = 0; m0 < M; m0 += kMc)
    ForEvenBlocks(std::min(kMc, M - m0), [&](int64_t r, auto R) {
      for (int64_t k = 0; k < K; ++k)
        for (int i = 0; i < R; ++i) xp[(m0 + r) * K + k * R + i] = x[(m0 + r + i) * K + k];
    });
  const float* xs = xp.data();
#else
  const float* xs = x;
#endif
  for (int64_t c0 = 0; c0 < N; c0 += kTile)
    for (int64_t m0 = 0; m0 < M; m0 += kMc) {
      Prefetch pf;
      BlockRows(xs + m0 * K, std::min(kMc, M - m0), K, w + c0 * K, std::min(kTile, N - c0),
                y + m0 * N + c0, N, pf);
    }
}

static double CpuNow() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 5) return std::fprintf(stderr, "usage: %s M K N reps\n", argv[0]), 2;
  const int64_t M = atol(argv[1]), K = atol(argv[2]), N = atol(argv[3]), reps = atol(argv[4]);
  const int64_t layers = 4, Np = (N + kNr - 1) / kNr * kNr;
  std::mt19937 g(0);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> w(layers * K * Np), x(M * K), y(M * N), xp;
  for (auto& v : w) v = d(g) * 0.05f;
  for (auto& v : x) v = d(g);
  double best = 1e9;
  for (int64_t rep = 0; rep < reps; ++rep) {
    const double t0 = CpuNow();
    for (int64_t l = 0; l < layers; ++l) Run(x.data(), M, K, N, w.data() + l * K * Np, y.data(), xp);
    best = std::min(best, (CpuNow() - t0) / layers);
  }
  double sum = 0;
  for (float v : y) sum += v;
  std::printf("M %ld K %ld N %ld: %.3f ms  %.1f GFLOP/s  checksum %.9g\n", M, K, N, best * 1e3,
              2.0 * M * K * N / best / 1e9, sum);
}
