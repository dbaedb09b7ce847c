#include <torch/version.h>

#include "gpucast/tracer.h"

#ifdef GPUCAST_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#ifndef GPUCAST_VERSION
#define GPUCAST_VERSION "0.0.0"
#endif
#ifndef GPUCAST_BUILD_TYPE
#define GPUCAST_BUILD_TYPE "unknown"
#endif

namespace gpucast {

TraceContext current_context() {
  TraceContext c;
  c.gpucast_version = GPUCAST_VERSION;
  c.torch_version = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                    std::to_string(TORCH_VERSION_PATCH);
  c.build_type = GPUCAST_BUILD_TYPE;
  c.device = "cpu";
#ifdef GPUCAST_WITH_CUDA
  c.cuda_build = true;
  const int n = c10::cuda::device_count();
  if (n > 0) c.device = "cpu, " + std::to_string(n) + " CUDA device(s)";
#endif
  return c;
}

}  // namespace gpucast
