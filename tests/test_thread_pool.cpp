// The kernel thread pool: every task runs exactly once, concurrent callers (the gate thread and
// the main thread) and nested calls run inline instead of deadlocking. Run under TSan in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace ptllm {
namespace {

TEST(ThreadPool, EveryTaskRunsOnce) {
  ThreadPool p(3);
  for (int tasks : {1, 2, 3, 7, 100}) {
    std::vector<std::atomic<int>> hits(tasks);
    for (auto& h : hits) h = 0;
    p.run(tasks, [&](int t) { hits[t]++; });
    for (int t = 0; t < tasks; ++t) EXPECT_EQ(hits[t], 1) << tasks;
  }
}

TEST(ThreadPool, ParallelForCoversTheRangeInDisjointChunks) {
  ThreadPool p(2);
  for (int64_t n : {1, 5, 1000, 12345}) {
    std::vector<int> seen(size_t(n), 0);
    p.parallelFor(n, 7, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) seen[size_t(i)]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[size_t(i)], 1) << n << " " << i;
  }
}

TEST(ThreadPool, ConcurrentAndNestedCallersDoNotDeadlock) {
  ThreadPool p(2);
  std::atomic<int64_t> total{0};
  auto work = [&] {
    for (int rep = 0; rep < 200; ++rep)
      p.parallelFor(64, 1, [&](int64_t b, int64_t e) {
        // Nested call: runs inline on this thread.
        p.parallelFor(e - b, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
      });
  };
  std::thread other(work);
  work();
  other.join();
  EXPECT_EQ(total.load(), 2 * 200 * 64);
}

TEST(ThreadPool, GlobalPoolCanBeResized) {
  setThreads(1);
  EXPECT_EQ(threadCount(), 1);
  setThreads(2);
  EXPECT_EQ(threadCount(), 2);
  setThreads(0);
  EXPECT_GE(threadCount(), 1);
}

}  // namespace
}  // namespace ptllm
