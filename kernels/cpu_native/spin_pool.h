// A parallel_for over the kernels' own worker threads, which spin between calls.
//
// at::parallel_for runs on libgomp, which keeps a pool of workers per thread that opens
// parallel regions. A server forwards on one thread and samples on another, so a process holds
// more workers than cores, and libgomp then makes its workers sleep between regions (a few
// hundred spins at most). A decode step is ~200 short kernels, each waking a sleeping worker:
// SmolLM2-135M's quantized step took 7.7 ms on the main thread and 17.7 ms on a second one (2
// cores). These workers spin for a while after each call, so the next kernel of the same
// step finds them awake, and sleep only when the caller has gone quiet.
//
// A call's range is cut into a few chunks per thread, which the caller and the workers claim
// one at a time: when another process takes a core and a worker is not running, the caller
// takes the chunks the worker would have, instead of waiting a scheduler time slice for it
// (with one fixed chunk per thread, a decode step of ~200 kernels fell from 69 to 2.4 tok/s
// beside one busy process). The caller's wait for chunks already claimed yields the core.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include <unistd.h>
#include <vector>

namespace arbor_cpu {

class SpinPool {
 public:
  // Chunks per thread a call's range is cut into (fewer where `grain` allows fewer).
  static constexpr int64_t kChunksPerThread = 4;

  using Body = std::function<void(int64_t, int64_t)>;

  // Runs body over [begin, end) in chunks of at least `grain`, on up to at::get_num_threads()
  // threads (the caller's setting); inline when one chunk suffices, the caller has one thread,
  // or another caller holds the pool.
  void run(int64_t begin, int64_t end, int64_t grain, const Body& body) {
    const int64_t size = end - begin;
    const int64_t wanted = std::min<int64_t>(at::get_num_threads(), (size + grain - 1) / grain);
    if (size <= 0) return;
    std::unique_lock<std::mutex> own(busy_, std::try_to_lock);
    if (wanted <= 1 || !own.owns_lock() || at::in_parallel_region()) {
      body(begin, end);
      return;
    }
    if (pid_ != getpid()) {  // a forked child inherits no threads: start its own
      for (auto& t : workers_) t.detach();
      workers_.clear();
      pid_ = getpid();
    }
    ensure_workers(wanted - 1);
    const int64_t chunks = std::min<int64_t>((size + grain - 1) / grain, wanted * kChunksPerThread);
    body_ = &body;
    begin_ = begin;
    size_ = size;
    chunks_.store(chunks, std::memory_order_relaxed);
    error_ = nullptr;
    remaining_.store(chunks, std::memory_order_relaxed);
    const uint64_t call = ++call_;
    claim_.store(call << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    drain(call);
    for (int spins = 1; remaining_.load(std::memory_order_acquire) > 0; ++spins) {
      pause();
      if (spins % 64 == 0) std::this_thread::yield();  // a descheduled worker holds a chunk
    }
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_ = true;
      epoch_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Claims and runs chunks of call `call` until none is left. A claim succeeds only while
  // `call` is the current call (the call id is the claim word's upper half), so a worker late
  // from an earlier call never takes a chunk of a later one with the earlier call's view.
  void drain(uint64_t call) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    while ((word >> 32) == call) {
      const int64_t index = static_cast<int64_t>(word & 0xffffffffu);
      if (index >= chunks_.load(std::memory_order_relaxed)) return;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) {
        run_chunk(index);
        remaining_.fetch_sub(1, std::memory_order_acq_rel);
        word = claim_.load(std::memory_order_acquire);
      }
    }
  }

  void run_chunk(int64_t index) {
    const int64_t chunks = chunks_.load(std::memory_order_relaxed);
    const int64_t lo = begin_ + size_ * index / chunks;
    const int64_t hi = begin_ + size_ * (index + 1) / chunks;
    try {
      if (lo < hi) (*body_)(lo, hi);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }

  void ensure_workers(int64_t count) {
    while (static_cast<int64_t>(workers_.size()) < count) {
      // The epoch before this call's: a worker that starts late must still take this call.
      const uint64_t seen = epoch_.load(std::memory_order_acquire);
      workers_.emplace_back([this, seen] { work(seen); });
    }
  }

  void work(uint64_t seen) {
    while (true) {
      // Spin ~2 ms (a step's gaps between kernels are tens of microseconds), then sleep.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
      uint64_t now = seen;
      int spins = 0;
      while ((now = epoch_.load(std::memory_order_acquire)) == seen) {
        pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          wake_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = now;
      if (stop_) return;
      drain(claim_.load(std::memory_order_acquire) >> 32);
    }
  }

  std::mutex busy_;
  std::mutex sleep_mutex_;
  std::mutex error_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> remaining_{0};
  // (call id << 32) | the next chunk to claim; call_ counts the calls (the caller's alone).
  std::atomic<uint64_t> claim_{0};
  uint64_t call_ = 0;
  std::atomic<int64_t> chunks_{1};
  std::vector<std::thread> workers_;
  const Body* body_ = nullptr;
  int64_t begin_ = 0, size_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  pid_t pid_ = getpid();
};

inline SpinPool& spin_pool() {
  static SpinPool* pool = new SpinPool();  // never destroyed: workers outlive static teardown
  return *pool;
}

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  spin_pool().run(begin, end, grain, SpinPool::Body(body));
}

}  // namespace arbor_cpu
