// The torch-facing shell: torch.ops.gpucast.* and torch.classes.gpucast.Trace.
// Core errors (gpucast::UserError) become ValueError through TORCH_CHECK_VALUE; anything else is ours.
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>


#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>

#include "auto_mode.h"
#include "config_keys.h"
#include "direct_tags.h"
#include "library_init.h"
#include "trace_holder.h"
#include "translate.h"
#include "gpucast/config.h"
#include "gpucast/shipped_data.h"
#include "gpucast/error.h"
#include "gpucast/files.h"
#include "gpucast/json_input.h"
#include "gpucast/trace_exporters.h"
#include "gpucast/gpu_rates.h"
#include "gpucast/layer_model.h"
#include "gpucast/comm_model.h"
#include "gpucast/job.h"
#include "gpucast/job_features.h"
#include "gpucast/job_hf.h"
#include "gpucast/job_model.h"
#include "gpucast/memory_forecast.h"
#include "gpucast/memory_timeline.h"
#include "gpucast/step_gnn.h"
#include "gpucast/step_time.h"
#include "gpucast/step_timeline.h"
#include "gpucast/storage_identity.h"
#include "gpucast/trace_json.h"
#include "gpucast/trace_summary.h"
#include "gpucast/tracer.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace gpucast {
namespace {

using nlohmann::json;

// The learned job model's weights: $GPUCAST_JOB_WEIGHTS, else data/job_memory.gcw beside this library's lib/
// directory (the installed package and the build tree both lay it out so).
std::string default_job_weights() { return shipped_data_file("GPUCAST_JOB_WEIGHTS", "job_memory.gcw"); }

// Collects probe traces, then forecasts (torch.classes.gpucast.MemoryForecaster).
struct MemoryForecasterHolder : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<TraceHolder>> probes;
  std::vector<int64_t> batches;
  std::vector<int64_t> seqs;
  int64_t target_seq = 0;

  void add_probe(const c10::intrusive_ptr<TraceHolder>& t, int64_t batch) {
    probes.push_back(t);
    batches.push_back(batch);
  }
  void add_probe_seq(const c10::intrusive_ptr<TraceHolder>& t, int64_t batch, int64_t seq) {
    add_probe(t, batch);
    seqs.push_back(seq);
  }
  void set_target_seq(int64_t seq) { target_seq = seq; }
  void set_conv_workspaces(const c10::Dict<std::string, int64_t>& ws) {
    conv_workspaces.clear();
    for (const auto& kv : ws) conv_workspaces[kv.key()] = kv.value();
  }
  std::map<std::string, int64_t> conv_workspaces;
  // Keys: the op's index in the largest probe's trace, as text.
  void set_op_workspaces(const c10::Dict<std::string, int64_t>& ws, int64_t per_rank_batch) {
    translate("argument", [&] {
      std::map<int64_t, int64_t> parsed;
      for (const auto& kv : ws) {
        const std::string& key = kv.key();
        // 18 digits: under 10^18, which fits int64_t.
        const bool digits = !key.empty() && key.size() <= 18 &&
                            std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (!digits || kv.value() < 0) {
          GPUCAST_USER_ERROR("set_op_workspaces: expected an op's index in the largest probe's trace (digits) "
                             "mapped to bytes (at least 0), got '{}': {}", key, kv.value());
        }
        parsed[std::stoll(key)] = kv.value();
      }
      op_workspaces = std::move(parsed);
      op_workspace_batch = per_rank_batch;
    });
  }
  std::map<int64_t, int64_t> op_workspaces;
  int64_t op_workspace_batch = 0;
  std::string run(int64_t target_batch, const std::string& target, int64_t capacity_bytes, double safety_fraction,
                  const std::string& probe_device, const std::string& parallel, const std::string& alloc_conf,
                  const std::string& cublas_config, const std::vector<int64_t>& exclude, int64_t conv_workspace,
                  const std::string& cudnn_conv_wscap, double moe_skew) {
    return translate("memory-forecast", [&] {
      MemoryForecastInput in;
      for (const auto& p : probes) in.probes.push_back(&p->get());
      in.probe_batch = batches;
      in.probe_seq = seqs;
      in.target_seq = target_seq;
      in.target_batch = target_batch;
      in.target = target;
      in.capacity_bytes = capacity_bytes;
      in.safety_fraction = safety_fraction;
      in.probe_device = probe_device;
      in.parallel = with_error_code("parallel", [&] { return ParallelConfig::parse(parallel); });
      in.allocator = with_error_code("allocator-config", [&] {
        return alloc_conf.empty() ? AllocatorConfig{} : AllocatorConfig::parse(alloc_conf);
      });
      in.cublas_workspace_config = cublas_config;
      in.conv_workspace_bytes = conv_workspace;
      in.cudnn_conv_wscap = cudnn_conv_wscap;
      in.conv_workspaces = conv_workspaces;
      in.op_workspaces = op_workspaces;
      in.op_workspace_batch = op_workspace_batch;
      in.moe_skew = moe_skew;
      for (int64_t p : exclude) in.exclude_ptrs.push_back(static_cast<uint64_t>(p));
      return memory_forecast_to_json(forecast_memory(in));
    });
  }
};

