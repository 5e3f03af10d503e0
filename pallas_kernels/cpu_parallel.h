// ParallelFor over XLA's intra-op thread pool, shared by the native CPU kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

// Runs work(first, claim) on the caller and on up to n - 1 of the pool's threads, then waits until
// n tasks are done: first is a task the thread claimed, claim() claims another (>= n: none left),
// and work returns how many tasks it ran. A worker that starts late and claims nothing leaves
// without touching work, which may be gone by then.
template <typename Work>
static void RunTasks(xla::ffi::ThreadPool& pool, int64_t n, const Work& work) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto run = [st, n, &work] {
    const int64_t first = st->next.fetch_add(1);
    if (first >= n) return;
    const int64_t mine = work(first, [&] { return st->next.fetch_add(1); });
    if (st->done.fetch_add(mine) + mine == n) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->cv.notify_all();
    }
  };
  const int64_t workers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}

// Runs body(0..n-1) on the caller and the pool's threads; returns when all are done. Tasks are
// claimed from a counter, so a worker that starts late finds nothing left and leaves.
template <typename Body>
static void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Body& body) {
  RunTasks(pool, n, [&](int64_t i, const auto& claim) {
    int64_t mine = 0;
    for (; i < n; i = claim(), ++mine) body(i);
    return mine;
  });
}

// ParallelFor whose body(i, next) also learns the task its thread runs after i (-1: none), claimed
// one ahead, so that it can prefetch that task's data while it runs this one.
template <typename Body>
static void ParallelForAhead(xla::ffi::ThreadPool& pool, int64_t n, const Body& body) {
  RunTasks(pool, n, [&](int64_t i, const auto& claim) {
    int64_t mine = 0;
    for (int64_t next; i < n; i = next, ++mine) {
      next = claim();
      body(i, next < n ? next : -1);
    }
    return mine;
  });
}
