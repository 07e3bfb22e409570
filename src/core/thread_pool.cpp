#include "core/thread_pool.h"

#include <algorithm>
#include <memory>

#include "core/error.h"

namespace ptllm {

namespace {
thread_local bool tInsideTask = false;

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waits for `done()`: spins briefly (the common case is a few microseconds), then yields the
// core so that a descheduled worker on an oversubscribed machine can finish its task.
template <typename Pred>
void spinThenYield(Pred done) {
  for (int i = 0; !done(); ++i) {
    if (i < 256)
      cpuRelax();
    else
      std::this_thread::yield();
  }
}
}  // namespace

ThreadPool::ThreadPool(int threads) {
  PTLLM_ASSERT(threads >= 1, "thread count {}", threads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { workerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain(const std::function<void(int)>& fn, int tasks) {
  for (int t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
    fn(t);
    done_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::workerLoop() {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    int tasks = 0;
    {
      // Spin briefly (kernels are called back to back), then sleep.
      std::unique_lock<std::mutex> lk(mu_);
      for (int i = 0; i < 200 && !stop_ && generation_ == seen; ++i) {
        lk.unlock();
        if (i < 100)
          cpuRelax();
        else
          std::this_thread::yield();
        lk.lock();
      }
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;  // null when the call already finished without us
      tasks = tasks_;
      if (job) ++active_;
    }
    if (!job) continue;
    tInsideTask = true;
    drain(*job, tasks);
    tInsideTask = false;
    std::lock_guard<std::mutex> lk(mu_);
    --active_;
  }
}

void ThreadPool::run(int tasks, const std::function<void(int)>& fn) {
  if (tasks <= 0) return;
  std::unique_lock<std::mutex> call(callMutex_, std::defer_lock);
  if (tasks == 1 || workers_.empty() || tInsideTask || !call.try_lock()) {
    for (int t = 0; t < tasks; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ++generation_;
  }
  wake_.notify_all();
  tInsideTask = true;
  drain(fn, tasks);
  tInsideTask = false;
  spinThenYield([&] { return done_.load(std::memory_order_acquire) >= tasks; });
  // Retire the job: a worker that wakes from now on finds no job; one that took it already
  // is counted in active_ and must leave drain() before `fn` goes out of scope.
  std::unique_lock<std::mutex> lk(mu_);
  job_ = nullptr;
  while (active_ > 0) {
    lk.unlock();
    std::this_thread::yield();
    lk.lock();
  }
}

void ThreadPool::parallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t maxChunks = (n + grain - 1) / grain;
  const int chunks = static_cast<int>(std::min<int64_t>(maxChunks, size()));
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  run(chunks, [&](int c) {
    const int64_t b = n * c / chunks, e = n * (c + 1) / chunks;
    if (b < e) fn(b, e);
  });
}

namespace {
std::unique_ptr<ThreadPool>& poolSlot() {
  static std::unique_ptr<ThreadPool> p;
  return p;
}
int defaultThreads() {
  unsigned h = std::thread::hardware_concurrency();
  return h ? static_cast<int>(h) : 1;
}
}  // namespace

ThreadPool& pool() {
  auto& p = poolSlot();
  if (!p) p = std::make_unique<ThreadPool>(defaultThreads());
  return *p;
}

void setThreads(int threads) {
  poolSlot() = std::make_unique<ThreadPool>(threads > 0 ? threads : defaultThreads());
}

int threadCount() {
  return pool().size();
}

}  // namespace ptllm
