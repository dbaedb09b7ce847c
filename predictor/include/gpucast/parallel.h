// gpucast/parallel.h: the parallel strategy of a run, shared by the memory and step-time forecasts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpucast {

// Micro-batches whose activations the first pipeline stage holds at once under 1F1B: it runs min(pp, micro_batches)
// forwards before its first backward (torch/distributed/pipelining/schedules.py, Schedule1F1B._step_microbatches:
// warmup_chunks = min(n_microbatches, num_stages - stage_index)). Each saves the activations of its 1/pp of the
// layers; the memory forecast and the job estimate both read the rule here.
inline int64_t first_stage_in_flight(int64_t pp, int64_t micro_batches) { return pp < micro_batches ? pp : micro_batches; }

struct ParallelConfig {
  int64_t dp = 1, tp = 1, pp = 1;
  std::string dp_mode = "ddp";  // ddp | zero1 | zero2 | fsdp
  int64_t micro_batches = 1;    // gradient accumulation steps (and pipeline micro-batches)
  bool gradient_as_bucket_view = false;
  // DDP (and ZeRO-1/2 over it) broadcasts the module's buffers (BatchNorm's running statistics, ...) from rank 0
  // before the forward of every step (broadcast_buffers=True, DDP's default): buffer_bytes of them.
  bool broadcast_buffers = true;
  int64_t buffer_bytes = 0;
  // DDP's gradient buckets: by default the first 1 MiB and the rest 25 MiB; with bucket_cap_mb given, every
  // bucket that size (as DDP does).
  // torch 2.14.1: torch/nn/parallel/distributed.py:31 (_DEFAULT_BUCKET_CAP_MB), c10d/reducer.hpp:31.
  int64_t bucket_bytes = int64_t{25} << 20;
  bool bucket_cap_given = false;
  // FSDP's units (dp_mode fsdp): module paths as the trace names them ("GPT.blocks.0"), each the root of one unit
  // (fully_shard / FSDP wrapping of that module); a layer belongs to the innermost unit whose path is it or
  // contains it, every other layer to the root unit (the whole model's wrapping), which is gathered once per
  // forward and kept for backward. Empty: every layer with parameters its own unit, gathered in both passes.
  // Given as "fsdp_units:GPT.blocks.0|GPT.blocks.1".
  std::vector<std::string> fsdp_units;
  // FSDP2's reshard_after_forward: 1 (True), 0 (False), or n >= 2 (an int: each unit keeps a 1/n shard after
  // forward); -1 not given (fully_shard's default: True for the units, False for the root, which backward needs at
  // once: torch 2.14.1 _fsdp_state.py:205). Given as "reshard_after_forward:True|False|n".
  int64_t reshard_after_forward = -1;
  // FSDP2's MixedPrecisionPolicy: bytes per element of param_dtype and reduce_dtype (0: not given; reduce_dtype not
  // given reduces in param_dtype, as FSDP2 does). Given as "param_dtype:bfloat16,reduce_dtype:float32".
  int64_t param_dtype_bytes = 0, reduce_dtype_bytes = 0;
  // The probes ran as rank traced_rank of a world of traced_world processes (gpucast.simulated_ranks: a fake process
  // group, whose collectives move no data, under which PyTorch's own DDP, FSDP2 and tensor parallelism build and run
  // what that rank holds). Their memory is then the rank's own: no parallel rule rewrites it, and the step time does
  // not divide again what the rank already computes on its shards. 0: the probes ran as one process of the whole
  // job, which the rules above turn into a rank's. Invariant when > 0: dp * tp * pp == traced_world. The step time of a
  // pipeline stage traced alone is not forecast (step_fit.cpp refuses it).
  int64_t traced_world = 0, traced_rank = 0;
  // "dp:8,dp_mode:fsdp,micro_batches:4,bucket_cap_mb:50" (the configuration grammar); errors name the key.
  static ParallelConfig parse(const std::string& text);
};

}  // namespace gpucast
