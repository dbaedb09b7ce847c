#include "gpucast/gpu_rates.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gpucast/config.h"
#include "gpucast/shipped_data.h"
#include "gpucast/error.h"
#include "gpucast/json_input.h"

namespace gpucast {

using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "gpucast-gpu-rates";

// A number at `key` of object `j` within [lo, hi] (hi < 0: no upper bound); errors name where and what.
double number(const json& j, const std::string& key, const std::string& where, double lo, double hi,
              bool lo_open = false) {
  if (!j.is_object() || !j.contains(key)) GPUCAST_USER_ERROR("{}: missing key '{}'", where, key);
  const json& v = j.at(key);
  if (!v.is_number()) GPUCAST_USER_ERROR("{}: '{}' should be a number, got {}", where, key, json_excerpt(v));
  const double x = v.get<double>();
  const bool below = lo_open ? !(x > lo) : !(x >= lo);
  if (below || (hi >= 0 && x > hi) || !std::isfinite(x)) {
    GPUCAST_USER_ERROR("{}: '{}' should be in {}{}, {}], got {}", where, key, lo_open ? "(" : "[", lo,
                       hi >= 0 ? fmt::format("{}", hi) : std::string("inf"), x);
  }
  return x;
}

std::string text(const json& j, const std::string& key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) GPUCAST_USER_ERROR("{}: missing key '{}'", where, key);
  if (!j.at(key).is_string()) GPUCAST_USER_ERROR("{}: '{}' should be a string, got {}", where, key, json_excerpt(j.at(key)));
  return j.at(key).get<std::string>();
}

GpuPassRates pass_rates(const json& j, const std::string& where) {
  if (!j.is_object()) GPUCAST_USER_ERROR("{}: should be an object, got {}", where, json_excerpt(j));
  return {number(j, "flop_eff", where, 0, 1, true), number(j, "byte_eff", where, 0, 4, true),
          number(j, "overhead_us", where, 0, 1e6) / 1e6};
}

json pass_json(const GpuPassRates& p) {
  return {{"flop_eff", p.flop_eff}, {"byte_eff", p.byte_eff}, {"overhead_us", p.overhead_s * 1e6}};
}

}  // namespace

