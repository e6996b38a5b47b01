// The library's plain C entry points, for hosts other than onnxruntime: the torch engine's CPU paged-attention op
// (backends/torch/native_ops.py, through ctypes) calls the same kernel the onnxruntime glue (ort_ops.cc) does.
// Every argument is a scalar or a pointer, so the caller mirrors no struct layout; loops that onnxruntime's pool
// would run go to this library's own worker threads (host_parallel_for), as many as the caller's num_threads.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

#include "paged_attention.h"

namespace trtbuild::cpu {
namespace {

thread_local int64_t t_host_threads = 1;  // set by each C entry point for the loops of its call

struct HostLoop {
  void (*fn)(void*, size_t);
  void* data;
  size_t tasks;
  std::atomic<size_t> next{0};

  void run() {
    for (size_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(data, t);
  }
};

// Worker threads kept for the process: started at first use, as many as the largest call asked for less one (the
// caller works too). Starting threads for every call cost ~100 us a call: a SmolLM2 decode step on 2 cores at 448
// tokens of context spent 3.1 of its 13.4 ms so (benchmarks/results/2026-12-05-cpu2-attention-threads.md). Idle
// workers block on a condition variable and never spin: the torch engine's OpenMP threads share the cores.
// One loop runs at a time (callers on several threads take turns). Never destroyed (its workers may still wait at
// exit); a forked child, which has none of its parent's threads, gets a pool of its own.
class HostPool {
 public:
  static HostPool& get() {
    static std::mutex made;
    static HostPool* pool = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new HostPool();  // the parent's, after a fork: left
    return *pool;
  }

  // Runs loop on the calling thread and `helpers` workers; returns when all of them have left it.
  void run(HostLoop& loop, size_t helpers) {
    std::lock_guard<std::mutex> turn(turn_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (; workers_ < helpers; ++workers_) std::thread([this] { work(); }).detach();
      loop_ = &loop;
      wanted_ = running_ = helpers;
      claimed_ = 0;
      ++generation_;
    }
    wake_.notify_all();
    loop.run();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return running_ == 0; });
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t seen = 0;  // a worker starts inside run(), under mu_, before the loop it is for is posted
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (claimed_ == wanted_) continue;  // more workers than this loop asked for
      ++claimed_;
      HostLoop* loop = loop_;
      lock.unlock();
      loop->run();
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  const pid_t pid_ = getpid();
  std::mutex turn_, mu_;
  std::condition_variable wake_, done_;
  size_t workers_ = 0, wanted_ = 0, claimed_ = 0, running_ = 0;  // under mu_, as the two below
  uint64_t generation_ = 0;  // one more for every loop posted
  HostLoop* loop_ = nullptr;
};

}  // namespace

bool host_parallel_for(void (*fn)(void*, size_t), size_t tasks, void* data) {
  const size_t threads = std::min<size_t>(tasks, size_t(std::max<int64_t>(t_host_threads, 1)));
  if (threads < 2) return false;
  HostLoop loop{fn, data, tasks};
  HostPool::get().run(loop, threads - 1);
  return true;
}

}  // namespace trtbuild::cpu

// trtbuild::PagedAttention on one step (plugins/paged_attention/README.md; the arguments are paged_attention.h's
// Attrs and Step, field by field): qkv [num_tokens, (Hq + 2 Hkv) D] float32, caches [num_blocks, block_size, Hkv, D]
// (float32, int8 or fp8 bits per cache_type, written in place), out [num_tokens, Hq D] float32. window: the sliding
// window, or <= 0 for none; softcap <= 0 for none; cos_sin nullptr for no rotary embedding. Returns 1 on success,
// 0 for a call beyond the kernel's limits (paged_attention.h: kMax*), out then unwritten.
extern "C" __attribute__((visibility("default"))) int trtbuild_paged_attention(
    const float* qkv, void* key_cache, void* value_cache, float k_scale, float v_scale, const int64_t* positions,
    const int64_t* block_tables, const int64_t* query_start_loc, const float* cos_sin, float* out,
    int64_t num_tokens, int64_t num_seqs, int64_t max_blocks, int64_t num_blocks, int64_t block_size,
    int64_t rotary_dim, int64_t rotary_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
    int64_t interleaved, int64_t cache_type, float scale, int64_t window, float softcap, int64_t num_threads) {
  using namespace trtbuild::cpu;
  Attrs a{num_heads, num_kv_heads, head_size, interleaved, cache_type, scale};
  a.window = window > 0 ? window : kNoWindow;
  a.softcap = softcap > 0.0f ? softcap : 0.0f;
  Step s{};
  s.qkv = qkv;
  s.key_cache = key_cache;
  s.value_cache = value_cache;
  s.k_scale = k_scale;
  s.v_scale = v_scale;
  s.positions = positions;
  s.block_tables = block_tables;
  s.query_start_loc = query_start_loc;
  s.cos_sin = cos_sin;
  s.out = out;
  s.num_tokens = num_tokens;
  s.num_seqs = num_seqs;
  s.max_blocks = max_blocks;
  s.num_blocks = num_blocks;
  s.block_size = block_size;
  s.rotary_dim = rotary_dim;
  s.rotary_rows = rotary_rows;
  if (num_tokens == 0) return 1;
  t_host_threads = num_threads;
  return paged_attention(nullptr, a, s) ? 1 : 0;
}
