// A small persistent thread pool. Work items are claimed from an atomic counter, so each
// item runs on exactly one thread and results never depend on the number of threads.
// A job hands out one ticket per helper; once the calling thread has claimed the last item
// it takes back the tickets no helper has taken, so it waits only for helpers at work, not
// for ones still waking up (25-30 µs here), which then go back to sleep.
//
// Where the kernel is built with OpenMP, it runs its items on OpenMP's threads instead. A
// process holds one libgomp, which torch's own operations run on too, and its threads spin a
// while after each operation: on 2 CPUs a pool of our own then competed with them for the
// second CPU. In a loop of decoding steps between torch matrix products (bfloat16, 8 heads of
// 64, 1001 keys), runs alternating: the kernel took 144-195 µs a step on the pool, 88-98 on
// OpenMP's threads (torch's SDPA 103-150). A child forked from a process that started
// OpenMP's threads would wait on threads it does not have (torch hangs there): it uses the
// pool.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <pthread.h>
#endif

#include "problem.h"

namespace qkv {
namespace {

class Pool {
 public:
  void run(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx) {
    std::lock_guard<std::mutex> one_job_at_a_time(job_mutex_);
    int helpers = std::max(0, std::min<int>(threads, static_cast<int>(n)) - 1);
    ensure_workers(helpers);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = fn, ctx_ = ctx, n_ = n, next_.store(0), tickets_ = helpers, pending_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    pending_ -= tickets_, tickets_ = 0;  // every item is claimed: helpers not started yet need not start
    done_.wait(lock, [&] { return pending_ == 0; });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  void drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < n_;) fn_(ctx_, i);
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) workers_.emplace_back([this] { loop(); });
  }

  void loop() {
    uint64_t seen = 0;  // the last job this helper took a ticket of
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || (generation_ != seen && tickets_ > 0); });
        if (stop_) return;
        seen = generation_, --tickets_;
      }
      drain();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      done_.notify_all();
    }
  }

  std::mutex job_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int tickets_ = 0, pending_ = 0;  // helpers yet to take this job, and taken but not finished
  uint64_t generation_ = 0;
  bool stop_ = false;
};

#if defined(_OPENMP)
std::atomic<bool> in_forked_child{false};
const int at_fork_registered = pthread_atfork(nullptr, nullptr, [] { in_forked_child = true; });

void openmp_for(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx) {
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, n)))
  for (int64_t i; (i = next.fetch_add(1)) < n;) fn(ctx, i);
}
#endif

}  // namespace

void parallel_for(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
#if defined(_OPENMP)
  if (!in_forked_child) return openmp_for(n, threads, fn, ctx);
#endif
  static Pool* pool = new Pool();  // never destroyed: worker threads must not be joined at exit
  pool->run(n, threads, fn, ctx);
}

const char* threading_name() {
#if defined(_OPENMP)
  if (!in_forked_child) return "openmp";
#endif
  return "own pool";
}

}  // namespace qkv