std::vector<GpuRates> parse_gpu_rates(const std::string& body, const std::string& origin) {
  const json j = parse_json_input(body, origin);
  if (!j.is_object() || !j.contains("format") || j.at("format") != kFormat) {
    GPUCAST_USER_ERROR("{}: not a gpucast GPU rates table: expected \"format\": \"{}\"", origin, kFormat);
  }
  if (!j.contains("version") || json_integer(j.at("version"), kGpuRatesVersion, kGpuRatesVersion) == std::nullopt) {
    GPUCAST_USER_ERROR("{}: GPU rates table version {}, this gpucast reads version {}: regenerate it with "
                       "bench/gpu_rates.py",
                       origin, j.contains("version") ? json_excerpt(j.at("version")) : std::string("(missing)"),
                       kGpuRatesVersion);
  }
  if (!j.contains("gpus") || !j.at("gpus").is_array()) GPUCAST_USER_ERROR("{}: missing list 'gpus'", origin);
  double host_ns_per_op = 0;
  std::string host_source;
  if (j.contains("host")) {
    const std::string where = origin + ": host";
    host_ns_per_op = number(j.at("host"), "us_per_op", where, 0, 1000) * 1e3;
    host_source = text(j.at("host"), "source", where);
  }
  std::vector<GpuRates> out;
  for (size_t i = 0; i < j.at("gpus").size(); ++i) {
    const json& g = j.at("gpus")[i];
    const std::string where = fmt::format("{}: gpus[{}]", origin, i);
    GpuRates r;
    r.name = text(g, "name", where);
    const std::string here = fmt::format("{} ('{}')", where, r.name);
    if (find_gpu_rates(out, r.name) != nullptr) GPUCAST_USER_ERROR("{}: GPU '{}' listed twice", here, r.name);
    // 1e6 TFLOPS and 1e6 GB/s: chosen bounds, about 500 times the fastest GPU's (B200: 2.25 dense 16-bit PFLOPS,
    // 8 TB/s), so that a rate times its unit stays finite (1.8e308 TFLOPS read as FLOP/s is infinite).
    constexpr double kMaxTflops = 1e6, kMaxGbps = 1e6;
    r.fp32_flops = number(g, "fp32_tflops", here, 0, kMaxTflops, true) * 1e12;
    r.tf32_flops = number(g, "tf32_tflops", here, 0, kMaxTflops, true) * 1e12;
    r.half_flops = number(g, "half_tflops", here, 0, kMaxTflops, true) * 1e12;
    r.bytes_per_s = number(g, "bandwidth_gbps", here, 0, kMaxGbps, true) * 1e9;
    r.fitted_on = text(g, "fitted_on", here);
    if (g.contains("overhead_scale")) r.overhead_scale = number(g, "overhead_scale", here, 0, 10);
    r.host_ns_per_op = host_ns_per_op;
    r.host_source = host_source;
    if (!g.contains("kinds") || !g.at("kinds").is_object()) GPUCAST_USER_ERROR("{}: missing object 'kinds'", here);
    for (size_t k = 0; k < kLayerCostKinds.size(); ++k) {
      const std::string kind(kLayerCostKinds[k]);
      const std::string at = fmt::format("{}: kinds.{}", here, kind);
      if (!g.at("kinds").contains(kind)) GPUCAST_USER_ERROR("{}: missing (every kind of op needs rates)", at);
      const json& kj = g.at("kinds").at(kind);
      r.kinds[k].source = text(kj, "source", at);
      if (!kj.contains("forward")) GPUCAST_USER_ERROR("{}: missing key 'forward'", at);
      if (!kj.contains("backward")) GPUCAST_USER_ERROR("{}: missing key 'backward'", at);
      r.kinds[k].forward = pass_rates(kj.at("forward"), at + ".forward");
      r.kinds[k].backward = pass_rates(kj.at("backward"), at + ".backward");
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<GpuRates> load_gpu_rates(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    GPUCAST_USER_ERROR_CODE("gpu-rates",
                            "GPU rates table '{}' cannot be read (missing?): give a table written by "
                            "bench/gpu_rates.py, or unset GPUCAST_GPU_RATES to use the shipped one",
                            path);
  }
  std::stringstream s;
  s << f.rdbuf();
  try {
    return parse_gpu_rates(s.str(), path);
  } catch (const UserError& e) {
    throw with_code("gpu-rates", e);  // whatever is wrong with it, the table is not usable
  } catch (const json::exception& e) {  // a field of another type than the reader expects
    GPUCAST_USER_ERROR_CODE("gpu-rates", "{}: not a usable GPU rates table: {}", path, valid_utf8(e.what()));
  }
}

std::string gpu_rates_to_json(const std::vector<GpuRates>& table) {
  json gpus = json::array();
  for (const GpuRates& r : table) {
    json kinds = json::object();
    for (size_t k = 0; k < kLayerCostKinds.size(); ++k) {
      kinds[std::string(kLayerCostKinds[k])] = {{"source", r.kinds[k].source},
                                                {"forward", pass_json(r.kinds[k].forward)},
                                                {"backward", pass_json(r.kinds[k].backward)}};
    }
    gpus.push_back({{"name", r.name}, {"fp32_tflops", r.fp32_flops / 1e12}, {"tf32_tflops", r.tf32_flops / 1e12},
                    {"half_tflops", r.half_flops / 1e12}, {"bandwidth_gbps", r.bytes_per_s / 1e9},
                    {"fitted_on", r.fitted_on}, {"overhead_scale", r.overhead_scale}, {"kinds", kinds}});
  }
  json out{{"format", kFormat}, {"version", kGpuRatesVersion}, {"gpus", gpus}};
  if (!table.empty() && table.front().host_ns_per_op > 0) {
    out["host"] = {{"us_per_op", table.front().host_ns_per_op / 1e3}, {"source", table.front().host_source}};
  }
  return out.dump(1);
}

const GpuRates* find_gpu_rates(const std::vector<GpuRates>& table, const std::string& name) {
  for (const GpuRates& r : table) {
    if (ascii_lower(r.name) == ascii_lower(name)) return &r;
  }
  return nullptr;
}

std::string default_gpu_rates_path() { return shipped_data_file("GPUCAST_GPU_RATES", "gpu_rates.json"); }
std::string shipped_gpu_rates_path() { return shipped_data_file(nullptr, "gpu_rates.json"); }

namespace {
// The rates of a part's kind (an unknown kind: elementwise) in one pass.
const GpuPassRates& rates_of(const GpuRates& gpu, const std::string& kind, Phase pass) {
  const auto it = std::find(kLayerCostKinds.begin(), kLayerCostKinds.end(), kind);
  const size_t k = it == kLayerCostKinds.end() ? kLayerCostKinds.size() - 1
                                               : static_cast<size_t>(it - kLayerCostKinds.begin());
  return pass == Phase::Backward ? gpu.kinds[k].backward : gpu.kinds[k].forward;
}
}  // namespace

double gpu_part_ns(const CostPart& part, const GpuRates& gpu, Phase pass, const GpuPrecision& precision) {
  const GpuPassRates& p = rates_of(gpu, part.kind, pass);
  double peak = gpu.fp32_flops;
  if (part.half) {
    peak = gpu.half_flops;
  } else if ((part.kind == "matmul" || part.kind == "attention") && precision.tf32_matmul) {
    peak = gpu.tf32_flops;
  } else if (part.kind == "conv" && precision.tf32_conv) {
    peak = gpu.tf32_flops;
  }
  const LayerCost c{"", part.kind, part.flops, part.bytes, part.kernels, {}};
  return roofline_ns(c, DeviceRates{p.flop_eff * peak, p.byte_eff * gpu.bytes_per_s, p.overhead_s * gpu.overhead_scale},
                     pass);
}

namespace {
// The layer's parts; one of its cost kind where it was recorded without them (no shapes), none without work.
std::vector<CostPart> parts_of(const LayerTiming& l) {
  if (!l.parts.empty()) return l.parts;
  if (l.flops <= 0 && l.bytes <= 0) return {};
  return {CostPart{l.cost_kind, false, l.flops, l.bytes, l.ops}};
}
}  // namespace

double gpu_layer_ns(const LayerTiming& layer, const GpuRates& gpu, Phase pass, const GpuPrecision& precision) {
  double t = 0;
  for (const CostPart& p : parts_of(layer)) t += gpu_part_ns(p, gpu, pass, precision);
  return t;
}

IterationTiming price_on_gpu(const IterationTiming& probe, const GpuRates& gpu, const GpuPrecision& precision) {
  IterationTiming out = probe;
  double layers = 0;
  for (LayerTiming& l : out.layers) {
    l.forward_ns = gpu_layer_ns(l, gpu, Phase::Forward, precision);
    const bool backward = layer_runs_backward(probe, l);
    l.backward_ns = backward ? gpu_layer_ns(l, gpu, Phase::Backward, precision) : 0.0;
    // The forward ops backward runs again (activation checkpointing), at forward rates, in the backward pass.
    for (const CostPart& p : l.recompute) l.backward_ns += gpu_part_ns(p, gpu, Phase::Forward, precision);
    layers += l.forward_ns + l.backward_ns;
    // The kernels' overheads: what tensor parallelism leaves whole on every rank.
    l.forward_fixed_ns = l.backward_fixed_ns = 0;
    auto kernels = [&](const CostPart& p, Phase pass) {
      return static_cast<double>(p.kernels) * rates_of(gpu, p.kind, pass).overhead_s * gpu.overhead_scale * 1e9;
    };
    for (const CostPart& p : parts_of(l)) {
      l.forward_fixed_ns += kernels(p, Phase::Forward);
      if (backward) l.backward_fixed_ns += kernels(p, Phase::Backward);
    }
    for (const CostPart& p : l.recompute) l.backward_fixed_ns += kernels(p, Phase::Forward);
  }
  double bytes = probe.optimizer_bytes;
  if (bytes <= 0) {
    // Adam's traffic per gradient byte (torch/optim/adam.py:456, 475, 546 in torch 2.14.1): reads param, grad,
    // exp_avg and exp_avg_sq; writes param, exp_avg and exp_avg_sq.
    for (const LayerTiming& l : probe.layers) bytes += 7.0 * static_cast<double>(l.grad_bytes);
  }
  const GpuPassRates& ew = gpu.kinds[kLayerCostKinds.size() - 1].forward;
  out.optimizer_ns = bytes > 0 ? bytes / (ew.byte_eff * gpu.bytes_per_s) * 1e9 : 0;
  out.other_ns = 0;
  out.wall_ns = layers + out.optimizer_ns;
  out.untraced_wall_ns = -1;
  out.clock = "gpu-table";
  // The host issues the probe's launching ops but its optimizer's: on the CPU PyTorch's optimizers loop over the
  // parameters where on a GPU they run multi-tensor (foreach) kernels; the table's cost per op covers those.
  if (gpu.host_ns_per_op > 0 && probe.launch_ops > 0) {
    out.host_ns = gpu.host_ns_per_op * static_cast<double>(probe.launch_ops);
  }
  return out;
}

IterationTiming work_at_batch(const std::vector<IterationTiming>& probes, int64_t batch, int64_t seq) {
  if (probes.empty()) GPUCAST_USER_ERROR("step time: no probe to take the work from");
  auto tokens = [&](const IterationTiming& p) {
    return static_cast<double>(p.batch) * (seq > 0 && p.seq > 0 ? static_cast<double>(p.seq) : 1.0);
  };
  const IterationTiming& ref = *std::max_element(probes.begin(), probes.end(),
                                                 [&](const auto& x, const auto& y) { return tokens(x) < tokens(y); });
  const double b = static_cast<double>(batch);
  const double L = static_cast<double>(std::max<int64_t>(seq, 0));
  IterationTiming out = ref;
  out.batch = batch;
  out.seq = seq > 0 ? seq : ref.seq;
  std::vector<std::map<std::string, const LayerTiming*>> index(probes.size());
  for (size_t p = 0; p < probes.size(); ++p) {
    for (const LayerTiming& l : probes[p].layers) index[p].emplace(l.layer, &l);
  }
  auto over = [&](const std::string& layer, auto value) {
    std::vector<SizedValue> pts;
    for (size_t p = 0; p < probes.size(); ++p) {
      auto it = index[p].find(layer);
      if (it == index[p].end()) continue;
      if (const auto v = value(*it->second); v) {
        pts.push_back({static_cast<double>(probes[p].batch), static_cast<double>(probes[p].seq), *v});
      }
    }
    return std::max(0.0, fit_size(pts, b, L));
  };
  // Each part's FLOPs and bytes fitted over the probes' same part (of the same list: parts or recompute).
  auto fit_parts = [&](const std::string& layer, std::vector<CostPart>& parts,
                       std::vector<CostPart> LayerTiming::*list) {
    for (CostPart& part : parts) {
      auto find = [&](const LayerTiming& x) -> const CostPart* {
        for (const CostPart& q : x.*list) {
          if (q.kind == part.kind && q.half == part.half) return &q;
        }
        return nullptr;
      };
      part.flops = over(layer, [&](const LayerTiming& x) -> std::optional<double> {
        const CostPart* q = find(x);
        return q ? std::optional<double>(q->flops) : std::nullopt;
      });
      part.bytes = over(layer, [&](const LayerTiming& x) -> std::optional<double> {
        const CostPart* q = find(x);
        return q ? std::optional<double>(q->bytes) : std::nullopt;
      });
    }
  };
  for (LayerTiming& l : out.layers) {
    fit_parts(l.layer, l.parts, &LayerTiming::parts);
    fit_parts(l.layer, l.recompute, &LayerTiming::recompute);
    l.flops = over(l.layer, [](const LayerTiming& x) { return std::optional<double>(x.flops); });
    l.bytes = over(l.layer, [](const LayerTiming& x) { return std::optional<double>(x.bytes); });
    l.out_bytes = static_cast<int64_t>(
        over(l.layer, [](const LayerTiming& x) { return std::optional<double>(static_cast<double>(x.out_bytes)); }));
  }
  const double scale = b * (seq > 0 && ref.seq > 0 ? L : 1.0) / tokens(ref);
  for (LayerEdge& e : out.edges) e.bytes = static_cast<int64_t>(static_cast<double>(e.bytes) * scale);
  return out;
}

StepTimeForecast forecast_step_time_on_gpu(const std::vector<IterationTiming>& probes, StepTimeOptions options,
                                           const GpuRates& gpu, const GpuPrecision& precision) {
  // The GPU's time is not affine in the batch where the probes' is (a matmul memory-bound at a probe's batch is
  // compute-bound at the target's): the work is extrapolated, then priced at the rank's micro-batch (and at twice
  // it, so that the step model's fit over the batch passes through that price).
  if (probes.empty()) GPUCAST_USER_ERROR("step time: no probe to take the work from");
  const ParallelConfig& P = options.parallel;
  const int64_t per_rank = std::max<int64_t>(1, options.batch_size / std::max<int64_t>(1, P.dp * P.micro_batches));
  std::vector<IterationTiming> priced;
  for (int64_t b : {per_rank, 2 * per_rank}) {
    priced.push_back(price_on_gpu(work_at_batch(probes, b, options.seq_len), gpu, precision));
  }
  options.time_fraction = 1.0;
  options.time_scale = 1.0;
  StepTimeForecast f = forecast_step_time(priced, options);
  for (LayerForecast& l : f.per_layer) {
    if (l.source == "measured") l.source = "gpu-table";
  }
  f.notes.insert(f.notes.begin(),
                 Note{"gpu-table-pricing", fmt::format("priced for {} from the probes' work (FLOPs and bytes per op kind; nothing timed on it): "
                             "efficiencies fitted on {}; matmuls in {}",
                             gpu.name, gpu.fitted_on, precision.tf32_matmul ? "TF32" : "float32 (TF32 off)")});
  return f;
}

}  // namespace gpucast
