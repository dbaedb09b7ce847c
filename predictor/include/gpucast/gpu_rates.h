// gpucast/gpu_rates.h: a GPU's step time priced from a traced iteration's work, without running on that GPU.
//
// The probes ran elsewhere (on this machine's CPU): their traces give each layer's work by kind of op and
// precision (layer_model.h: CostPart), not its time on the target. A table gives, per GPU and per kind and pass,
// the share of the GPU's peak FLOP/s and memory bandwidth its kernels reach and a fixed cost per kernel. One part
// of a layer takes
//   t = kernels * overhead * overhead_scale + max(flops / (flop_eff * peak), bytes / (byte_eff * bandwidth))
// with backward priced on twice the forward FLOPs and bytes (as layer_model.h prices it), and a layer takes the sum
// of its parts (its ops run one after the other). peak: the GPU's float32 rate; its TF32 tensor rate for matmuls
// when TF32 is allowed (torch.backends.cuda.matmul.allow_tf32) and for convolutions when cuDNN may use it (its
// default); its 16-bit tensor rate for float16 / bfloat16 parts. The optimizer step is priced as the bytes its ops
// read and write at the elementwise rate; the host's time between ops ("other") overlaps the GPU's queue and is
// priced 0.
//
// The shipped table (predictor/weights/gpu_rates.json, installed as data/gpu_rates.json beside lib/) is fitted by
// bench/gpu_rates.py on per-operator latencies measured on real GPUs; a GPU without measurements of its own takes
// the efficiencies of one of the same architecture (`fitted_on` says which), at its own peaks.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "gpucast/layer_model.h"
#include "gpucast/step_time.h"

namespace gpucast {

inline constexpr int kGpuRatesVersion = 1;

struct GpuPassRates {
  double flop_eff = 0;    // share of the peak FLOP/s, in (0, 1]
  double byte_eff = 0;    // share of the memory bandwidth, in (0, 4] (operands in the L2 cache beat memory)
  double overhead_s = 0;  // per kernel, >= 0
};

struct GpuKindRates {
  GpuPassRates forward, backward;
  std::string source;     // how it was fitted ("kind": on its own measurements; else what it was taken from)
};

struct GpuRates {
  std::string name;         // as gpucast's device table names it: "H100-80GB"
  double fp32_flops = 0;    // dense peaks, FLOP/s
  double tf32_flops = 0;
  double half_flops = 0;    // float16 / bfloat16 tensor cores
  double bytes_per_s = 0;   // memory bandwidth
  std::string fitted_on;    // the measurements the efficiencies come from
  std::array<GpuKindRates, kLayerCostKinds.size()> kinds;  // in kLayerCostKinds order
  // The per-kernel overheads as they weigh in a whole iteration, against one op timed alone (what the overheads
  // are fitted on): fitted on measured iterations; 1 where the table gives none.
  double overhead_scale = 1.0;
  // The host's time per op a step issues (dispatch, launch, the caching allocator: eager PyTorch on a GPU), from
  // the table's optional "host" entry (0: none) and where it was measured.
  double host_ns_per_op = 0;
  std::string host_source;
};

struct GpuPrecision {
  bool tf32_matmul = false;  // torch.backends.cuda.matmul.allow_tf32 (PyTorch's default: off)
  bool tf32_conv = true;     // torch.backends.cudnn.allow_tf32 (PyTorch's default: on)
};

// The table from its JSON text: {"format": "gpucast-gpu-rates", "version": 1, "gpus": [{"name", "fp32_tflops",
// "tf32_tflops", "half_tflops", "bandwidth_gbps", "fitted_on", "overhead_scale" (optional, in [0, 10]),
// "kinds": {kind: {"source", "forward": {"flop_eff", "byte_eff", "overhead_us"}, "backward": {...}}}}],
// "host" (optional): {"us_per_op" (in [0, 1000]), "source"}}, every kind of kLayerCostKinds present. Errors (UserError)
// name `origin` and the key: another format or version, a missing key, a rate outside its range, a duplicate GPU.
std::vector<GpuRates> parse_gpu_rates(const std::string& text, const std::string& origin);
// The same from a file; errors name the path (missing, unreadable, not the format).
std::vector<GpuRates> load_gpu_rates(const std::string& path);
std::string gpu_rates_to_json(const std::vector<GpuRates>& table);
// The entry named `name` (case-insensitive), or nullptr.
const GpuRates* find_gpu_rates(const std::vector<GpuRates>& table, const std::string& name);
// $GPUCAST_GPU_RATES, else data/gpu_rates.json beside the directory of the library holding this code.
std::string default_gpu_rates_path();
// data/gpu_rates.json beside that library, whatever $GPUCAST_GPU_RATES says (the fallback for a table of the
// user's that cannot be used).
std::string shipped_gpu_rates_path();

// One part's time in one pass (Phase::Backward: doubled FLOPs and bytes), ns.
double gpu_part_ns(const CostPart& part, const GpuRates& gpu, Phase pass, const GpuPrecision& precision = {});
// A layer's parts; a layer recorded without parts (no shapes) is priced as one part of its cost kind.
double gpu_layer_ns(const LayerTiming& layer, const GpuRates& gpu, Phase pass, const GpuPrecision& precision = {});

// The probe's iteration as the GPU would run it: every layer's forward and backward priced (their kernels' overheads
// also as the layer's fixed time, which tensor parallelism does not divide), the optimizer from its
// bytes (without them, from 4 bytes per gradient byte read and 3 written: Adam's parameter, gradient and two
// moments), other 0, wall the sum; clock "gpu-table". The tracer's own cost is not in these times.
IterationTiming price_on_gpu(const IterationTiming& probe, const GpuRates& gpu, const GpuPrecision& precision = {});

// The layers' work at another batch size (and sequence length, seq > 0, from probes recorded at several): per
// layer, each part's FLOPs and bytes and the layer's totals and output bytes fitted over the probes' sizes
// (step_time.h: fit_size), edges' bytes proportional to the tokens; kernels, gradients and everything else from
// the largest probe. Times are the largest probe's (price_on_gpu replaces them).
IterationTiming work_at_batch(const std::vector<IterationTiming>& probes, int64_t batch, int64_t seq = 0);

// The step on the GPU from probes that ran elsewhere: the work at the rank's micro-batch (work_at_batch) priced
// (price_on_gpu), then step_time.h's model (parallelism, communication) with every layer used (time_fraction and
// time_scale ignored). A GPU's time is not affine in the batch where the work is: a matmul bound by reading its
// weights at a probe's batch is compute-bound at the target's. Layers' source is "gpu-table"; a note says what
// the prices rest on.
StepTimeForecast forecast_step_time_on_gpu(const std::vector<IterationTiming>& probes, StepTimeOptions options,
                                           const GpuRates& gpu, const GpuPrecision& precision = {});

}  // namespace gpucast