c10::intrusive_ptr<TraceHolder> hold(Trace t) { return c10::make_intrusive<TraceHolder>(std::move(t)); }

void start(const std::string& options, const std::optional<std::vector<std::string>>& timed_layers) {
  translate("trace-options", [&] {
    Config cfg("gpucast.trace() options", trace_config_keys());
    cfg.parse(options);
    TraceOptions o;
    o.record_shapes = cfg.get_bool("record_shapes");
    o.memory = cfg.get_bool("memory");
    o.nested_ops = cfg.get_bool("nested_ops");
    o.max_ops = cfg.get_int("max_ops");
    o.max_events = cfg.get_int("max_events");
    o.device_timing = cfg.get_bool("device_timing");
    o.external_profiler = cfg.get_bool("external_profiler");
    o.timed_layers = timed_layers.value_or(std::vector<std::string>{});
    if (o.memory && cfg.get_bool("autograd_tags")) {
      o.optimizer_state_from_phase = true;  // what a step allocated and still holds: no optimizer hooks tag it
      start_trace_with_direct_tags(o);
    } else {
      start_trace(o);
    }
  });
}

void check_options(const std::string& options) {
  translate("trace-options", [&] {
    Config cfg("gpucast.trace() options", trace_config_keys());
    cfg.parse(options);
  });
}

c10::intrusive_ptr<TraceHolder> stop() {
  return translate("trace", [] {
    finish_direct_tags();
    return c10::make_intrusive<TraceHolder>(stop_recording());
  });
}

void tag(const std::vector<int64_t>& ptrs, const std::string& device, const std::string& category) {
  translate("argument", [&] { tag_blocks(ptrs, device, category_from_string(category)); });
}

// Tags the storages of the given tensors (undefined ones and those without storage are skipped), grouped by
// device: one call from Python for a whole parameter, gradient or state list.
void tag_tensors(const std::vector<std::optional<at::Tensor>>& tensors, const std::string& category) {
  translate("argument", [&] {
    const Category c = category_from_string(category);
    std::map<std::string, std::vector<int64_t>> by_device;
    for (const auto& t : tensors) {
      if (!t || !t->defined() || !t->has_storage()) continue;
      try {
        const uint64_t p = storage_identity(t->storage());
        if (p != 0) by_device[t->device().str()].push_back(static_cast<int64_t>(p));
      } catch (const std::exception&) {
        // A tensor subclass without a real storage (fake, functional): nothing to tag.
      }
    }
    for (const auto& [device, ptrs] : by_device) tag_blocks(ptrs, device, c);
  });
}

c10::intrusive_ptr<TraceHolder> load(const std::string& path) {
  return translate("trace-file", [&] { return hold(load_trace(path)); });
}

c10::intrusive_ptr<TraceHolder> from_json(const std::string& text) {
  return translate("trace-file", [&] { return hold(trace_from_json(text, "<string>")); });
}

// The rates of `gpu` in the table at `path` ("": the default table); a table without it is an error of the table's
// kind (gpu-rates: the caller may fall back to the shipped one). The table is read once per call: it is small.
GpuRates gpu_rates_of(const std::string& gpu, const std::string& path_or_default) {
  const std::string path = path_or_default.empty() ? default_gpu_rates_path() : path_or_default;
  const auto table = load_gpu_rates(path);
  const GpuRates* g = find_gpu_rates(table, gpu);
  if (g == nullptr) {
    std::string known;
    for (const auto& r : table) known += (known.empty() ? "" : ", ") + r.name;
    GPUCAST_USER_ERROR_CODE("gpu-rates", "forecast_step_time: the GPU rates table '{}' has no '{}'; it has: {}", path,
                            gpu, known);
  }
  return *g;
}

// An iteration timing from an op's argument; a bad one names the op and the argument (code "timing").
IterationTiming timing_argument(const std::string& text, const std::string& op, const std::string& which) {
  try {
    return iteration_timing_from_json(text);
  } catch (const UserError& e) {
    GPUCAST_USER_ERROR_CODE("timing", "{}: {}: {}", op, which, e.what());
  }
}

}  // namespace
}  // namespace gpucast

