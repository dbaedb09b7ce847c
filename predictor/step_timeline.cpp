// The forecast step as a Chrome trace (gpucast/step_timeline.h).
#include "gpucast/step_timeline.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpucast/error.h"
#include "gpucast/json_input.h"

namespace gpucast {
namespace {

using nlohmann::json;

// A list field of the forecast (absent: empty).
const json& list(const JsonFields& r, const json& j, const char* key) {
  static const json kEmpty = json::array();
  const json& v = j.contains(key) ? j.at(key) : kEmpty;
  if (!v.is_array()) r.fail(key, "a list", v);
  return v;
}

json span(const std::string& name, double start_ms, double end_ms, int64_t tid, const std::string& cat, json args) {
  return {{"name", name}, {"cat", cat}, {"ph", "X"}, {"pid", 0}, {"tid", tid}, {"ts", start_ms * 1e3},
          {"dur", std::max(end_ms - start_ms, 0.0) * 1e3}, {"args", std::move(args)}};
}

}  // namespace

std::string step_timeline_json(std::string_view forecast_json) {
  const JsonFields r("step timeline");
  const json f = parse_json_input(forecast_json, r.source());
  if (!f.is_object()) r.fail("", "an object (a step-time forecast)", f);
  const int64_t pp = r.get<int64_t>(f, "pp", "");
  if (pp < 1 || pp > (int64_t{1} << 20)) r.fail("pp", "an integer from 1 to 2^20", f["pp"]);
  // A span's row: its stage's (2 * stage for compute, + 1 for communication), the stage checked against pp.
  auto stage_of = [&](const json& c, const std::string& where) -> int64_t {
    if (!c.contains("stage")) return 0;
    const int64_t stage = r.get<int64_t>(c, "stage", where);
    if (stage < 0 || stage >= pp) r.fail(where + ".stage", fmt::format("a stage from 0 to {}", pp - 1), c["stage"]);
    return stage;
  };
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "gpucast forecast step"}}}});
  for (int64_t s = 0; s < pp; ++s) {
    const std::string prefix = pp > 1 ? fmt::format("stage {} ", s) : "";
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 2 * s},
                      {"args", {{"name", prefix + "compute"}}}});
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 2 * s + 1},
                      {"args", {{"name", prefix + "communication"}}}});
  }
  const json& compute = list(r, f, "compute");
  for (size_t i = 0; i < compute.size(); ++i) {
    const json& c = compute[i];
    const std::string where = fmt::format("compute[{}]", i);
    r.field(c, "stage", where);  // required here
    events.push_back(span(r.get<std::string>(c, "name", where), r.get<double>(c, "start_ms", where),
                          r.get<double>(c, "end_ms", where), 2 * stage_of(c, where), r.get<std::string>(c, "kind", where),
                          {{"micro_batch", r.get<int64_t>(c, "micro_batch", where)}}));
  }
  const json& comm = list(r, f, "comm");
  for (size_t i = 0; i < comm.size(); ++i) {
    const json& c = comm[i];
    const std::string where = fmt::format("comm[{}]", i);
    const double bytes = r.get<double>(c, "bytes", where);
    events.push_back(span(fmt::format("{} ({:.2f} MiB)", r.get<std::string>(c, "kind", where), bytes / (1 << 20)),
                          r.get<double>(c, "start_ms", where), r.get<double>(c, "end_ms", where),
                          2 * stage_of(c, where) + 1, "communication", {{"bytes", c.at("bytes")}}));
  }
  const double alpha = r.get<double>(f, "alpha", ""), beta = r.get<double>(f, "beta", "");
  if (alpha != 1.0 || beta != 1.0) {
    events.push_back({{"name", fmt::format("forecast step end (graph network: alpha {:.3f}, beta {:.3f}; uncorrected "
                                           "{:.3f} ms)",
                                           alpha, beta, r.get<double>(f, "uncorrected_step_ms", ""))},
                      {"ph", "i"}, {"s", "p"}, {"pid", 0}, {"tid", 0},
                      {"ts", r.get<double>(f, "step_ms", "") * 1e3}});
  }
  return json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace gpucast
