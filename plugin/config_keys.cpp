#include "config_keys.h"

#include <cstdint>
#include <string>

namespace gpucast {

std::vector<ConfigKey> trace_config_keys() {
  using F = ConfigKey::Form;
  return {
      {"record_shapes", F::Bool, true, {}, "record shapes, strides, dtypes and devices of op inputs and outputs"},
      {"memory", F::Bool, true, {}, "record allocations and frees (CPU allocator wrapper, CUDA caching allocator)"},
      {"module_paths", F::Bool, true, {}, "attribute ops to module paths through global module forward hooks"},
      {"nested_ops", F::Bool, true, {},
       "record ops nested in another op; False: count them in the enclosing op instead (the forecast's timing "
       "traces), except those a backward node links to"},
      // 2,000,000 ops and 4,000,000 events: chosen bounds (as TracerOptions' in tracer.h), not measured.
      {"max_ops", F::PositiveInt, int64_t{2000000}, {}, "bound on recorded ops; more are counted as dropped"},
      {"max_events", F::PositiveInt, int64_t{4000000}, {}, "bound on recorded memory events; more are counted as dropped"},
      {"device_timing", F::Bool, true, {}, "time device work (CUPTI, else CUDA events) where a CUDA device is present"},
      {"external_profiler", F::Bool, false, {},
       "another client records CUDA activity (set by gpucast.trace() while torch.profiler runs): leave CUPTI alone"},
      {"autograd_tags", F::Bool, true, {},
       "categorize from autograd on the thread that starts the trace (parameters, gradients, inputs, optimizer "
       "state); gpucast.trace() sets False: its hooks tag them"},
  };
}

std::vector<ConfigKey> auto_config_keys() {
  using F = ConfigKey::Form;
  ConfigKey capacity{"capacity_mb", F::NonNegativeInt, int64_t{0}, {},
                     "device memory in MiB, overriding the table's; with it any target name is accepted (0: the "
                     "table's)"};
  // 2^24 MiB (16 TiB): a chosen bound, far above any device's memory.
  capacity.max_int = int64_t{1} << 24;
  // 0.9: a chosen default, a tenth of the capacity kept for what the forecast does not count. 0.01: a chosen floor;
  // below it every run would be a risk.
  ConfigKey warn{"warn_fraction", F::Fraction, 0.9, {}, "warn when the forecast exceeds this fraction of capacity"};
  warn.min_fraction = 0.01;
  // 1,000,000 ops and 600 s: chosen bounds on the first iteration (a 70B model's iteration records some 10^5 ops),
  // so that a process that never ends an iteration (a data-loading worker) stops its trace.
  ConfigKey max_ops{"max_iteration_ops", F::PositiveInt, int64_t{1000000}, {},
                    "a first iteration that records more ops without ending is not traced further (one note)"};
  ConfigKey max_s{"max_iteration_s", F::PositiveInt, int64_t{600}, {},
                  "a first iteration that runs longer without ending is not traced further (one note)"};
  max_s.max_int = int64_t{1} << 31;
  return {
      {"enabled", F::Bool, false, {}, "trace the first iteration by itself, forecast the run, warn on risk"},
      {"target", F::String, std::string("auto"), {},
       "cpu, a device table name (python -m gpucast devices), or auto: this process's GPU, else cpu"},
      capacity,
      warn,
      {"on_risk", F::Choice, std::string("warn"), {"warn", "raise"}, "warn once, or raise before iteration 2"},
      {"verbose", F::Bool, false, {}, "also print one line on stderr when the run fits"},
      {"iteration_scope", F::String, std::string(""), {},
       "a RecordFunction scope (RECORD_USER_SCOPE, torch.profiler.record_function) whose end ends the iteration, "
       "besides the optimizer's step and gpucast.iteration_end"},
      max_ops,
      max_s,
  };
}

}  // namespace gpucast