namespace {

// Auto mode's ops (plugin/auto_mode.h), apart from the rest: what the Python layer and tests call.
void register_auto_mode_ops(torch::Library& m) {
  using gpucast::TraceHolder;
  using nlohmann::json;
  // Auto mode (plugin/auto_mode.h): configured from GPUCAST_CONF's text (python: the Python layer reports what it
  // polls), polled by the Python layer's hooks, its status.
  m.def("auto_configure(str text, bool python=False) -> str", [](const std::string& text, bool python) {
    return gpucast::translate("auto-config", [&] {
      return gpucast::auto_settings_json(gpucast::auto_mode::configure(text, python)).dump();
    });
  });
  m.def("auto_stop() -> ()", [] { gpucast::auto_mode::stop(); });
  // `line` appended to the JSON Lines file at `path` (gpucast/files.h: append_line): GPUCAST_LOG's and the
  // trackers' one way of writing.
  m.def("append_line(str path, str line) -> ()", [](const std::string& path, const std::string& line) {
    gpucast::translate("file-write", [&] { gpucast::append_line(path, line); });
  });
  // A forecast (MemoryForecast's JSON) judged against capacity_mb (0: the forecast's) at warn_fraction:
  // {"risk", "message"}. The one rule auto mode and the framework callbacks judge by.
  m.def("judge_memory(str forecast, int capacity_mb, float warn_fraction) -> str",
        [](const std::string& forecast, int64_t capacity_mb, double warn_fraction) {
          return gpucast::translate("argument", [&] {
            gpucast::AutoSettings s;
            if (capacity_mb < 0 || capacity_mb > (int64_t{1} << 24)) {
              GPUCAST_USER_ERROR("judge_memory: capacity_mb should be in [0, 2^24], got {}", capacity_mb);
            }
            if (!(warn_fraction > 0 && warn_fraction <= 1)) {
              GPUCAST_USER_ERROR("judge_memory: warn_fraction should be in (0, 1], got {}", warn_fraction);
            }
            s.capacity_mb = capacity_mb;
            s.warn_fraction = warn_fraction;
            const gpucast::AutoVerdict v =
                gpucast::judge_forecast(gpucast::memory_forecast_for_judging(forecast), s);
            return json{{"risk", v.risk}, {"message", v.message}}.dump();
          });
        });
  // "auto": this process's GPU as a device table name (else cpu); any other name as given.
  m.def("auto_target(str target) -> str", [](const std::string& target) { return gpucast::auto_mode::resolve_target(target); });
  m.def("auto_poll(bool at_step) -> str", [](bool at_step) { return gpucast::auto_mode::poll(at_step); });
  m.def("auto_status() -> str", [] { return gpucast::auto_mode::status_json(); });
  // The forecast auto mode makes from a traced iteration at its batch, with GPUCAST_CONF's settings, and its
  // verdict: {"risk", "message", "record"} (the record GPUCAST_LOG would get).
  m.def("auto_forecast(__torch__.torch.classes.gpucast.Trace trace, int batch, str conf) -> str",
        [](const c10::intrusive_ptr<TraceHolder>& t, int64_t batch, const std::string& conf) {
          return gpucast::translate("auto-config", [&] {
            const gpucast::AutoSettings s = gpucast::read_auto_settings(conf);
            const gpucast::Trace& trace = t->get();
            const std::string device = gpucast::window_peak_bytes(trace, "cuda:0") > 0 ? "cuda:0" : "cpu";
            const std::string target = gpucast::auto_mode::resolve_target(s.target);
            const gpucast::AutoVerdict v = gpucast::forecast_traced_step(
                trace, batch, target, s, device, gpucast::ForecastEnvironment::from_process());
            gpucast::AutoRecordContext c;
            return json{{"risk", v.risk}, {"message", v.message}, {"record", gpucast::auto_record(v, c)}}.dump();
          });
        });
}

// The custom classes: a recorded trace, and the memory forecaster over probe traces.
void register_classes(torch::Library& m) {
  using gpucast::TraceHolder;
  m.class_<TraceHolder>("Trace")
      .def("summary", &TraceHolder::summary)
      .def("to_json", &TraceHolder::to_json)
      .def("ops_json", &TraceHolder::ops_json)
      .def("save", &TraceHolder::save)
      .def("save_chrome", &TraceHolder::save_chrome)
      .def("peak_bytes", &TraceHolder::peak_bytes)
      .def("baseline_bytes", &TraceHolder::baseline_bytes)
      .def("memory_snapshot_json", &TraceHolder::memory_snapshot_json)
      .def("memory_series", &TraceHolder::memory_series)
      .def("num_ops", &TraceHolder::num_ops)
      .def("activation_bytes_by_module", &TraceHolder::activation_bytes_by_module)
      .def("iteration_timing", &TraceHolder::iteration_timing)
      .def("num_events", &TraceHolder::num_events)
      .def("num_allocations", &TraceHolder::num_allocations)
      .def("header_json", &TraceHolder::header_json)
      .def("records_json", &TraceHolder::records_json)
      .def("bytes_by_category", &TraceHolder::bytes_by_category);
  using gpucast::MemoryForecasterHolder;
  m.class_<MemoryForecasterHolder>("MemoryForecaster")
      .def(torch::init<>())
      .def("add_probe", &MemoryForecasterHolder::add_probe)
      .def("add_probe_seq", &MemoryForecasterHolder::add_probe_seq)
      .def("set_target_seq", &MemoryForecasterHolder::set_target_seq)
      .def("set_conv_workspaces", &MemoryForecasterHolder::set_conv_workspaces)
      .def("set_op_workspaces", &MemoryForecasterHolder::set_op_workspaces)
      // Called with keywords: the settings of the target and the environment PyTorch's allocator reads
      // (PYTORCH_ALLOC_CONF, CUBLAS_WORKSPACE_CONFIG, CUDNN_CONV_WSCAP_DBG); exclude: storages that are not the job's.
      .def("run", &MemoryForecasterHolder::run, "the memory forecast at target_batch, as JSON",
           {torch::arg("target_batch"), torch::arg("target") = "cpu", torch::arg("capacity_bytes") = 0,
            // 0.9: a chosen default, as auto mode's warn_fraction: a tenth of the capacity kept for what is uncounted.
            torch::arg("safety_fraction") = 0.9, torch::arg("probe_device") = "cpu", torch::arg("parallel") = "",
            torch::arg("alloc_conf") = "", torch::arg("cublas_workspace_config") = "",
            torch::arg("exclude") = std::vector<int64_t>{}, torch::arg("conv_workspace") = -1,
            torch::arg("cudnn_conv_wscap") = "",
            // 1.0: each routed layer's k most-loaded experts receive every token, the heaviest routing without a
            // capacity factor.
            torch::arg("moe_skew") = 1.0});
}

// The step-time forecast and what it is made of: timings, layer choice and fits, GPU rates.
void register_step_time_ops(torch::Library& m) {
  using nlohmann::json;
  // The step time from the probes' timings; with correct, the graph network's correction applied (gnn: a weights
  // file, "" the shipped one, None disabled; target, optimizer, threads and this CPU's rates: what it reads).
  // output "graph": instead of the forecast, the graph the network reads for it (the step-time dataset's records).
  m.def("forecast_step_time(str[] probes, int batch_size, str parallel=\"\", str link=\"\", float time_scale=1.0, "
        "float time_fraction=1.0, str design=\"d-optimal\", int design_seed=0, float prior_flops_per_s=0.0, "
        "float prior_bytes_per_s=0.0, str gpu=\"\", str gpu_rates=\"\", bool tf32_matmul=False, "
        "bool tf32_conv=True, int seq_len=0, bool every_layer=False, float time_budget=1.0, bool correct=False, "
        "str? gnn=None, str target=\"cpu\", str optimizer=\"other\", int threads=1, float peak_gflops=1.0, "
        "float mem_gbps=1.0, str output=\"forecast\") -> str",
        [](const std::vector<std::string>& probes, int64_t batch, const std::string& parallel, const std::string& link,
           double time_scale, double time_fraction, const std::string& design, int64_t design_seed,
           double prior_flops, double prior_bytes, const std::string& gpu, const std::string& gpu_rates,
           bool tf32_matmul, bool tf32_conv, int64_t seq_len, bool every_layer, double time_budget, bool correct,
           std::optional<std::string> gnn, const std::string& target, const std::string& optimizer, int64_t threads,
           double peak_gflops, double mem_gbps, const std::string& output) {
          return gpucast::translate("step-time", [&] {
            std::vector<gpucast::IterationTiming> its;
            for (size_t i = 0; i < probes.size(); ++i) {
              its.push_back(gpucast::timing_argument(probes[i], "forecast_step_time", fmt::format("probe {}", i)));
            }
            gpucast::StepTimeOptions o;
            o.batch_size = batch;
            o.parallel = gpucast::with_error_code("parallel", [&] { return gpucast::ParallelConfig::parse(parallel); });
            o.topology = gpucast::with_error_code("link", [&] { return gpucast::Topology::parse(link); });
            o.time_scale = time_scale;
            o.time_fraction = time_fraction;
            o.design = design;
            o.design_seed = static_cast<uint64_t>(design_seed);
            o.seq_len = seq_len;
            o.every_layer = every_layer;
            o.time_budget = time_budget;
            if (prior_flops > 0) o.prior.flops_per_s = prior_flops;  // the device's measured or table rates
            if (prior_bytes > 0) o.prior.bytes_per_s = prior_bytes;
            gpucast::StepTimeForecast f =
                gpu.empty() ? gpucast::forecast_step_time(its, o)
                            : gpucast::forecast_step_time_on_gpu(its, o, gpucast::gpu_rates_of(gpu, gpu_rates),
                                                                 gpucast::GpuPrecision{tf32_matmul, tf32_conv});
            const gpucast::StepCorrectionSettings c{gnn.has_value(), gnn.value_or(""), target, seq_len, optimizer,
                                                    threads, peak_gflops, mem_gbps};
            if (output == "graph") return gpucast::step_graph_to_json(gpucast::forecast_step_graph(f, its, c));
            if (output != "forecast") {
              GPUCAST_USER_ERROR("forecast_step_time: output should be forecast or graph, got '{}'", output);
            }
            if (correct) gpucast::correct_step_time(f, its, c);
            return gpucast::step_time_to_json(f);
          });
        });
  // The forecast step as a Chrome/Perfetto trace at `path` (gpucast/step_timeline.h), written atomically.
  m.def("save_step_timeline(str forecast, str path) -> ()", [](const std::string& forecast, const std::string& path) {
    gpucast::translate("step-time", [&] {
      const std::string text = gpucast::step_timeline_json(forecast);
      gpucast::with_error_code("file-write", [&] { gpucast::write_file_atomically(path, text); });
    });
  });
  // A light trace's timing joined with the full trace's structure (step_time.h: with_structure); with
  // untraced_wall_ns >= 0, the same step's wall measured without the tracer (what takes the tracer's cost out).
  m.def("timing_with_structure(str timing, str structure, float untraced_wall_ns=-1.0) -> str",
        [](const std::string& timing, const std::string& structure, double untraced_wall_ns) {
          return gpucast::translate("timing", [&] {
            const char* op = "timing_with_structure";
            gpucast::IterationTiming t = gpucast::with_structure(gpucast::timing_argument(timing, op, "timing"),
                                                                 gpucast::timing_argument(structure, op, "structure"));
            if (untraced_wall_ns >= 0) t.untraced_wall_ns = untraced_wall_ns;
            return gpucast::iteration_timing_to_json(t);
          });
        });
  // A probe's timing marked with the sequence length it ran at (forecasts scaled by length read it).
  m.def("timing_with_seq(str timing, int seq) -> str", [](const std::string& timing, int64_t seq) {
    return gpucast::translate("timing", [&] {
      if (seq < 1) GPUCAST_USER_ERROR("timing_with_seq: seq should be at least 1, got {}", seq);
      gpucast::IterationTiming t = gpucast::timing_argument(timing, "timing_with_seq", "timing");
      t.seq = seq;
      return gpucast::iteration_timing_to_json(t);
    });
  });
  m.def("median_timing(str[] runs) -> str", [](const std::vector<std::string>& runs) {
    return gpucast::translate("timing", [&] {
      std::vector<gpucast::IterationTiming> its;
      its.reserve(runs.size());
      for (size_t i = 0; i < runs.size(); ++i) {
        its.push_back(gpucast::timing_argument(runs[i], "median_timing", fmt::format("run {}", i)));
      }
      return gpucast::iteration_timing_to_json(gpucast::median_timing(its));
    });
  });
  m.def("choose_timed_layers(str timing, float fraction, str design=\"d-optimal\", int seed=0, "
        "float time_budget=1.0) -> str[]",
        [](const std::string& timing, double fraction, const std::string& design, int64_t seed, double budget) {
          return gpucast::translate("timing", [&] {
            return gpucast::choose_timed_layers(gpucast::timing_argument(timing, "choose_timed_layers", "timing"),
                                                fraction, design,
                                                static_cast<uint64_t>(seed), budget);
          });
        });
  m.def("gpu_rates(str path=\"\") -> str", [](const std::string& path) {
    return gpucast::translate("gpu-rates", [&] {
      return gpucast::gpu_rates_to_json(gpucast::load_gpu_rates(path.empty() ? gpucast::default_gpu_rates_path() : path));
    });
  });
  m.def("gpu_rates_path(bool shipped=False) -> str", [](bool shipped) {
    return shipped ? gpucast::shipped_gpu_rates_path() : gpucast::default_gpu_rates_path();
  });
  // Per kind and pass, the roofline rates layer_model.h fits on measured layers (bench/gpu_rates.py fits the GPU
  // table with it): {"prior": {flops_per_s, bytes_per_s, overhead_s}, "layers": [{kind, flops, bytes, ops,
  // forward_ns, backward_ns}]} -> {kind: {source, forward: {flops_per_s, bytes_per_s, overhead_s, samples,
  // rms_rel_error}, backward: ...}}.
  m.def("fit_layer_rates(str spec) -> str", [](const std::string& spec) {
    return gpucast::translate("argument", [&] {
      const gpucast::JsonFields r("fit_layer_rates");
      const json j = gpucast::parse_json_input(spec, r.source());
      const json& p = r.field(j, "prior", "");
      const gpucast::DeviceRates prior{r.get<double>(p, "flops_per_s", "prior"), r.get<double>(p, "bytes_per_s", "prior"),
                                       r.get<double>(p, "overhead_s", "prior")};
      const json& layers = r.field(j, "layers", "");
      if (!layers.is_array()) r.fail("layers", "a list of {kind, flops, bytes, ops, forward_ns, backward_ns}", layers);
      std::vector<gpucast::LayerCost> costs;
      std::vector<gpucast::LayerSample> samples;
      for (size_t i = 0; i < layers.size(); ++i) {
        const std::string w = fmt::format("layers[{}]", i);
        const json& l = layers[i];
        costs.push_back({"", r.get<std::string>(l, "kind", w), r.get<double>(l, "flops", w),
                         r.get<double>(l, "bytes", w), r.get<int64_t>(l, "ops", w)});
        samples.push_back({costs.size() - 1, r.get<double>(l, "forward_ns", w), r.get<double>(l, "backward_ns", w)});
      }
      gpucast::LayerTimeModel model;
      model.fit(costs, samples, prior);
      json out = json::object();
      for (std::string_view kind : gpucast::kLayerCostKinds) {
        const gpucast::KindFit& f = model.fit_for(kind);
        auto pass = [](const gpucast::PassFit& p) {
          return json{{"flops_per_s", p.rates.flops_per_s}, {"bytes_per_s", p.rates.bytes_per_s},
                      {"overhead_s", p.rates.op_overhead_s}, {"source", p.source}, {"samples", p.samples},
                      {"rms_rel_error", p.rms_rel_error}};
        };
        out[std::string(kind)] = {{"fitted_as", f.kind}, {"forward", pass(f.forward)}, {"backward", pass(f.backward)}};
      }
      return out.dump();
    });
  });
}

// Job descriptions, the device and interconnect tables, and the checks of targets and parallel settings.
void register_table_ops(torch::Library& m) {
  using nlohmann::json;
  // source: what errors name the description by (its file's path, or "job").
  m.def("predict_job(str job_json, str? weights=None, str source=\"job\") -> str",
        [](const std::string& text, std::optional<std::string> weights, const std::string& source) {
          return gpucast::translate("job-file", [&] {
            const gpucast::JobDescription job = gpucast::job_from_json(text, source);
            return gpucast::job_estimate_to_json(
                gpucast::predict_job_memory(job, weights ? *weights : gpucast::default_job_weights()));
          });
        });
  // A job description from a transformers config.json's text and the job's settings (a JSON object).
  m.def("job_from_hf_config(str config_json, str settings_json, str source=\"config\") -> str",
        [](const std::string& config, const std::string& settings, const std::string& source) {
          return gpucast::translate("job-file", [&] {
            return gpucast::job_to_json(gpucast::job_from_hf_config(config, settings, source));
          });
        });
  m.def("link_keys() -> str[]", [] {
    std::vector<std::string> names;
    for (const gpucast::ConfigKey& k : gpucast::link_config_keys()) names.push_back(k.name);
    return names;
  });
  m.def("interconnects() -> str", [] {
    json out = json::array();
    for (const auto& i : gpucast::interconnect_table()) {
      out.push_back({{"name", i.name}, {"alpha_us", i.link.alpha_us}, {"bytes_per_us", i.link.bytes_per_us}});
    }
    return out.dump();
  });
  m.def("job_weights_path() -> str", [] { return gpucast::default_job_weights(); });
  m.def("job_features(str job_json) -> str", [](const std::string& text) {
    return gpucast::translate("job-file", [&] {
      const gpucast::JobFeatures f = gpucast::job_features(gpucast::job_from_json(text, "job"));
      json layers = json::array();
      for (int64_t i = 0; i < f.layers; ++i) {
        auto row = f.layer_features.begin() + i * gpucast::kLayerFeatures;
        layers.push_back(std::vector<float>(row, row + gpucast::kLayerFeatures));
      }
      return json{{"layer_names", gpucast::layer_feature_names()}, {"job_names", gpucast::job_feature_names()},
                  {"analytic_bytes", f.analytic_bytes}, {"job", f.job_features}, {"layers", layers}}
          .dump();
    });
  });
  m.def("validate_job(str job_json) -> str", [](const std::string& text) {
    return gpucast::translate("job-file", [&] { return gpucast::job_to_json(gpucast::job_from_json(text, "job")); });
  });
  // The parallel configuration checked (errors name the key): [dp, tp, pp, micro_batches].
  m.def("check_parallel(str parallel) -> int[]", [](const std::string& text) {
    return gpucast::translate("parallel", [&] {
      const gpucast::ParallelConfig p = gpucast::ParallelConfig::parse(text);
      return std::vector<int64_t>{p.dp, p.tp, p.pp, p.micro_batches};
    });
  });
  m.def("fit_allreduce(float[] bytes, float[] us, int ranks) -> float[]",
        [](const std::vector<double>& bytes, const std::vector<double>& us, int64_t ranks) {
          return gpucast::translate("argument", [&] {
            if (bytes.size() != us.size()) {
              GPUCAST_USER_ERROR("fit_allreduce: {} sizes but {} times", bytes.size(), us.size());
            }
            std::vector<gpucast::CollectiveSample> samples;
            for (size_t i = 0; i < bytes.size(); ++i) samples.push_back({bytes[i], us[i]});
            const gpucast::Link link = gpucast::fit_ring_allreduce(samples, ranks);
            return std::vector<double>{link.alpha_us, link.bytes_per_us};
          });
        });
  m.def("device_table() -> str", [] {
    json out = json::array();
    for (const auto& d : gpucast::device_table()) {
      out.push_back({{"name", d.name}, {"capacity_bytes", d.capacity_bytes},
                     {"compute_capability", d.compute_capability / 10.0}, {"context_bytes", d.context_bytes},
                     {"source", d.source}, {"default_link", d.default_link}});
    }
    return out.dump();
  });
  m.def("probe_structure_difference(__torch__.torch.classes.gpucast.Trace a, __torch__.torch.classes.gpucast.Trace b, "
        "str device) -> str",
        [](const c10::intrusive_ptr<gpucast::TraceHolder>& a, const c10::intrusive_ptr<gpucast::TraceHolder>& b,
           const std::string& device) {
          return gpucast::translate("argument", [&] { return gpucast::probe_structure_difference(a->get(), b->get(), device); });
        });
  m.def("check_target(str target, int capacity_bytes) -> str", [](const std::string& target, int64_t capacity) {
    return gpucast::translate("argument", [&] { return gpucast::canonical_target(target, capacity); });
  });
}

// Tracing, module scopes and tags, trace files, settings' help, and the library's identity.
void register_trace_ops(torch::Library& m) {
  using nlohmann::json;
  m.def("start_trace(str options=\"\", str[]? timed_layers=None) -> ()", &gpucast::start);
  m.def("check_trace_options(str options) -> ()", &gpucast::check_options);
  m.def("stop_trace() -> __torch__.torch.classes.gpucast.Trace", &gpucast::stop);
  m.def("is_tracing() -> bool", [] { return gpucast::trace_active(); });
  // Tests and rehearsals (tracer.h): device timing through a CPU-clock stand-in for CUPTI and CUDA events.
  m.def("_use_stand_in_device_timer(bool on) -> ()", [](bool on) { gpucast::use_stand_in_device_timer(on); });
  m.def("installed_callbacks() -> int", [] { return static_cast<int64_t>(gpucast::installed_callbacks()); });
  m.def("global_callbacks_present() -> bool", [] { return at::hasGlobalCallbacks(); });
  m.def("cpu_memory_stats(bool reset_peak=False) -> int[]", [](bool reset) {
    auto [held, peak] = gpucast::cpu_memory_stats(reset);
    return std::vector<int64_t>{held, peak};
  });
  m.def("cpu_allocator_hooked() -> bool", [] { return gpucast::cpu_allocator_hook_installed(); });
  m.def("push_module(str path) -> ()", [](const std::string& p) { gpucast::push_module(p); });
  m.def("pop_module() -> ()", [] { gpucast::pop_module(); });
  m.def("module_code(str path) -> int", [](const std::string& p) { return gpucast::module_code(p); });
  m.def("push_module_code(int code) -> ()", [](int64_t c) { gpucast::push_module_code(c); });
  m.def("tag(int[] ptrs, str device, str category) -> ()", &gpucast::tag);
  m.def("tag_tensors(Tensor?[] tensors, str category) -> ()", &gpucast::tag_tensors);
  m.def("load_trace(str path) -> __torch__.torch.classes.gpucast.Trace", &gpucast::load);
  m.def("trace_from_json(str text) -> __torch__.torch.classes.gpucast.Trace", &gpucast::from_json);
  m.def("parse_auto_config(str text) -> str", [](const std::string& text) {
    return gpucast::translate("auto-config",
                              [&] { return gpucast::auto_settings_json(gpucast::read_auto_settings(text)).dump(); });
  });
  m.def("auto_config_help() -> str", [] {
    return gpucast::Config("GPUCAST_CONF", gpucast::auto_config_keys()).describe();
  });
  m.def("trace_options_help() -> str", [] {
    return gpucast::Config("gpucast.trace() options", gpucast::trace_config_keys()).describe();
  });
  m.def("owned_storages() -> int[]", [] { return gpucast::owned_storages(); });
  // Whether meta probes run the operator ("aten::_safe_softmax", "aten::add.Tensor") as its CompositeExplicitAutograd
  // kernel (profiler/meta_kernels.cpp).
  m.def("meta_runs_composite(str op) -> bool", [](const std::string& op) {
    const size_t ns = op.find("::");
    const size_t dot = op.find('.', ns == std::string::npos ? 0 : ns + 2);
    return gpucast::meta_runs_composite(op.substr(0, dot),
                                                dot == std::string::npos ? std::string() : op.substr(dot + 1));
  });
  // How a trace names each tensor's storage (storage_identity.h: a meta storage by its token); 0 for an undefined
  // tensor or one without a storage.
  m.def("storage_identities(Tensor?[] tensors) -> int[]", [](const std::vector<std::optional<at::Tensor>>& tensors) {
    std::vector<int64_t> out;
    out.reserve(tensors.size());
    for (const auto& t : tensors) {
      uint64_t p = 0;
      try {
        if (t && t->defined() && t->has_storage()) p = gpucast::storage_identity(t->storage());
      } catch (const std::exception&) {
        p = 0;  // a tensor subclass without a real storage (fake, functional)
      }
      out.push_back(static_cast<int64_t>(p));
    }
    return out;
  });
  // The C allocator in the state of a process that has run a while: glibc's malloc serves a block above its mmap
  // threshold (128 KiB at the start) with fresh pages and returns it on free, and when such a block of at most
  // 32 MiB is freed it raises that threshold to the block's size and its heap-trimming threshold to twice it, so a
  // young process pays page faults on every step that a training run soon stops paying (a training loop frees a
  // large block early; gpucast's own trace buffers do). One block of 31 MiB taken and freed, as any such free
  // does; elsewhere (another C library) a malloc and a free of no consequence. Not a setting: nothing is fixed.
  m.def("settle_c_allocator() -> ()", [] {
    // Below glibc's DEFAULT_MMAP_THRESHOLD_MAX (4*1024*1024*sizeof(long), 32 MiB): mallopt(3), M_MMAP_THRESHOLD.
    constexpr size_t kBytes = size_t{31} << 20;
    if (void* p = std::malloc(kBytes)) {
      static_cast<volatile char*>(p)[0] = 0;  // observable: the pair is not elided
      std::free(p);
    }
  });
  m.def("version() -> str", [] { return gpucast::current_context().gpucast_version; });
  m.def("library_path() -> str", [] { return gpucast::this_library_path(); });
  // The context block every JSON gpucast writes carries (CONVENTIONS: google/benchmark's context).
  m.def("context() -> str", [] {
    const auto c = gpucast::current_context();
    return json{{"gpucast_version", c.gpucast_version}, {"torch_version", c.torch_version}, {"device", c.device},
                {"build_type", c.build_type}}
        .dump();
  });
}

}  // namespace

// The ops and classes, registered by library_init.cpp when this copy of the library is the process's first.
void gpucast::register_ops(torch::Library& m) {
  register_classes(m);
  register_step_time_ops(m);
  register_table_ops(m);
  register_trace_ops(m);
  register_auto_mode_ops(m);
}

// C entry points for the Python module hooks, which run around every module call of a traced step: a ctypes call
// costs about a third of a dispatcher call. They never throw (a failure leaves the op unattributed, not the
// training job stopped) and never touch Python objects.
extern "C" {
__attribute__((visibility("default"))) int64_t gpucast_module_code(const char* path) noexcept {
  try {
    return path == nullptr ? -1 : gpucast::module_code(path);
  } catch (...) {
    return -1;
  }
}
__attribute__((visibility("default"))) void gpucast_push_module_code(int64_t code) noexcept {
  try {
    gpucast::push_module_code(code);
  } catch (...) {
  }
}
__attribute__((visibility("default"))) void gpucast_pop_module() noexcept {
  try {
    gpucast::pop_module();
  } catch (...) {
  }
}
}
