#include "gpucast/parallel.h"

#include <algorithm>
#include <cmath>

#include "gpucast/config.h"
#include "gpucast/error.h"

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
                          {"buffer_bytes", F::NonNegativeInt, int64_t{0}, {}, "bytes of the module's buffers"},
                          {"bucket_cap_mb", F::String, std::string("25"), {},
                           "DDP's bucket_cap_mb: MiB per gradient bucket (not given: the first 1 MiB, the rest 25)"},
                          {"fsdp_units", F::String, std::string(""), {},
                           "FSDP's units: module paths separated by '|' (not given: every layer with parameters)"},
                          {"reshard_after_forward", F::String, std::string(""), {},
                           "FSDP2's reshard_after_forward: True, False, or a number of ranks (not given: True for the "
                           "units, False for the root, as fully_shard's default)"},
                          {"param_dtype", F::String, std::string(""), {},
                           "FSDP2 MixedPrecisionPolicy's param_dtype: bfloat16, float16 or float32 (not given: none)"},
                          {"reduce_dtype", F::String, std::string(""), {},
                           "FSDP2 MixedPrecisionPolicy's reduce_dtype (not given: param_dtype's)"},
                          {"traced_world", F::NonNegativeInt, int64_t{0}, {},
                           "the probes ran as one rank of a world this size (gpucast.simulated_ranks); 0: as one "
                           "process of the whole job"},
                          {"traced_rank", F::NonNegativeInt, int64_t{0}, {}, "the rank the probes ran as"}});
  cfg.parse(text);
  ParallelConfig p;
  p.dp = cfg.get_int("dp");
  p.tp = cfg.get_int("tp");
  p.pp = cfg.get_int("pp");
  p.dp_mode = cfg.get_string("dp_mode");
  p.micro_batches = cfg.get_int("micro_batches");
  p.traced_world = cfg.get_int("traced_world");
  p.traced_rank = cfg.get_int("traced_rank");
  if (p.traced_world == 0 && cfg.was_set("traced_rank")) {
    GPUCAST_USER_ERROR("parallel: traced_rank {} without traced_world: the rank of which world?", p.traced_rank);
  }
  int64_t world = 0;
  if (__builtin_mul_overflow(p.dp, p.tp, &world) || __builtin_mul_overflow(world, p.pp, &world)) {
    GPUCAST_USER_ERROR("parallel: dp={} x tp={} x pp={} is more ranks than can be counted", p.dp, p.tp, p.pp);
  }
  if (p.traced_world > 0 && world != p.traced_world) {
    GPUCAST_USER_ERROR("parallel: the probes ran as one rank of {} (traced_world) but dp={} x tp={} x pp={} is a world "
                       "of {}: describe the job the ranks run", p.traced_world, p.dp, p.tp, p.pp, world);
  }
  if (p.traced_world > 0 && p.pp > 1 && p.micro_batches > 1) {
    // A traced stage's step is the schedule's whole step: it splits the batch into its micro-batches itself.
    GPUCAST_USER_ERROR("parallel: micro_batches={} with a pipeline stage traced as one rank: its schedule splits each "
                       "step's batch into micro-batches itself; give them to the schedule, not to parallel",
                       p.micro_batches);
  }
  if (p.traced_world > 0 && p.traced_rank >= p.traced_world) {
    GPUCAST_USER_ERROR("parallel: traced_rank {} is not a rank of a world of {}", p.traced_rank, p.traced_world);
  }
  p.gradient_as_bucket_view = cfg.get_bool("gradient_as_bucket_view");
  p.broadcast_buffers = cfg.get_bool("broadcast_buffers");
  p.buffer_bytes = cfg.get_int("buffer_bytes");
  const std::string& cap = cfg.get_string("bucket_cap_mb");
  const std::optional<double> mb = parse_number(cap);
  if (!mb || !(*mb > 0) || !std::isfinite(*mb)) {
    GPUCAST_USER_ERROR("parallel: option 'bucket_cap_mb' expects a positive number of MiB, got '{}'", cap);
  }
  p.bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(std::llround(*mb * (1 << 20))));
  p.bucket_cap_given = cfg.was_set("bucket_cap_mb");
  const std::string& units = cfg.get_string("fsdp_units");
  if (!units.empty()) {
    for (size_t start = 0;;) {
      const size_t bar = units.find('|', start);
      std::string path = units.substr(start, bar == std::string::npos ? std::string::npos : bar - start);
      if (path.empty()) {
        GPUCAST_USER_ERROR("parallel: option 'fsdp_units' expects module paths separated by '|', got an empty one "
                           "in '{}'", units);
      }
      p.fsdp_units.push_back(std::move(path));
      if (bar == std::string::npos) break;
      start = bar + 1;
    }
    if (p.dp_mode != "fsdp") {
      GPUCAST_USER_ERROR("parallel: option 'fsdp_units' applies to dp_mode 'fsdp', got dp_mode '{}'", p.dp_mode);
    }
  }
  const std::string& reshard = cfg.get_string("reshard_after_forward");
  if (reshard.empty()) {
    p.reshard_after_forward = -1;
  } else if (reshard == "True" || reshard == "true") {
    p.reshard_after_forward = 1;
  } else if (reshard == "False" || reshard == "false") {
    p.reshard_after_forward = 0;
  } else {
    const std::optional<double> n = parse_number(reshard);
    // FSDP2 takes an int that divides the shard group's size, neither 1 nor the size itself (fully_shard's docs);
    // 1 means False and the size means True there, and are taken as such.
    if (!n || *n != std::floor(*n) || *n < 1 || *n > static_cast<double>(p.dp) ||
        p.dp % static_cast<int64_t>(*n) != 0) {
      GPUCAST_USER_ERROR("parallel: option 'reshard_after_forward' expects True, False or a number of ranks that "
                         "divides dp ({}), got '{}'", p.dp, reshard);
    }
    const auto ranks = static_cast<int64_t>(*n);
    p.reshard_after_forward = ranks == 1 ? 0 : ranks == p.dp ? 1 : ranks;
  }
  auto dtype_bytes = [&](const char* key) -> int64_t {
    std::string d = cfg.get_string(key);
    if (d.rfind("torch.", 0) == 0) d = d.substr(6);
    if (d.empty()) return 0;
    if (d == "bfloat16" || d == "float16" || d == "half") return 2;
    if (d == "float32" || d == "float") return 4;
    GPUCAST_USER_ERROR("parallel: option '{}' expects bfloat16, float16 or float32, got '{}'", key, cfg.get_string(key));
  };
  p.param_dtype_bytes = dtype_bytes("param_dtype");
  p.reduce_dtype_bytes = dtype_bytes("reduce_dtype");
  for (const char* key : {"param_dtype", "reduce_dtype"}) {
    if (cfg.was_set(key) && p.dp_mode != "fsdp") {
      GPUCAST_USER_ERROR("parallel: option '{}' applies to dp_mode 'fsdp', got dp_mode '{}'", key, p.dp_mode);
    }
  }
  if (cfg.was_set("reshard_after_forward") && p.dp_mode != "fsdp") {
    GPUCAST_USER_ERROR("parallel: option 'reshard_after_forward' applies to dp_mode 'fsdp', got dp_mode '{}'",
                       p.dp_mode);
  }
  return p;
}

}  // namespace gpucast
