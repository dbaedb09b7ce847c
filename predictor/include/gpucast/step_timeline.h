// gpucast/step_timeline.h: a forecast step as a Chrome/Perfetto trace (Forecast.save_timeline), the exporter of
// the step-time forecast as trace_exporters.h is the trace's.
#pragma once

#include <string>
#include <string_view>

namespace gpucast {

// `forecast_json`: a step-time forecast as step_time_to_json writes it (the fields read: pp, compute, comm, step_ms,
// alpha, beta, uncorrected_step_ms; a missing or mistyped one is a UserError naming it). Per pipeline stage a
// compute thread (tid 2 x stage) and a communication thread (tid 2 x stage + 1); times in microseconds. Where the
// graph network corrected the step (alpha or beta not 1), the drawn schedule is the uncorrected one and an instant
// event marks where the corrected step ends.
std::string step_timeline_json(std::string_view forecast_json);

}  // namespace gpucast
