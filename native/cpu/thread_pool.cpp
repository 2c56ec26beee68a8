#include "trainstream/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <exception>
#include <stdexcept>

namespace trainstream {

Job::Job(ChunkFn fn, int64_t num_chunks, std::vector<const void*> keys, int64_t priority)
    : fn_(std::move(fn)), num_chunks_(num_chunks), keys_(std::move(keys)), priority_(priority) {
  std::sort(keys_.begin(), keys_.end());
  keys_.erase(std::unique(keys_.begin(), keys_.end()), keys_.end());
}

void Job::wait() {
  std::unique_lock<std::mutex> lock(wait_mu_);
  wait_cv_.wait(lock, [this] { return complete_.load(std::memory_order_acquire); });
  if (!error_.empty()) throw std::runtime_error(error_);
}

int ThreadPool::available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1");
  workers_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (...) {
    // Out of threads part-way: stop the ones that started, so the error reaches Python
    // instead of std::terminate on joinable threads.
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

static bool shares_key(const std::vector<const void*>& a, const std::vector<const void*>& b) {
  // Both sorted: a linear merge walk.
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) return true;
    if (a[i] < b[j]) ++i; else ++j;
  }
  return false;
}

std::shared_ptr<Job> ThreadPool::submit(Job::ChunkFn fn, int64_t num_chunks,
                                        std::vector<const void*> keys, int64_t priority) {
  auto job = std::make_shared<Job>(std::move(fn), num_chunks, std::move(keys), priority);
  if (num_chunks == 0) {
    job->complete_.store(true, std::memory_order_release);
    return job;
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (auto& earlier : jobs_) {
      if (shares_key(earlier->keys_, job->keys_)) {
        earlier->dependents_.push_back(job);
        ++job->blockers_;
      }
    }
    jobs_.push_back(job);
  }
  cv_.notify_all();
  return job;
}

std::shared_ptr<Job> ThreadPool::next_runnable_locked() {
  std::shared_ptr<Job>* best = nullptr;
  for (auto& job : jobs_) {
    if (job->blockers_ > 0 || job->next_chunk_ >= job->num_chunks_) continue;
    if (best == nullptr || job->priority_ < (*best)->priority_) best = &job;
  }
  return best ? *best : nullptr;
}

void ThreadPool::finish_locked(const std::shared_ptr<Job>& job) {
  jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
  for (auto& later : job->dependents_) --later->blockers_;
  job->dependents_.clear();
  {
    std::lock_guard<std::mutex> g(job->wait_mu_);
    job->complete_.store(true, std::memory_order_release);
  }
  job->wait_cv_.notify_all();
}

void ThreadPool::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::shared_ptr<Job> job;
    cv_.wait(lock, [&] {
      job = next_runnable_locked();
      // Drain before stopping: a destroyed pool never leaves a handle waiting forever.
      return job != nullptr || (stopping_ && jobs_.empty());
    });
    if (job == nullptr) return;
    int64_t chunk = job->next_chunk_++;
    lock.unlock();
    try {
      job->fn_(chunk);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> g(job->wait_mu_);
      if (job->error_.empty()) job->error_ = e.what();
    } catch (...) {
      std::lock_guard<std::mutex> g(job->wait_mu_);
      if (job->error_.empty()) job->error_ = "unknown error in a native job";
    }
    lock.lock();
    if (job->finished_chunks_.fetch_add(1, std::memory_order_acq_rel) + 1 == job->num_chunks_) {
      finish_locked(job);
      // A finished job may unblock later jobs that share its keys.
      cv_.notify_all();
    }
  }
}

}  // namespace trainstream
