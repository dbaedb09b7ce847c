// gpucast/parallel.h: the parallel strategy of a run, shared by the memory and step-time forecasts.
#pragma once

#include <cstdint>
#include <string>

namespace gpucast {

struct ParallelConfig {
  int64_t dp = 1, tp = 1, pp = 1;
  std::string dp_mode = "ddp";  // ddp | zero1 | zero2 | fsdp
  int64_t micro_batches = 1;    // gradient accumulation steps (and pipeline micro-batches)
  bool gradient_as_bucket_view = false;
  // "dp:8,dp_mode:fsdp,micro_batches:4" (the configuration grammar); errors name the key.
  static ParallelConfig parse(const std::string& text);
};

}  // namespace gpucast
