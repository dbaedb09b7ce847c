// gpucast/cuda_block.h: how PyTorch's CUDA caching allocator counts a request, in plain C++.
//
// The caching allocator's trace tracker reports requested sizes; its counters (memory_allocated) count
// blocks. Shared by the tracer (to record block bytes) and the allocator simulation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace gpucast {

// kMinBlockSize: c10/core/AllocatorConfig.h:19 (torch 2.14.1).
inline constexpr int64_t kCudaMinBlockBytes = 512;

// Block bytes of a request: below 512 B one 512 B block, otherwise rounded up to a multiple of 512 B
// (with `roundup_power2_divisions` > 0, rounded up to the next of that many divisions of a power of two,
// as the allocator does for requests above 512 B).
int64_t cuda_block_bytes(int64_t requested_bytes, int roundup_power2_divisions = 0);

// What a caching-allocator trace entry means for the window's running total.
struct CudaTraceDelta {
  int64_t bytes = 0;        // requested, signed
  int64_t block_bytes = 0;  // counted, signed
};
// action: the TraceEntry action name ("alloc", "free_requested", ...); others give nothing.
std::optional<CudaTraceDelta> cuda_trace_delta(const std::string& action, int64_t size, int roundup_power2_divisions = 0);

}  // namespace gpucast
