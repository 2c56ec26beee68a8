// A persistent pool of worker threads that runs jobs split into chunks.
//
// Why not OpenMP or std::async: the host AdamW must be asynchronous (Python queues a
// block's update and returns to backward at once), several jobs must be able to run
// at the same time, and two jobs that touch the same tensor must run in the order they
// were queued. A job therefore carries "keys" (the addresses it writes); a worker only
// takes chunks from a job when no earlier unfinished job shares one of its keys. That
// test is made once, when the job is queued (it counts its blockers), not on every chunk
// claimed: a step queues tens of jobs of thousands of chunks each, and a scan of every
// pair of jobs per chunk, under the pool's lock, cost more than the update itself.
// Among the jobs it may run, a worker takes the one with the lowest priority number
// (then the oldest): the engine queues block updates in backward order but the next
// forward needs them in forward order, so it numbers them by when they are needed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace trainstream {

class Job {
 public:
  using ChunkFn = std::function<void(int64_t chunk)>;
  Job(ChunkFn fn, int64_t num_chunks, std::vector<const void*> keys, int64_t priority = 0);

  // Blocks until every chunk has run; rethrows the first error a chunk raised.
  void wait();
  bool done() const { return complete_.load(std::memory_order_acquire); }
  int64_t num_chunks() const { return num_chunks_; }

 private:
  friend class ThreadPool;
  ChunkFn fn_;
  int64_t num_chunks_;
  std::vector<const void*> keys_;
  int64_t priority_;                       // lower runs first; equal: submission order
  // Guarded by the pool's mutex:
  int64_t next_chunk_ = 0;
  int64_t blockers_ = 0;                   // earlier unfinished jobs that share a key
  std::vector<std::shared_ptr<Job>> dependents_;  // later jobs this one blocks
  std::atomic<int64_t> finished_chunks_{0};
  std::atomic<bool> complete_{false};
  std::mutex wait_mu_;
  std::condition_variable wait_cv_;
  std::string error_;                      // guarded by wait_mu_
};

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();  // finishes queued jobs, then joins the workers
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::shared_ptr<Job> submit(Job::ChunkFn fn, int64_t num_chunks, std::vector<const void*> keys,
                              int64_t priority = 0);
  int threads() const { return static_cast<int>(workers_.size()); }

  // Cores this process may run on (sched_getaffinity), the default pool size.
  static int available_cores();

 private:
  void worker_loop();
  // Picks, among unblocked jobs with an unclaimed chunk, the one with the lowest priority
  // number (the oldest of equals). Caller holds mu_.
  std::shared_ptr<Job> next_runnable_locked();
  // Removes a finished job and unblocks its dependents. Caller holds mu_.
  void finish_locked(const std::shared_ptr<Job>& job);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;  // unfinished jobs, in submission order
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace trainstream
