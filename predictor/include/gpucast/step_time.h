// gpucast/step_time.h: the step time of a training iteration at a target batch size and data-parallel degree,
// from traced probe iterations at small batch sizes.
//
// Per layer (a leaf module path) and phase (forward, backward), the probes' times are fitted with
// t(b) = a + c * b (least squares over the probe batch sizes, a and c kept >= 0) and evaluated at the per-rank
// target batch; the optimizer step is taken as independent of the batch; the rest of the iteration (Python,
// the loss, zero_grad: "other") is fitted like a layer. With data parallelism (DDP), gradients are reduced in
// buckets filled in the order backward produces them (the first bucket 1 MiB, then 25 MiB, as DDP does after its
// first iteration): a bucket's all-reduce starts when its last gradient is ready and the previous all-reduce
// has finished, and costs the ring all-reduce time of comm_model.h; what outlasts backward is exposed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpucast/comm_model.h"
#include "gpucast/trace.h"

namespace gpucast {

struct LayerTiming {
  std::string layer;          // module path; "(outside modules)" for ops outside any module
  double forward_ns = 0;
  double backward_ns = 0;
  int64_t grad_bytes = 0;     // gradients produced by the layer's backward
  int64_t backward_order = 0;  // rank of the layer's first backward op in the iteration (reduction order)
};

struct IterationTiming {
  int64_t batch = 0;
  double wall_ns = 0;         // first op of the iteration to the end of its optimizer step
  double optimizer_ns = 0;
  double other_ns = 0;        // wall - layers - optimizer
  std::vector<LayerTiming> layers;  // in forward order
  std::string clock;          // "device" when device times were recorded, else "cpu"
};

// The last complete iteration of a trace (between the last two optimizer steps; the whole trace with one).
IterationTiming iteration_timing(const Trace& t, int64_t batch);

struct StepTimeOptions {
  int64_t batch_size = 0;     // global
  int64_t dp = 1;
  std::string dp_mode = "ddp";
  bool have_link = false;
  Link link;                  // all-reduce link (gpucast.calibrate() or a device table)
  int64_t first_bucket_bytes = int64_t{1} << 20;
  int64_t bucket_bytes = int64_t{25} << 20;
  // Untraced over traced time of an iteration, measured in the same process: the tracer's own cost is taken out
  // of every probe's compute times (1: none).
  double time_scale = 1.0;
};

struct LayerForecast {
  std::string layer;
  double forward_ms = 0;
  double backward_ms = 0;
  int64_t grad_bytes = 0;
};

struct BucketForecast {
  int64_t bytes = 0;
  double ready_ms = 0;        // from the start of the step
  double start_ms = 0;
  double end_ms = 0;
};

struct StepTimeForecast {
  int64_t batch_size = 0;
  int64_t per_rank_batch = 0;
  int64_t dp = 1;
  double step_ms = 0;
  double compute_ms = 0;      // forward + backward + optimizer + other
  double forward_ms = 0;
  double backward_ms = 0;
  double optimizer_ms = 0;
  double other_ms = 0;
  double comm_ms = 0;         // all-reduce time in all
  double exposed_comm_ms = 0;  // communication not hidden behind backward
  std::vector<LayerForecast> per_layer;
  std::vector<BucketForecast> buckets;
  std::string clock;
  std::vector<std::string> notes;
};

// Errors (UserError) name the option: dp below 1, an unknown dp_mode, no probes, a batch below dp.
StepTimeForecast forecast_step_time(const std::vector<IterationTiming>& probes, const StepTimeOptions& o);
std::string step_time_to_json(const StepTimeForecast& f);
std::string iteration_timing_to_json(const IterationTiming& t);
IterationTiming iteration_timing_from_json(const std::string& text);

}  // namespace gpucast
