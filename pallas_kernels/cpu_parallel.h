// ParallelFor over XLA's intra-op thread pool, shared by the native CPU kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

// Runs body(0..n-1) on the caller and the pool's threads; returns when all are done. Tasks are
// claimed from a counter, so a worker that starts late finds nothing left and leaves.
template <typename Body>
static void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Body& body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto work = [st, n, &body] {
    int64_t mine = 0;
    for (int64_t i; (i = st->next.fetch_add(1)) < n; ++mine) body(i);
    if (mine && st->done.fetch_add(mine) + mine == n) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->cv.notify_all();
    }
  };
  const int64_t workers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t w = 0; w < workers; ++w) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}
