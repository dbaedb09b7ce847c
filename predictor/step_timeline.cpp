// The forecast step as a Chrome trace (gpucast/step_timeline.h).
#include "gpucast/step_timeline.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpucast/error.h"

namespace gpucast {
namespace {

using nlohmann::json;

// j[key] as T; a missing or mistyped field names its path.
template <typename T>
T field(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) GPUCAST_USER_ERROR("step timeline: field '{}{}' is missing", where, key);
  try {
    return it->template get<T>();
  } catch (const json::exception&) {
    GPUCAST_USER_ERROR("step timeline: field '{}{}' has the wrong type ({})", where, key, it->type_name());
  }
}

const json& list(const json& j, const char* key) {
  static const json kEmpty = json::array();
  const json& v = j.contains(key) ? j.at(key) : kEmpty;
  if (!v.is_array()) GPUCAST_USER_ERROR("step timeline: field '{}' should be a list, got {}", key, v.type_name());
  return v;
}

json span(const std::string& name, double start_ms, double end_ms, int64_t tid, const std::string& cat, json args) {
  return {{"name", name}, {"cat", cat}, {"ph", "X"}, {"pid", 0}, {"tid", tid}, {"ts", start_ms * 1e3},
          {"dur", std::max(end_ms - start_ms, 0.0) * 1e3}, {"args", std::move(args)}};
}

}  // namespace

std::string step_timeline_json(std::string_view forecast_json) {
  json f;
  try {
    f = json::parse(forecast_json.begin(), forecast_json.end());
  } catch (const json::parse_error& e) {
    GPUCAST_USER_ERROR("step timeline: the forecast is not JSON (byte {})", e.byte);
  }
  if (!f.is_object()) GPUCAST_USER_ERROR("step timeline: the forecast should be an object, got {}", f.type_name());
  const int64_t pp = field<int64_t>(f, "pp", "");
  if (pp < 1 || pp > (int64_t{1} << 20)) GPUCAST_USER_ERROR("step timeline: field 'pp' should be >= 1, got {}", pp);
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "gpucast forecast step"}}}});
  for (int64_t s = 0; s < pp; ++s) {
    const std::string prefix = pp > 1 ? fmt::format("stage {} ", s) : "";
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 2 * s},
                      {"args", {{"name", prefix + "compute"}}}});
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 2 * s + 1},
                      {"args", {{"name", prefix + "communication"}}}});
  }
  const json& compute = list(f, "compute");
  for (size_t i = 0; i < compute.size(); ++i) {
    const json& c = compute[i];
    const std::string where = fmt::format("compute[{}].", i);
    events.push_back(span(field<std::string>(c, "name", where), field<double>(c, "start_ms", where),
                          field<double>(c, "end_ms", where), 2 * field<int64_t>(c, "stage", where),
                          field<std::string>(c, "kind", where),
                          {{"micro_batch", field<int64_t>(c, "micro_batch", where)}}));
  }
  const json& comm = list(f, "comm");
  for (size_t i = 0; i < comm.size(); ++i) {
    const json& c = comm[i];
    const std::string where = fmt::format("comm[{}].", i);
    const double bytes = field<double>(c, "bytes", where);
    const int64_t stage = c.contains("stage") ? field<int64_t>(c, "stage", where) : 0;
    events.push_back(span(fmt::format("{} ({:.2f} MiB)", field<std::string>(c, "kind", where), bytes / (1 << 20)),
                          field<double>(c, "start_ms", where), field<double>(c, "end_ms", where), 2 * stage + 1,
                          "communication", {{"bytes", c.at("bytes")}}));
  }
  const double alpha = field<double>(f, "alpha", ""), beta = field<double>(f, "beta", "");
  if (alpha != 1.0 || beta != 1.0) {
    events.push_back({{"name", fmt::format("forecast step end (graph network: alpha {:.3f}, beta {:.3f}; uncorrected "
                                           "{:.3f} ms)",
                                           alpha, beta, field<double>(f, "uncorrected_step_ms", ""))},
                      {"ph", "i"}, {"s", "p"}, {"pid", 0}, {"tid", 0},
                      {"ts", field<double>(f, "step_ms", "") * 1e3}});
  }
  return json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace gpucast
