// gpucast/allocation_refusal.h: how auto mode stops a job (on_risk:raise) where no hook can raise, in plain C++.
//
// PyTorch catches and logs an exception thrown inside a RecordFunction callback, so the op whose scope ends the
// first iteration cannot fail. Instead the training thread's next allocation fails: through gpucast's CPU
// allocator wrapper (before anything is allocated), or on the CUDA caching allocator (from its trace tracker, the
// only CUDA allocation hook PyTorch has: c10/cuda/CUDACachingAllocator.cpp calls the trackers in alloc_found_block
// after the block is taken, so the refused request's block stays held; the job is stopping). Whichever comes first
// takes the refusal; it fires once.
//
// Invariant: `pending()` is one relaxed atomic load, the only cost on an allocation while nothing is refused.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "gpucast/cuda_block.h"

namespace gpucast {

class AllocationRefusal {
 public:
  // The process's one refusal (never destroyed: allocations run during process exit).
  static AllocationRefusal& instance();

  // The next allocation on `thread` is refused with `message`; an empty message clears a pending refusal.
  void arm(std::thread::id thread, std::string message);
  bool pending() const noexcept { return pending_.load(std::memory_order_relaxed); }
  // The message, once, when `thread` is the one armed; nullopt otherwise (another thread, or nothing pending).
  std::optional<std::string> take(std::thread::id thread);

 private:
  std::mutex mu_;
  std::thread::id thread_;
  std::string message_;
  std::atomic<bool> pending_{false};
};

// What the CUDA caching allocator's trace tracker does with one entry (c10/cuda/CUDACachingAllocator.h:
// TraceEntry; `action` by name: "alloc", "free_requested", ...): the memory event to record while a trace records,
// and for an "alloc" on the thread a refusal is armed for, its message (the hook throws it). Never refuses a free.
struct CudaEntryOutcome {
  std::optional<CudaTraceDelta> delta;
  std::optional<std::string> refusal;
};
CudaEntryOutcome cuda_trace_entry_outcome(const std::string& action, int64_t size, bool recording,
                                          AllocationRefusal& refusal, std::thread::id thread);

}  // namespace gpucast
