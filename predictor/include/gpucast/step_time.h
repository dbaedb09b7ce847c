// gpucast/step_time.h: the step time of a training iteration at a target batch size and data-parallel degree,
// from traced probe iterations at small batch sizes.
//
// Per layer (a leaf module path) and phase (forward, backward), the probes' times are fitted with
// t(b) = a + c * b (least squares over the probe batch sizes, a and c kept >= 0; with a target sequence length,
// t = a + c * b * L + d * b * L^2 over probes at several lengths: fit_size) and evaluated at the per-rank
// target batch (only on the probes that ran the same kernels as the largest one in that layer: the same number
// of recorded ops); the optimizer step is taken as independent of the batch; the rest of the iteration (Python,
// the loss, zero_grad: "other") is fitted like a layer. With data parallelism (DDP), gradients are reduced in
// buckets filled in the order backward produces them (the first bucket 1 MiB, then 25 MiB, as DDP does after its
// first iteration): a bucket's all-reduce starts when its last gradient is ready and the previous all-reduce
// has finished, and costs the ring all-reduce time of comm_model.h; what outlasts backward is exposed.
//
// Other strategies (parallel.h), each rank running batch / (dp * micro_batches) samples per micro-batch:
//  - zero1 / zero2: gradients reduce-scattered in the same buckets, the optimizer step on 1/dp of the
//    parameters, then the updated parameters all-gathered (exposed).
//  - fsdp (ZeRO-3): every layer with parameters is a unit whose parameters are all-gathered before its forward
//    and again before its backward (the next unit's gather is issued when the current unit's compute starts:
//    prefetch), and whose gradients are reduce-scattered after its backward; one communication stream.
//  - tp (Megatron): matmul layers with parameters pair up, column-parallel then row-parallel; they, every
//    layer between them (on sharded activations: attention, activation functions), other matmuls and
//    embeddings run 1/tp of their time (less its fixed part: LayerTiming::forward_fixed_ns), the rest (norms,
//    residuals, dropout outside pairs) is replicated. After each row-parallel layer and each embedding forward
//    all-reduces the layer's output; backward all-reduces the same bytes for every pair; on the critical path.
//  - pp: the layers split into pp contiguous stages of balanced time; 1F1B over micro_batches m gives
//    sum over stages (f + b) + (m - 1) * max stage (f + b) + the point-to-point sends of one micro-batch's
//    activations there and back (each send priced from the link's measured sends where it has them); each stage
//    runs its share of the step's rest (by its layers' ops) after each pass; data-parallel reduction after the
//    pipeline drains (exposed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpucast/comm_model.h"
#include "gpucast/layer_model.h"
#include "gpucast/note.h"
#include "gpucast/parallel.h"
#include "gpucast/trace.h"

