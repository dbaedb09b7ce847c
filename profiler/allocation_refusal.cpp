// The refusal of the training thread's next allocation (gpucast/allocation_refusal.h).
#include "gpucast/allocation_refusal.h"

#include <utility>

namespace gpucast {

AllocationRefusal& AllocationRefusal::instance() {
  static auto* r = new AllocationRefusal();
  return *r;
}

void AllocationRefusal::arm(std::thread::id thread, std::string message) {
  std::lock_guard<std::mutex> g(mu_);
  thread_ = thread;
  message_ = std::move(message);
  pending_.store(!message_.empty(), std::memory_order_relaxed);
}

std::optional<std::string> AllocationRefusal::take(std::thread::id thread) {
  if (!pending()) return std::nullopt;
  std::lock_guard<std::mutex> g(mu_);
  if (message_.empty() || thread_ != thread) return std::nullopt;
  pending_.store(false, std::memory_order_relaxed);
  return std::exchange(message_, std::string());
}

CudaEntryOutcome cuda_trace_entry_outcome(const std::string& action, int64_t size, bool recording,
                                          AllocationRefusal& refusal, std::thread::id thread) {
  CudaEntryOutcome out;
  if (recording) out.delta = cuda_trace_delta(action, size);
  if (action == "alloc") out.refusal = refusal.take(thread);
  return out;
}

}  // namespace gpucast
