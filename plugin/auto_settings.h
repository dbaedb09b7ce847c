// auto_settings.h (plugin, private): what auto mode decides, in plain C++ (no torch): its configuration as read
// from GPUCAST_CONF, the forecast from one traced iteration at the real batch, the out-of-memory judgement, and the
// record it appends to GPUCAST_LOG. auto_mode.cpp runs it inside the training job; tests run it on traces.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "gpucast/memory_forecast.h"
#include "gpucast/trace.h"

namespace gpucast {

struct AutoSettings {
  bool enabled = false;
  std::string target = "auto";  // "auto", "cpu", a device table name (its spelling), or any name with capacity_mb
  int64_t capacity_mb = 0;
  double warn_fraction = 0.9;
  bool raise = false;  // on_risk:raise
  bool verbose = false;
  std::string iteration_scope;
  int64_t max_iteration_ops = 1000000;
  int64_t max_iteration_s = 600;
};

// GPUCAST_CONF's text read and checked: throws UserError (code "auto-config") naming the key, what it expects and
// what was given; an unknown target without capacity_mb lists the known ones.
AutoSettings read_auto_settings(std::string_view text);
nlohmann::json auto_settings_json(const AutoSettings& s);

// What PyTorch reads from the environment and the forecast models, as PyTorch reads it: PYTORCH_ALLOC_CONF (else
// PYTORCH_CUDA_ALLOC_CONF), CUBLAS_WORKSPACE_CONFIG, CUDNN_CONV_WSCAP_DBG.
struct ForecastEnvironment {
  std::string alloc_conf;
  std::string cublas_workspace_config;
  std::string cudnn_conv_wscap;
  static ForecastEnvironment from_process();
};

// The run's forecast from one traced iteration at its real batch, and the judgement against the capacity.
struct AutoVerdict {
  MemoryForecast forecast;
  int64_t capacity_bytes = 0;  // settings' capacity, else the target's (0: none known, as for cpu)
  int64_t need_bytes = 0;      // reserved + outside the allocator
  bool judged = false;         // a capacity was known
  bool risk = false;           // need > warn_fraction x capacity
  std::string message;         // the warning or error text when at risk, else the verbose line ("gpucast: fits: ...")
};

// `f` judged against the capacity (settings' capacity_mb, else the forecast's) at settings' warn_fraction.
AutoVerdict judge_forecast(MemoryForecast f, const AutoSettings& settings);
// The fields judge_forecast reads (target, batch_size, peak_reserved_bytes, outside_allocator_bytes,
// capacity_bytes, max_batch_size) from a forecast's JSON (memory_forecast_json's document); UserError naming the
// field otherwise.
MemoryForecast memory_forecast_for_judging(const std::string& json_text);

// `target` already resolved ("auto" to a name, see resolve_auto_target); `probe_device` "cpu" or "cuda:N".
AutoVerdict forecast_traced_step(const Trace& trace, int64_t batch, const std::string& target,
                                 const AutoSettings& settings, const std::string& probe_device,
                                 const ForecastEnvironment& env);

// The device table name of a GPU called `device_name` with `total_bytes` of memory ("NVIDIA H100 80GB HBM3"):
// "cpu" when there is none or the table has no such GPU.
std::string resolve_auto_target(const std::string& device_name, int64_t total_bytes);

// Where the record comes from: rank and world size when the launcher set them (RANK, WORLD_SIZE: torchrun's).
struct AutoRecordContext {
  nlohmann::json context;  // the context block (gpucast and torch versions, device, build type)
  double time = 0;         // seconds since the epoch
  std::optional<int64_t> rank, world_size;
  std::vector<Note> notes;  // auto mode's own notes (interrupted iterations, ...)
};
// GPUCAST_LOG's record: schema_version, time, mode "auto", context, rank/world_size, memory (the forecast), fits,
// capacity_fraction (null without a capacity), notes.
nlohmann::json auto_record(const AutoVerdict& v, const AutoRecordContext& c);

}  // namespace gpucast
