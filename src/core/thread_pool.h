// A small fork-join pool for the kernels. The calling thread takes part in the work. A call
// made while the pool is already busy (from another thread, e.g. the gate thread, or nested
// inside a task) runs inline on the caller, so the pool never deadlocks and never races.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ptllm {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // total threads including the caller; >= 1
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(task) for every task in [0, tasks); returns when all have run.
  void run(int tasks, const std::function<void(int)>& fn);

  // fn(begin, end) over [0, n) in about size() contiguous chunks of at least `grain` items.
  void parallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void workerLoop();
  void drain(const std::function<void(int)>& fn, int tasks);

  std::vector<std::thread> workers_;
  std::mutex callMutex_;  // one parallel call at a time
  std::mutex mu_;
  std::condition_variable wake_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int)>* job_ = nullptr;
  int tasks_ = 0;
  int active_ = 0;  // workers inside drain() for the current job
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
};

// The process-wide pool the kernels use. setThreads() replaces it (not while kernels run).
ThreadPool& pool();
void setThreads(int threads);  // <= 0: hardware concurrency
int threadCount();

}  // namespace ptllm
