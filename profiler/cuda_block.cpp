#include "gpucast/cuda_block.h"

#include <bit>

namespace gpucast {

int64_t cuda_block_bytes(int64_t requested, int divisions) {
  if (requested < kCudaMinBlockBytes) return kCudaMinBlockBytes;
  if (divisions > 1 && requested > kCudaMinBlockBytes) {
    // Round up to the next of `divisions` equal steps between two powers of two.
    const auto floor_pow2 = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(requested)));
    const int64_t step = floor_pow2 / divisions;
    if (step >= kCudaMinBlockBytes) {
      return (requested + step - 1) / step * step;
    }
  }
  return (requested + kCudaMinBlockBytes - 1) / kCudaMinBlockBytes * kCudaMinBlockBytes;
}

std::optional<CudaTraceDelta> cuda_trace_delta(const std::string& action, int64_t size, int divisions) {
  if (action == "alloc") return CudaTraceDelta{size, cuda_block_bytes(size, divisions)};
  if (action == "free_requested") return CudaTraceDelta{-size, -cuda_block_bytes(size, divisions)};
  return std::nullopt;
}

}  // namespace gpucast
