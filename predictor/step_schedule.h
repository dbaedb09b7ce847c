// step_schedule.h (predictor, private): the step-time forecast by parts. forecast_step_time (step_time.cpp)
// composes them:
//   1. fit_probes (step_fit.cpp): the probes' times, the tracer's cost taken out, fitted per layer over the batch
//      (sparse timing: the untimed layers from per-kind models), the optimizer's and the rest's time;
//   2. lay_out_layers (step_layers.cpp): each layer at the rank's micro-batch (host contention, tensor
//      parallelism's split and all-reduces), pipeline stages, the optimizer's share, a host-bound step's rest,
//      DDP's and FSDP's own overheads: one StepSchedule;
//   3. one schedule per strategy fills the schedule's timeline and the step's end: schedule_pipeline
//      (schedule_pipeline.cpp, 1F1B), schedule_fsdp (schedule_fsdp.cpp), schedule_ddp_zero (schedule_ddp_zero.cpp,
//      DDP and ZeRO-1/2, and a single rank).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpucast/comm_model.h"
#include "gpucast/layer_model.h"
#include "gpucast/parallel.h"
#include "gpucast/step_time.h"

namespace gpucast::detail {

// Per layer: its forward and backward points over the probes.
using LayerPoints = std::unordered_map<std::string, std::pair<std::vector<SizedValue>, std::vector<SizedValue>>>;

// What the probes say, fitted. Invariant: probes is not empty and probes[ref] is the largest probe (most samples,
// or tokens where the forecast scales by sequence length; the first of equals).
struct StepFits {
  StepTimeForecast f;  // batch and strategy fields, clock, notes so far, timed_layers, other_ms
  std::vector<IterationTiming> probes;  // the tracer's cost taken out
  size_t ref = 0;
  int64_t seq_len = 0;  // the target's sequence length (0: scaled by batch only)
  double b = 0;         // the rank's micro-batch
  double m = 1;         // micro-batches
  double seq = 0;       // seq_len as a double
  double k = 1;         // time_scale
  LayerPoints pts;        // measured times of the layers that ran the largest probe's kernels
  LayerPoints fixed_pts;  // the part of those times tensor parallelism does not divide
  std::unordered_map<std::string, LayerForecast> modelled;  // untimed layers at the target (sparse timing)
  double optimizer_ns = 0;  // the optimizer step at the probe nearest the target

  const IterationTiming& largest() const { return probes[ref]; }
  // A probe's size: samples, or tokens where the forecast scales by sequence length.
  double tokens(const IterationTiming& p) const {
    return static_cast<double>(p.batch) * (seq_len > 0 ? static_cast<double>(p.seq) : 1.0);
  }
};

StepFits fit_probes(const std::vector<IterationTiming>& traced, const StepTimeOptions& o);

// The step's layers at the target and their timeline's helpers. Layer indices follow f.per_layer (the largest
// probe's forward order).
struct StepSchedule {
  StepSchedule(StepTimeForecast forecast, const StepTimeOptions& options, const IterationTiming& largest)
      : f(std::move(forecast)), P(options.parallel), T(options.topology), ref(largest) {}

  StepTimeForecast f;
  const ParallelConfig& P;
  const Topology& T;
  const IterationTiming& ref;  // the largest probe
  int64_t first_bucket_bytes = 0;
  double m = 1;        // micro-batches
  int64_t mbs = 1;     // the same, as a count
  const Link* dp_link = nullptr;
  const Link* pp_link = nullptr;
  std::vector<double> tp_fw_ms, tp_bw_ms;  // per layer: its tensor-parallel all-reduces
  std::vector<double> tp_bytes;            // what a layer's tensor-parallel all-reduce moves
  std::vector<size_t> forward_layers, backward_layers;  // layer indices in each pass's order
  std::vector<double> stage_fw, stage_bw;  // per pipeline stage: one micro-batch's passes (all-reduces included)
  std::vector<int64_t> send_bytes;         // per stage: what it sends the next one
  int64_t rank_grad = 0;      // gradient bytes of the slowest-to-reduce rank (its stage's)
  int64_t all_rank_grad = 0;  // gradient bytes of every stage
  bool sharded = false;       // dp_mode other than ddp: gradients reduce-scattered
  bool drifts = false;        // ranks sharing cores drift apart (Topology::drift_*)
  double drift_rate = 0;      // the ranks' drift per ms of this step's compute
  FsdpUnits units;            // dp_mode fsdp
  double bcast_ms = 0;        // DDP's broadcast of the buffers before the first forward
  bool layer_spans = true;    // the timeline draws each layer's passes (else each pass whole)

  // A collective or send on the communication stream from start_ms, us long; returns its end.
  double add_comm(const char* kind, double bytes, double start_ms, double us, int64_t stage = 0);
  // A compute span from start, ms long; returns its end.
  double span(std::string name, const char* kind, int64_t mb, int64_t stage, double start, double ms);
  // One micro-batch's forward (or backward) pass over `layers` from `t`, each layer followed by its
  // tensor-parallel all-reduce; done(i, end) after each. Returns the pass's end.
  double run_pass(const std::vector<size_t>& layers, bool backward, int64_t mb, int64_t stage, double t,
                  const std::function<void(size_t, double)>& done = {});
  // Data-parallel gradient reduction of `bytes` (all-reduce, or reduce-scatter when sharded). idle_ms: the compute
  // since the group's previous collective (< 0: unknown), which slows a collective on a host whose ranks share the
  // cores (Link::late_samples).
  double reduce_us(double bytes, double idle_ms = -1.0) const;
  const char* reduce_kind() const { return sharded ? "dp_reduce_scatter" : "dp_allreduce"; }
};

inline constexpr const char* kOtherSpan = "other (loss, zero_grad, Python)";
// A forecast's timeline draws each layer's passes up to this many compute spans, each pass whole beyond.
inline constexpr size_t kMaxLayerSpans = 20000;

// Helpers shared by the parts (step_time.cpp, step_fit.cpp).
// Contiguous split of `cost` into `parts` stages minimizing the slowest stage (binary search on the bound).
std::vector<int64_t> balanced_stages(const std::vector<double>& cost, int64_t parts);
// What the layer models (layer_model.h) and the design see of a layer.
LayerCost layer_cost(const LayerTiming& l);
// The indices of choose_timed_layers' choice in t's layers; UserError for a fraction, budget or design it cannot take.
std::vector<size_t> choose_timed_indices(const IterationTiming& t, double fraction, const std::string& design,
                                         uint64_t seed, double budget);
// The device time of a timing's layers and optimizer step (its kernels', with device clocks).
double kernel_ns(const IterationTiming& p);

StepSchedule lay_out_layers(StepFits& fits, const StepTimeOptions& o);

void schedule_pipeline(StepSchedule& s);
void schedule_fsdp(StepSchedule& s);
void schedule_ddp_zero(StepSchedule& s);

}  // namespace gpucast::detail
