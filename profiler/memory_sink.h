// Internal: how allocator hooks hand events to the tracer.
#pragma once

#include <algorithm>
#include <functional>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>

#include <c10/core/Device.h>

#include "gpucast/trace_assembly.h"

namespace gpucast::detail {

// Called by allocator hooks on the allocating/freeing thread. Cheap when no trace runs.
void record_memory_event(const void* ptr, int64_t bytes, int64_t block_bytes, c10::Device device) noexcept;
bool memory_recording() noexcept;

// The blocks an allocator wrapper holds, each with its allocation order, listed oldest first (as baselines list them).
inline std::vector<BaselineBlock> oldest_first(std::vector<std::pair<uint64_t, BaselineBlock>> ordered) {
  std::sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<BaselineBlock> out;
  out.reserve(ordered.size());
  for (auto& [order, block] : ordered) out.push_back(std::move(block));
  return out;
}

// Installs a wrapper of the allocator `get()` returns, through `set` at priority 0, once per process (`slot` holds
// it, under `mu`). False, with `refused` in `why`, where another allocator of a higher priority keeps the slot. The
// wrapper is never deleted once installed: tensors may hold its deleter until the process ends.
template <class Hook>
bool install_allocator_hook(std::mutex& mu, Hook*& slot, c10::Allocator* (*get)(), void (*set)(c10::Allocator*, uint8_t),
                            const char* refused, std::string* why) {
  std::lock_guard<std::mutex> g(mu);
  if (slot != nullptr) return true;
  auto* hook = new Hook(get());
  set(hook, /*priority=*/0);
  if (get() != hook) {
    if (why != nullptr) *why = refused;
    delete hook;
    return false;
  }
  slot = hook;
  return true;
}

// Live CPU blocks the CPU allocator wrapper knows (for the baseline).
std::vector<BaselineBlock> cpu_live_blocks();
// Live meta storages the meta allocator wrapper knows (for the baseline), device "meta".
std::vector<BaselineBlock> meta_live_blocks();
// Whether the meta kernel the dispatcher runs for an op is written in Python where the CPU and GPU run a kernel
// of their own (meta_kernels.cpp), answered now for the operators `ops` (name, overload) and kept: false for any
// other and for what is not an operator.
std::function<bool(const OpRecord&)> meta_kernel_in_python(const std::set<std::pair<std::string, std::string>>& ops);
// CUDA: each device's bytes allocated at the trace's start, and the live blocks (the caching allocator's
// snapshot, in address order within each segment) appended to `blocks`.
void cuda_baseline(std::map<std::string, DeviceBaseline>& out, std::vector<BaselineBlock>& blocks,
                   std::vector<Note>& notes);

}  // namespace gpucast::detail
