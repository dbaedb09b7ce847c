// gpucast/trace_json.h: a Trace to and from JSON, and to Perfetto's Chrome trace format.
#pragma once

#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

// The largest block a trace file may hold (1 TiB: more than any device has; an H200 holds 141 GB). Bounding each
// block keeps sums over a trace's events far from int64_t's range.
inline constexpr int64_t kMaxTraceBlockBytes = int64_t{1} << 40;

// The trace as JSON: the whole document (trace_to_json), or streamed to `out` one record at a time
// (write_trace_json: what Trace.save writes, without a second copy of the trace in memory).
std::string trace_to_json(const Trace& trace);
void write_trace_json(const Trace& trace, std::ostream& out);
// The document without its record lists: schema_version, context, counters, notes... (small at any size).
std::string trace_header_json(const Trace& trace);
// Records [first, first + count) of "ops", "events" or "allocations", as a JSON array (a lazy view's chunk).
std::string trace_records_json(const Trace& trace, std::string_view kind, size_t first, size_t count);
// The ops named in `names` only, each with its id (its index), name, phase, parent (index and name), module and
// inputs: {"ops": [...]}, a fraction of the whole document for a large trace.
std::string ops_to_json(const Trace& trace, const std::vector<std::string>& names);
// Throws UserError naming the position of malformed JSON, an unsupported schema_version, or the
// missing/ill-typed field; `source` (a path, or "<string>") is named in the message.
Trace trace_from_json(std::string_view text, std::string_view source = "<string>");

// Chrome trace event format (opens in Perfetto and chrome://tracing): one track per thread for ops,
// one counter track per device for bytes held in the window.
std::string trace_to_chrome_json(const Trace& trace);

// A saved trace (gpucast/files.h reads it; errors name the path and the reason).
Trace load_trace(const std::string& path);

}  // namespace gpucast