namespace gpucast {

struct LayerTiming {
  std::string layer;          // module path; "(outside modules)" for ops outside any module
  double forward_ns = 0;
  double backward_ns = 0;
  int64_t grad_bytes = 0;     // gradients produced by the layer's backward
  int64_t backward_order = 0;  // rank of the layer's first backward op in the iteration (reduction order)
  std::string kind = "other";  // "matmul", "embedding", "conv" or "other": what tensor parallelism splits
  int64_t out_bytes = 0;      // output of the layer's last forward op (what tp all-reduces, pp sends)
  // Cost features (layer_model.h): the kind of its costliest op, forward FLOPs, bytes and top-level ops.
  std::string cost_kind = "elementwise";
  double flops = 0;
  double bytes = 0;
  int64_t ops = 0;
  // Every recorded op whose cost lands in the layer's forward / backward time (nested ones included).
  int64_t forward_ops_all = 0;
  int64_t backward_ops_all = 0;
  std::vector<CostPart> parts = {};  // flops and bytes by op kind and precision (layer_model.h)
  std::vector<CostPart> recompute = {};  // the forward ops backward runs again (LayerCost::recompute)
  // The part of each time that tensor parallelism does not divide: every rank still launches every kernel of
  // the layer (gpu_rates.h sets it to the kernels' overheads; 0 for measured times, which are divided whole).
  double forward_fixed_ns = 0;
  double backward_fixed_ns = 0;
  // One of the layers the trace was asked to time (Trace::timed_layers; every layer when it names none). The
  // forecast uses the times of timed layers only and predicts the others (sparse timing).
  bool timed = true;
};

// Bytes passed from one layer to another in forward (a tensor one layer produced and another consumed).
struct LayerEdge {
  int64_t src = 0;            // index in IterationTiming::layers
  int64_t dst = 0;
  int64_t bytes = 0;
};

struct IterationTiming {
  int64_t batch = 0;
  double wall_ns = 0;         // first op of the iteration to the end of its optimizer step
  double optimizer_ns = 0;
  double other_ns = 0;        // wall - layers - optimizer
  std::vector<LayerTiming> layers;  // in forward order
  std::vector<LayerEdge> edges;     // the layer graph, sorted by (src, dst)
  std::string clock;          // "device" when device times were recorded, else "cpu"
  int64_t ops_total = 0;      // ops in the iteration (recorded, and counted in them: OpRecord::nested)
  int64_t optimizer_ops = 0;
  int64_t other_ops = 0;
  // Ops outside the optimizer step that would launch work on a GPU: recorded ops with no op recorded inside them,
  // neither views nor metadata nor bare allocations (aten::view, aten::t, aten::empty, ...). -1: not known (a
  // trace that counted nested ops without recording them).
  int64_t launch_ops = -1;
  // The same step run without the tracer (wall time, measured by the caller; -1: not measured). The tracer's
  // cost, wall_ns - untraced_wall_ns, is then taken out of every unit in proportion to its recorded ops.
  double untraced_wall_ns = -1;
  // Convolutions on PyTorch's CPU im2col path (aten::thnn_conv2d, aten::slow_conv3d), which it takes for 1x1,
  // stride-1 kernels on one thread below batch 16 and runs through mkldnn from 16 on: probes below 16 then
  // time another kernel than a larger target runs (gpucast.forecast adds probes at 16 and above).
  int64_t im2col_conv_ops = 0;
  // Bytes the optimizer step's own ops read and write (its direct children; 0 without shapes).
  double optimizer_bytes = 0;
  // The probe's sequence length where the forecast scales by it (the caller sets it; 0: not recorded).
  int64_t seq = 0;
  // Priced for a GPU (clock "gpu-table"): the host's time to issue the step's ops there, the rates table's cost
  // per launching op times launch_ops (-1: the table gives none, or launch_ops is not known). Not serialized.
  double host_ns = -1;
};

// A quantity measured at one probe's size.
struct SizedValue {
  double batch = 0;
  double seq = 0;    // 0: no sequence length
  double value = 0;
};

// The quantity at another size. With a target seq > 0 and points at two or more lengths: value = a + c * b * L +
// d * b * L^2 (tokens, and attention's pairs of tokens) fitted by least squares with a, c, d >= 0 (the best of
// the fits on each subset of the three terms whose coefficients are all >= 0). Otherwise over the batch:
// a + c * b, a and c >= 0 (c < 0: the mean; a < 0: through the origin); one point: proportional to the batch
// (to the tokens when both have a length). No points: 0.
double fit_size(const std::vector<SizedValue>& pts, double batch, double seq = 0);

// The last complete iteration of a trace (between the last two optimizer steps; the whole trace with one).
IterationTiming iteration_timing(const Trace& t, int64_t batch);

// Whether `l` ran a backward pass in `it`: false for a layer with no recorded backward op in an iteration whose
// other layers have some (frozen parameters and no input needing a gradient: fine-tuning a head); predicted and
// GPU-priced backward times of such a layer are 0. An iteration with no backward op attributed to any layer (a
// trace recorded without forward/backward links) says true for every layer.
bool layer_runs_backward(const IterationTiming& it, const LayerTiming& l);

// Times from a light trace (no shapes, no memory events: the tracer's cost per op is about half) joined with the
// structure of the same step from a full trace: each layer of `timing` takes from the layer of the same name in
// `structure` what needs shapes or allocations (cost kind, FLOPs, bytes, cost ops, output and gradient bytes)
// and the edges between layers present in both, and the optimizer's bytes. Times, op counts and kernel counts
// stay `timing`'s. A layer `structure` lacks keeps zero costs (the layer models then price it by its op count).
IterationTiming with_structure(IterationTiming timing, const IterationTiming& structure);

// Several light traces of the same step as one: each layer's forward and backward time, the optimizer's, the rest
// of the step's, the wall and the untraced wall (where every run has one; -1 otherwise) each the median over the
// runs (of an even count, the mean of the middle two), which a pause of the machine in one run or another does not
// move; everything else from the first run. Also combines timing rounds of a probe (forecast's timing_rounds). The runs must
// have the same layers in the same order (the same step traced again); otherwise a UserError names the run and
// the first layer that differs.
IterationTiming median_timing(const std::vector<IterationTiming>& runs);

// The layers of `t` to time (sparse timing): the `fraction` of them (at least one) chosen by a "d-optimal" design
// over their cost features (layer_model.h: choose_layers_to_time) or a "random" one; in `t`'s forward order.
// time_budget < 1 also bounds the chosen layers' share of the iteration's layer time (their forward and backward
// times in `t` against every layer's): the largest design within it (bisection over the design's size), else the
// layer that takes least time. UserError for a fraction or budget outside (0, 1] or another design.
std::vector<std::string> choose_timed_layers(const IterationTiming& t, double fraction,
                                             const std::string& design = "d-optimal", uint64_t seed = 0,
                                             double time_budget = 1.0);

// FSDP's units (ParallelConfig::fsdp_units) over `layers` (module paths) holding `bytes` of parameters each: each
// given path with the layers inside it (the innermost unit holds a layer), every other layer the root unit's (a
// path without a dot names the root itself); without paths, every layer with parameters is a unit. UserError for
// a path that holds no layer.
struct FsdpUnits {
  std::vector<int64_t> unit_of;  // per layer: its unit (-1: none, a layer without parameters when no units are given)
  std::vector<double> bytes;     // per unit: its layers' parameters
  int64_t root = -1;             // the root unit; -1 without units
};
FsdpUnits fsdp_units(const std::vector<std::string>& layers, const std::vector<double>& bytes,
                     const std::vector<std::string>& paths);

struct StepTimeOptions {
  int64_t batch_size = 0;     // global
  ParallelConfig parallel;
  Topology topology;          // links: gpucast.calibrate() or the interconnect table
  // DDP's first bucket where parallel.bucket_cap_mb is not given (the rest: parallel.bucket_bytes)
  // torch 2.14.1: kDefaultFirstBucketBytes, torch/csrc/distributed/c10d/reducer.hpp:30.
  int64_t first_bucket_bytes = int64_t{1} << 20;
  // Untraced over traced time of an iteration, measured in the same process: the tracer's own cost is taken out
  // of every probe's compute times (1: none).
  double time_scale = 1.0;
  // Sparse timing: the fraction of layers whose times are used (1: all), chosen by a "d-optimal" or "random"
  // design; the others are predicted by per-kind roofline models fitted on them, from `prior` where a kind
  // has no timed layer: priced at each probe's batch (where the models were fitted), then fitted over the batch
  // like measured layers. Probes traced with a choice of layers (LayerTiming::timed false for some layers of
  // the largest probe) bring their own: those layers are the timed ones, whatever time_fraction says, unless
  // every_layer: then the choice is set aside and time_fraction applies to all layers (CPU clocks time every op;
  // UserError for probes timed on the device, which timed only the chosen layers' ops).
  double time_fraction = 1.0;
  double time_budget = 1.0;  // and at most this share of the largest probe's layer time (choose_timed_layers)
  bool every_layer = false;
  std::string design = "d-optimal";
  uint64_t design_seed = 0;
  // A chosen prior, not a measurement: the fit starts from a grid of 10^-4 to 10^2 times it (layer_model.cpp kGridLo).
  DeviceRates prior{5e10, 1e10, 5e-6};  // a CPU core: 50 GFLOP/s, 10 GB/s, 5 us per op
  // Target sequence length: > 0 scales every fit by length too (fit_size), from probes recorded at several
  // lengths (IterationTiming::seq); 0: by batch only.
  int64_t seq_len = 0;
};

struct LayerForecast {
  std::string layer;
  double forward_ms = 0;
  double backward_ms = 0;
  int64_t grad_bytes = 0;     // per rank
  double tp_comm_ms = 0;      // tensor-parallel all-reduces of this layer (forward and backward)
  int64_t stage = 0;          // pipeline stage
  std::string source = "measured";  // or how the layer model predicted it (layer_model.h)
};

// One collective or send of the forecast step, on its stream, in ms from the step's start.
struct CommForecast {
  std::string kind;           // dp_allreduce, dp_reduce_scatter, dp_all_gather, dp_broadcast_buffers,
                              // fsdp_all_gather, fsdp_reduce_scatter, tp_allreduce, pp_send
  int64_t bytes = 0;
  double start_ms = 0;
  double end_ms = 0;
  int64_t stage = 0;          // the pipeline stage that issues it (pp_send: the sender)
};

// One span of the forecast step's compute, on its stage's stream, in ms from the step's start: a layer's forward
// or backward pass at one micro-batch (name "<layer> forward"), or where the layers times the micro-batches are
// too many to draw, a whole pass ("forward (micro-batch 3)"); "other" (loss, zero_grad, Python; with pipeline
// stages each stage's share by its layers' recorded ops, after each of its passes) and the optimizer step.
// Tensor-parallel all-reduces between them are in `comm`.
struct ComputeSpan {
  std::string name;
  std::string kind;           // forward, backward, other, optimizer
  int64_t micro_batch = 0;
  int64_t stage = 0;
  double start_ms = 0;
  double end_ms = 0;
};

struct BucketForecast {
  int64_t bytes = 0;
  double ready_ms = 0;        // from the start of the step
  double start_ms = 0;
  double end_ms = 0;
  double idle_ms = 0;         // the compute since the group's previous collective (slows it where cores are shared)
};

struct StepTimeForecast {
  int64_t batch_size = 0;
  int64_t per_rank_batch = 0;
  int64_t dp = 1, tp = 1, pp = 1, micro_batches = 1;
  std::string dp_mode = "ddp";
  double step_ms = 0;
  double compute_ms = 0;      // forward + backward + optimizer + other (pp: the slowest stage's rank)
  // forward_ms, backward_ms: every layer's, all micro-batches (pp: over all stages)
  double forward_ms = 0;
  double backward_ms = 0;
  double optimizer_ms = 0;
  double other_ms = 0;
  // With device clocks or a priced host: the host's time to issue one micro-batch's ops (the longer of it and
  // the kernels is the micro-batch's compute); -1: not known.
  double host_ms = -1;
  double comm_ms = 0;         // time of every collective and send
  double exposed_comm_ms = 0;  // communication on the critical path (not hidden behind compute)
  double tp_comm_ms = 0;       // tensor-parallel all-reduces of a rank (pp: the slowest stage's), every micro-batch
  double pp_comm_ms = 0;       // pipeline sends of the stage that sends most, every micro-batch
  // pp: what the slowest stage's rank waits beside its own work (fill, drain and the sends it waits for):
  // step = compute + exposed_comm + bubble
  double bubble_ms = 0;
  int64_t timed_layers = -1;  // layers whose measured times were used (-1: all)
  std::vector<LayerForecast> per_layer;
  std::vector<BucketForecast> buckets;  // DDP / ZeRO buckets
  std::vector<CommForecast> comm;
  std::vector<ComputeSpan> compute;     // the step's compute laid out (what save_timeline draws)
  std::string clock;
  std::vector<Note> notes;
  // The graph network's correction (step_gnn.h: correct_step_time), ScaleDL's alpha for the compute and beta for the
  // exposed communication: step_ms, compute_ms and exposed_comm_ms include it (the per-layer and per-phase times do
  // not); uncorrected_step_ms is the schedule's step without it. correction: "gnn", or "none[: why not]".
  double alpha = 1;
  double beta = 1;
  std::string correction = "none";
  double uncorrected_step_ms = 0;
};

// Errors (UserError) name the option: degrees below 1, an unknown dp_mode, no probes, a batch below
// dp * micro_batches, more stages than layers. A collective without a known link is left out, with a note.
StepTimeForecast forecast_step_time(const std::vector<IterationTiming>& probes, const StepTimeOptions& o);
std::string step_time_to_json(const StepTimeForecast& f);
std::string iteration_timing_to_json(const IterationTiming& t);
IterationTiming iteration_timing_from_json(const std::string& text);

}  // namespace gpucast
