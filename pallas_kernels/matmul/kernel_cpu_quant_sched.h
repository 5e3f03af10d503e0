// Part of kernel_cpu_quant.h: how the quantized matmul's work is spread and fetched ahead: a
// run of tasks per thread (`QRuns`), the weights a thread reads next fetched into L2 while it
// computes (`QAhead`), and row counts as template arguments (`WithRows`).
#ifndef JAXLLM_MATMUL_KERNEL_CPU_QUANT_SCHED_H_
#define JAXLLM_MATMUL_KERNEL_CPU_QUANT_SCHED_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"

// The weights a thread reads next (its next task's strips, or tile), fetched into L2 a few lines
// each pair step of the chains before them: a task's first pass over its weights otherwise waits
// on memory (as `Prefetch` does for the bf16 strips).
struct QAhead {
  const char* p = nullptr;
  int64_t lines = 0, step = 0;  // lines in all, per pair step
  int64_t also = 0;             // bytes past p to as many lines more (gated: the up strips)

  // `bytes` at p over `steps` pair steps.
  static QAhead Of(const void* p, int64_t bytes, int64_t steps, int64_t also = 0) {
    const int64_t lines = (bytes + 63) / 64;
    return {static_cast<const char*>(p), lines, (lines + steps - 1) / std::max<int64_t>(steps, 1),
            also};
  }
  // The share of call c of chains of P pair steps each.
  QAhead Share(int64_t c, int64_t P) const {
    const int64_t skip = std::min(lines, c * P * step);
    return {p + 64 * skip, lines - skip, step, also};
  }
  // The lines of pair steps [i, i + n).
  inline void At(int64_t i, int64_t n) const {
    for (int64_t j = i * step; j < std::min(lines, (i + n) * step); ++j) {
      Fetch(p + 64 * j);
      if (also) Fetch(p + also + 64 * j);
    }
  }
  // As __builtin_prefetch(a, 0, 2), which GCC deleted from these loops as having no effect.
  // (An address operand, not a memory one: that would make the compiler store the chains
  // before every prefetch.)
  static inline void Fetch(const char* a) { asm volatile("prefetcht1 (%0)" : : "r"(a)); }
};

// f(integral_constant<R>) for R = n in [1, kMax].
template <int kMax, typename F>
static inline void WithRows(int64_t n, const F& f) {
  static_assert(kMax <= 8, "the cases below");
  switch (n) {
    case 8: if constexpr (kMax >= 8) f(std::integral_constant<int, 8>{}); break;
    case 7: if constexpr (kMax >= 7) f(std::integral_constant<int, 7>{}); break;
    case 6: if constexpr (kMax >= 6) f(std::integral_constant<int, 6>{}); break;
    case 5: if constexpr (kMax >= 5) f(std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (kMax >= 4) f(std::integral_constant<int, 4>{}); break;
    case 3: if constexpr (kMax >= 3) f(std::integral_constant<int, 3>{}); break;
    case 2: if constexpr (kMax >= 2) f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// Runs body(t, next, first, end) for the tasks t in [0, n) on the caller and the pool's threads,
// each thread a run of consecutive tasks in order (its weights one sequential read: tasks
// claimed in turn from one counter gave each thread a new run every task, which the hardware
// fetches ahead of late), first its own share, then the back half of what another has left
// (all of it, in order, when that thread has not started or is descheduled). next: the task
// the thread runs after t (-1: none of its run left); [first, end): the share t was in.
template <typename Body>
static void QRuns(xla::ffi::ThreadPool& pool, int64_t n, const Body& body) {
  const int64_t runs = std::min<int64_t>(pool.num_threads(), n);
  // Run r: tasks [front, back) packed in one word (a cache line each), its thread taking from
  // the front, others splitting off the back.
  struct alignas(64) Left {
    std::atomic<uint64_t> v;
  };
  std::vector<Left> left(runs);
  auto pack = [](uint64_t front, uint64_t back) { return front << 32 | back; };
  for (int64_t r = 0; r < runs; ++r) left[r].v = pack(r * n / runs, (r + 1) * n / runs);
  auto next_of = [&](int64_t r) -> int64_t {  // the front task of run r, taken
    uint64_t v = left[r].v.load();
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xFFFFFFFF;
      if (f >= b) return -1;
      if (left[r].v.compare_exchange_weak(v, pack(f + 1, b))) return f;
    }
  };
  auto split = [&](int64_t from, int64_t to) {  // run from's back half moved to run to
    uint64_t v = left[from].v.load();
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xFFFFFFFF;
      if (f >= b) return false;
      const uint64_t mid = b - (b - f + 1) / 2;  // f when all of it
      if (left[from].v.compare_exchange_weak(v, pack(f, mid))) {
        left[to].v = pack(mid, b);
        return true;
      }
    }
  };
  auto share = [&](int64_t t) {  // the run t was first given to
    int64_t r = t * runs / n;
    while ((r + 1) * n / runs <= t) ++r;
    while (r * n / runs > t) --r;
    return r;
  };
  ParallelFor(pool, runs, [&](int64_t r) {
    for (;;) {
      for (int64_t t = next_of(r); t >= 0;) {
        const int64_t next = next_of(r), h = share(t);
        body(t, next, h * n / runs, (h + 1) * n / runs);
        t = next;
      }
      bool more = false;
      for (int64_t other = 1; other < runs && !more; ++other) more = split((r + other) % runs, r);
      if (!more) return;
    }
  });
}

#endif  // JAXLLM_MATMUL_KERNEL_CPU_QUANT_SCHED_H_
