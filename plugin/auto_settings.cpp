#include "auto_settings.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "config_keys.h"
#include "gpucast/config.h"
#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "gpucast/note_json.h"

namespace gpucast {
namespace {

constexpr double kMiBytes = 1024.0 * 1024.0;

// 1234567.8 -> "1,234,568": how the messages write MiB.
std::string thousands(double v) {
  std::string digits = fmt::format("{:.0f}", std::fabs(v));
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return (v < 0 && digits != "0" ? "-" : "") + out;
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : valid_utf8(v);
}

}  // namespace

AutoSettings read_auto_settings(std::string_view text) {
  return with_error_code("auto-config", [&] {
    Config cfg("GPUCAST_CONF", auto_config_keys());
    cfg.parse(text);
    AutoSettings s;
    s.enabled = cfg.get_bool("enabled");
    s.target = cfg.get_string("target");
    s.capacity_mb = cfg.get_int("capacity_mb");
    s.warn_fraction = cfg.get_double("warn_fraction");
    s.raise = cfg.get_string("on_risk") == "raise";
    s.verbose = cfg.get_bool("verbose");
    s.iteration_scope = cfg.get_string("iteration_scope");
    s.max_iteration_ops = cfg.get_int("max_iteration_ops");
    s.max_iteration_s = cfg.get_int("max_iteration_s");
    if (ascii_lower(s.target) == "auto") {
      s.target = "auto";
      return s;
    }
    try {  // the one rule for a target's name (memory_forecast.h), said in GPUCAST_CONF's words
      s.target = canonical_target(s.target, s.capacity_mb << 20);
    } catch (const UserError&) {
      GPUCAST_USER_ERROR("GPUCAST_CONF: option 'target' expects auto, cpu or a device table name ({}), or any name "
                         "with capacity_mb, got '{}'",
                         known_targets(), s.target);
    }
    return s;
  });
}

nlohmann::json auto_settings_json(const AutoSettings& s) {
  return {{"enabled", s.enabled},
          {"target", s.target},
          {"capacity_mb", s.capacity_mb},
          {"warn_fraction", s.warn_fraction},
          {"on_risk", s.raise ? "raise" : "warn"},
          {"verbose", s.verbose},
          {"iteration_scope", s.iteration_scope},
          {"max_iteration_ops", s.max_iteration_ops},
          {"max_iteration_s", s.max_iteration_s}};
}

ForecastEnvironment ForecastEnvironment::from_process() {
  ForecastEnvironment e;
  // PyTorch reads PYTORCH_ALLOC_CONF first, then the older name (c10/core/AllocatorConfig.cpp).
  e.alloc_conf = env_or_empty("PYTORCH_ALLOC_CONF");
  if (e.alloc_conf.empty()) e.alloc_conf = env_or_empty("PYTORCH_CUDA_ALLOC_CONF");
  e.cublas_workspace_config = env_or_empty("CUBLAS_WORKSPACE_CONFIG");
  e.cudnn_conv_wscap = env_or_empty("CUDNN_CONV_WSCAP_DBG");
  return e;
}

AutoVerdict forecast_traced_step(const Trace& trace, int64_t batch, const std::string& target,
                                 const AutoSettings& settings, const std::string& probe_device,
                                 const ForecastEnvironment& env) {
  MemoryForecastInput in;
  in.probes = {&trace};
  in.probe_batch = {batch};
  in.target_batch = batch;
  in.target = target;
  in.capacity_bytes = settings.capacity_mb * (int64_t{1} << 20);
  in.safety_fraction = settings.warn_fraction;
  in.probe_device = probe_device;
  in.allocator = with_error_code("allocator-config", [&] {
    return env.alloc_conf.empty() ? AllocatorConfig{} : AllocatorConfig::parse(env.alloc_conf);
  });
  in.cublas_workspace_config = env.cublas_workspace_config;
  in.cudnn_conv_wscap = env.cudnn_conv_wscap;
  return judge_forecast(forecast_memory(in), settings);
}

AutoVerdict judge_forecast(MemoryForecast forecast, const AutoSettings& settings) {
  AutoVerdict v;
  v.forecast = std::move(forecast);
  const MemoryForecast& f = v.forecast;
  v.capacity_bytes = settings.capacity_mb > 0 ? settings.capacity_mb * (int64_t{1} << 20) : f.capacity_bytes;
  v.need_bytes = f.peak_reserved_bytes + f.outside_allocator_bytes;
  v.judged = v.capacity_bytes > 0;
  const double limit = settings.warn_fraction * static_cast<double>(v.capacity_bytes);
  v.risk = v.judged && static_cast<double>(v.need_bytes) > limit;
  const std::string largest = f.max_batch_size > 0 ? fmt::format("the largest batch that fits is {}", f.max_batch_size)
                                                   : std::string("no batch size fits");
  if (v.risk) {
    v.message = fmt::format(
        "gpucast: out-of-memory risk on {}: the run needs {} MiB (reserved {} MiB + {} MiB outside the allocator) "
        "at batch {}, above {:.0f}% of {} MiB; {}",
        f.target, thousands(v.need_bytes / kMiBytes), thousands(f.peak_reserved_bytes / kMiBytes),
        thousands(f.outside_allocator_bytes / kMiBytes), f.batch_size, settings.warn_fraction * 100,
        thousands(v.capacity_bytes / kMiBytes), largest);
  } else if (v.judged) {
    v.message = fmt::format("gpucast: fits: peak reserved {} MiB of {} MiB on {}; largest batch {}",
                            thousands(f.peak_reserved_bytes / kMiBytes), thousands(v.capacity_bytes / kMiBytes), f.target,
                            f.max_batch_size > 0 ? std::to_string(f.max_batch_size) : "unknown");
  } else {
    v.message = fmt::format("gpucast: forecast: peak reserved {} MiB on {} (no capacity to judge against: give "
                            "capacity_mb)",
                            thousands(v.need_bytes / kMiBytes), f.target);
  }
  return v;
}

MemoryForecast memory_forecast_for_judging(const std::string& json_text) {
  const JsonFields r("memory forecast");
  const nlohmann::json j = parse_json_input(json_text, r.source());
  MemoryForecast f;
  f.target = r.get<std::string>(j, "target", "");
  f.batch_size = r.get<int64_t>(j, "batch_size", "");
  f.peak_reserved_bytes = r.get<int64_t>(j, "peak_reserved_bytes", "");
  f.outside_allocator_bytes = r.get<int64_t>(j, "outside_allocator_bytes", "");
  f.capacity_bytes = r.get<int64_t>(j, "capacity_bytes", "");
  f.max_batch_size = r.get<int64_t>(j, "max_batch_size", "");
  return f;
}

std::string resolve_auto_target(const std::string& device_name, int64_t total_bytes) {
  std::string upper = device_name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  auto has = [&](const char* key) { return upper.find(key) != std::string::npos; };
  if (upper.empty()) return "cpu";
  if (has("H200")) return "H200-141GB";
  if (has("H100")) return "H100-80GB";
  // The A100 comes in two sizes: 60 GiB lies between them.
  if (has("A100")) return total_bytes > (int64_t{60} << 30) ? "A100-80GB" : "A100-40GB";
  if (has("L4")) return "L4";
  if (has("V100")) return "V100-32GB";
  if (has("4090")) return "RTX-4090";
  return "cpu";
}

nlohmann::json auto_record(const AutoVerdict& v, const AutoRecordContext& c) {
  nlohmann::json r{{"schema_version", 1}, {"time", c.time}, {"mode", "auto"}, {"context", c.context}};
  if (c.rank) r["rank"] = *c.rank;
  if (c.world_size) r["world_size"] = *c.world_size;
  r["memory"] = memory_forecast_json(v.forecast);
  r["fits"] = v.judged ? nlohmann::json(!v.risk) : nlohmann::json(nullptr);
  r["capacity_fraction"] = v.judged ? nlohmann::json(static_cast<double>(v.need_bytes) / v.capacity_bytes)
                                    : nlohmann::json(nullptr);
  r["notes"] = c.notes;
  return r;
}

}  // namespace gpucast
