#include "gpucast/parallel.h"

#include "gpucast/config.h"

namespace gpucast {

ParallelConfig ParallelConfig::parse(const std::string& text) {
  using F = ConfigKey::Form;
  Config cfg("parallel", {{"dp", F::PositiveInt, int64_t{1}, {}, "data-parallel degree"},
                          {"tp", F::PositiveInt, int64_t{1}, {}, "tensor-parallel degree"},
                          {"pp", F::PositiveInt, int64_t{1}, {}, "pipeline-parallel degree"},
                          {"dp_mode", F::Choice, std::string("ddp"), {"ddp", "zero1", "zero2", "fsdp"}, "sharding"},
                          {"micro_batches", F::PositiveInt, int64_t{1}, {}, "gradient accumulation steps"},
                          {"gradient_as_bucket_view", F::Bool, false, {}, "DDP gradients as views of its buckets"},
                          {"broadcast_buffers", F::Bool, true, {}, "DDP broadcasts the module's buffers every forward"},
                          {"buffer_bytes", F::PositiveInt, int64_t{0}, {}, "bytes of the module's buffers"}});
  cfg.parse(text);
  ParallelConfig p;
  p.dp = cfg.get_int("dp");
  p.tp = cfg.get_int("tp");
  p.pp = cfg.get_int("pp");
  p.dp_mode = cfg.get_string("dp_mode");
  p.micro_batches = cfg.get_int("micro_batches");
  p.gradient_as_bucket_view = cfg.get_bool("gradient_as_bucket_view");
  p.broadcast_buffers = cfg.get_bool("broadcast_buffers");
  p.buffer_bytes = cfg.get_int("buffer_bytes");
  return p;
}

}  // namespace gpucast
