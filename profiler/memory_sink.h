// Internal: how allocator hooks hand events to the tracer.
#pragma once

#include <cstdint>
#include <vector>

#include <c10/core/Device.h>

#include "gpucast/trace_assembly.h"

namespace gpucast::detail {

// Called by allocator hooks on the allocating/freeing thread. Cheap when no trace runs.
void record_memory_event(const void* ptr, int64_t bytes, int64_t block_bytes, c10::Device device) noexcept;
bool memory_recording() noexcept;

// Live CPU blocks the CPU allocator wrapper knows (for the baseline).
std::vector<BaselineBlock> cpu_live_blocks();
// Live meta storages the meta allocator wrapper knows (for the baseline), device "meta".
std::vector<BaselineBlock> meta_live_blocks();
// CUDA: each device's bytes allocated at the trace's start, and the live blocks (the caching allocator's
// snapshot, in address order within each segment) appended to `blocks`.
void cuda_baseline(std::map<std::string, DeviceBaseline>& out, std::vector<BaselineBlock>& blocks,
                   std::vector<Note>& notes);

}  // namespace gpucast::detail
