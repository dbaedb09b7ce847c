#include "gpucast/trace_json.h"

#include <cerrno>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <optional>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <set>

#include "gpucast/error.h"
#include "gpucast/files.h"
#include "gpucast/json_input.h"

namespace gpucast {
namespace {

using nlohmann::json;

// Strings. A trace's strings are bytes: a user scope's name (RECORD_USER_SCOPE), a module path or a note from C++
// may hold any, and the file must be UTF-8 (nlohmann's dump() throws on anything else; its error handlers replace
// or drop bytes, which cannot be undone). So, from schema version 3:
// - a string that is valid UTF-8 is a JSON string holding it, as before;
// - any other is {"escaped": text}: its valid UTF-8 sequences as they are, each backslash as \\ and each byte that
//   starts no valid sequence as \xNN (two upper-case hex digits). The text is UTF-8 and decodes to exactly the bytes.
// - object keys (the baseline's devices) cannot be objects: each is always that escaped text (a device name such as
//   "cuda:0" holds no backslash and reads the same).
// Every string the writers below put in a document goes through text_to_json or valid_utf8, so that their dump()
// never meets bytes that are not UTF-8 (the round-trip tests build traces with such bytes in every string field).

// The bytes valid_utf8(s, /*reversible=*/true) wrote, or nothing where a backslash starts neither \\ nor \xNN.
std::optional<std::string> unescape_bytes(std::string_view s) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out += s[i];
    } else if (i + 1 < s.size() && s[i + 1] == '\\') {
      out += '\\';
      i += 1;
    } else if (i + 3 < s.size() && s[i + 1] == 'x' && hex(s[i + 2]) >= 0 && hex(s[i + 3]) >= 0) {
      out += static_cast<char>(hex(s[i + 2]) * 16 + hex(s[i + 3]));
      i += 3;
    } else {
      return std::nullopt;
    }
  }
  return out;
}

json text_to_json(const std::string& s) {
  if (invalid_utf8_at(s) == std::string_view::npos) return s;
  return json{{"escaped", valid_utf8(s, /*reversible=*/true)}};
}

json texts_to_json(const std::vector<std::string>& list) {
  json a = json::array();
  for (const auto& s : list) a.push_back(text_to_json(s));
  return a;
}

json notes_to_json(const std::vector<Note>& notes) {
  json a = json::array();
  for (const Note& n : notes) a.push_back({{"code", text_to_json(n.code)}, {"text", text_to_json(n.text)}});
  return a;
}

json tensor_to_json(const TensorMeta& t) {
  return json{{"shape", t.shape}, {"strides", t.strides}, {"dtype", text_to_json(t.dtype)},
              {"device", text_to_json(t.device)}, {"storage", t.storage}};
}

// A double as JSON: a number (nlohmann writes the shortest text that reads back as the same double, -0.0 and
// denormals included), or the text "nan", "inf", "-inf", since JSON has no infinities or NaN (a mask's -inf fill
// value, a loss scale's inf).
json double_to_json(double x) {
  if (std::isfinite(x)) return x;
  return std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf");
}

// Scalars (schema version 3): {"type", "value"} with value, by type, "float": double_to_json; "int": a JSON integer,
// every digit of the int64_t; "bool": true or false; "complex": [real, imaginary], each as double_to_json.
// Versions 1 and 2 wrote no type and the value as a double (an int above 2^53 rounded, a complex as "other").
json value_to_json(const Value& v) {
  json j{{"kind", to_string(v.kind)}};
  if (v.kind == Value::Kind::Tensor && !v.tensors.empty()) {
    j.update(tensor_to_json(v.tensors.front()));
  } else if (v.kind == Value::Kind::TensorList) {
    json list = json::array();
    for (const auto& t : v.tensors) list.push_back(tensor_to_json(t));
    j["tensors"] = std::move(list);
  } else if (v.kind == Value::Kind::Scalar) {
    j["type"] = to_string(v.scalar_type);
    switch (v.scalar_type) {
      case Value::ScalarType::Float: j["value"] = double_to_json(v.scalar); break;
      case Value::ScalarType::Int: j["value"] = v.integer; break;
      case Value::ScalarType::Bool: j["value"] = v.integer != 0; break;
      case Value::ScalarType::Complex:
        j["value"] = json::array({double_to_json(v.scalar), double_to_json(v.imag)});
        break;
    }
  }
  return j;
}

json values_to_json(const std::vector<Value>& values) {
  json a = json::array();
  for (const auto& v : values) a.push_back(value_to_json(v));
  return a;
}

// Reading: through JsonFields (gpucast/json_input.h), every access names the field's path when it fails.

constexpr std::string_view kEscapedText =
    R"(text with each backslash written \\ and each byte that is not UTF-8 written \xNN (two hex digits))";

// A string as text_to_json writes it: a JSON string, or {"escaped": text} (read in files of any version: the
// records are read before the version is known, and no earlier writer wrote an object there).
std::string text_from_json(const JsonFields& r, const json& v, const std::string& path) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_object() || v.size() != 1 || !v.contains("escaped") || !v["escaped"].is_string()) {
    r.fail(path, R"(a string, or {"escaped": text})", v);
  }
  std::optional<std::string> bytes = unescape_bytes(v["escaped"].get_ref<const std::string&>());
  if (!bytes) r.fail(path + ".escaped", kEscapedText, v["escaped"]);
  return *std::move(bytes);
}

std::string get_text(const JsonFields& r, const json& obj, const char* key, const std::string& where) {
  return text_from_json(r, r.field(obj, key, where), where.empty() ? key : where + "." + key);
}

std::string get_text_or(const JsonFields& r, const json& obj, const char* key, const std::string& where,
                        const std::string& fallback) {
  if (!obj.is_object() || !obj.contains(key)) return fallback;
  return get_text(r, obj, key, where);
}

std::vector<std::string> texts_from_json(const JsonFields& r, const json& a, const std::string& path) {
  if (!a.is_array()) r.fail(path, "a list of strings", a);
  std::vector<std::string> out;
  for (size_t i = 0; i < a.size(); ++i) out.push_back(text_from_json(r, a[i], fmt::format("{}[{}]", path, i)));
  return out;
}

TensorMeta tensor_from_json(const JsonFields& r, const json& j, const std::string& where) {
  TensorMeta t;
  t.shape = r.get<std::vector<int64_t>>(j, "shape", where);
  t.strides = r.get_or<std::vector<int64_t>>(j, "strides", where, {});
  t.dtype = get_text(r, j, "dtype", where);
  t.device = get_text(r, j, "device", where);
  t.storage = r.get_or<uint64_t>(j, "storage", where, 0);
  return t;
}

// A double as double_to_json writes it: a number, or "inf", "-inf", "nan"; null, which version 1 wrote for a
// value that was not finite, reads as NaN where `null_is_nan` (a scalar without a type).
double double_from_json(const JsonFields& r, const json& v, const std::string& path, bool null_is_nan) {
  if (v.is_number()) return v.get<double>();
  if (v.is_null() && null_is_nan) return std::numeric_limits<double>::quiet_NaN();
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  }
  r.fail(path, R"(a number, "inf", "-inf" or "nan")", v);
}

// A scalar argument as value_to_json writes it. One without a "type" is as versions 1 and 2 wrote it: a float.
Value scalar_from_json(const JsonFields& r, const json& o, const std::string& where) {
  const json& v = r.field(o, "value", where);
  const std::string path = where + ".value";
  if (!o.contains("type")) return float_scalar(double_from_json(r, v, path, /*null_is_nan=*/true));
  Value::ScalarType type;
  try {
    type = scalar_type_from_string(r.get<std::string>(o, "type", where));
  } catch (const UserError&) {
    r.fail(where + ".type", "one of float, int, bool, complex", o["type"]);
  }
  switch (type) {
    case Value::ScalarType::Int: return int_scalar(r.as<int64_t>(v, path));
    case Value::ScalarType::Bool: return bool_scalar(r.as<bool>(v, path));
    case Value::ScalarType::Complex:
      if (!v.is_array() || v.size() != 2) r.fail(path, "[real, imaginary]", v);
      return complex_scalar(double_from_json(r, v[0], path + "[0]", false),
                            double_from_json(r, v[1], path + "[1]", false));
    case Value::ScalarType::Float: break;
  }
  return float_scalar(double_from_json(r, v, path, false));
}

std::vector<Value> values_from_json(const JsonFields& r, const json& a, const std::string& where) {
  std::vector<Value> out;
  if (!a.is_array()) r.fail(where, "a list", a);
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string w = fmt::format("{}[{}]", where, i);
    Value v;
    try {
      v.kind = value_kind_from_string(r.get<std::string>(a[i], "kind", w));
    } catch (const UserError&) {
      r.fail(w + ".kind", "one of none, tensor, tensor_list, scalar, other", a[i].value("kind", json()));
    }
    if (v.kind == Value::Kind::Tensor) {
      v.tensors.push_back(tensor_from_json(r, a[i], w));
    } else if (v.kind == Value::Kind::TensorList) {
      const json& list = r.field(a[i], "tensors", w);
      if (!list.is_array()) r.fail(w + ".tensors", "a list", list);
      for (size_t k = 0; k < list.size(); ++k) {
        v.tensors.push_back(tensor_from_json(r, list[k], fmt::format("{}.tensors[{}]", w, k)));
      }
    } else if (v.kind == Value::Kind::Scalar) {
      v = scalar_from_json(r, a[i], w);
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace

std::string ops_to_json(const Trace& trace, const std::vector<std::string>& names) {
  const std::set<std::string> wanted(names.begin(), names.end());
  json ops = json::array();
  const auto n = static_cast<int64_t>(trace.ops.size());
  for (const OpRecord& op : trace.ops) {
    if (wanted.count(op.name) == 0) continue;
    const bool has_parent = op.parent >= 0 && op.parent < n;
    ops.push_back({{"id", op.id},
                   {"name", text_to_json(op.name)},
                   {"phase", to_string(op.phase)},
                   {"parent", op.parent},
                   {"parent_name", text_to_json(has_parent ? trace.ops[static_cast<size_t>(op.parent)].name : "")},
                   {"module", text_to_json(op.module)},
                   {"inputs", values_to_json(op.inputs)}});
  }
  json j;
  j["ops"] = std::move(ops);
  return j.dump();
}

namespace {

json op_to_json(const OpRecord& op) {
  return {{"id", op.id},
          {"name", text_to_json(op.name)},
          {"overload", text_to_json(op.overload)},
          {"scope", to_string(op.scope)},
          {"phase", to_string(op.phase)},
          {"thread", op.thread},
          {"seq_nr", op.seq_nr},
          {"fwd_thread", op.fwd_thread},
          {"parent", op.parent},
          {"depth", op.depth},
          {"nested", op.nested},
          {"start_ns", op.start_ns},
          {"end_ns", op.end_ns},
          {"start_seq", op.start_seq},
          {"end_seq", op.end_seq},
          {"complete", op.complete},
          {"module", text_to_json(op.module)},
          {"fwd_op", op.fwd_op},
          {"bwd_node", op.bwd_node},
          {"device_ns", op.device_ns},
          {"inputs", values_to_json(op.inputs)},
          {"outputs", values_to_json(op.outputs)}};
}

json event_to_json(const MemEvent& e) {
  return {{"seq", e.seq},           {"ptr", e.ptr},   {"bytes", e.bytes},
          {"block_bytes", e.block_bytes}, {"device", text_to_json(e.device)}, {"thread", e.thread},
          {"op", e.op},             {"phase", to_string(e.phase)}, {"time_ns", e.time_ns},
          {"allocation", e.allocation}};
}

json allocation_to_json(const Allocation& a) {
  return {{"ptr", a.ptr},
          {"bytes", a.bytes},
          {"block_bytes", a.block_bytes},
          {"device", text_to_json(a.device)},
          {"baseline", a.baseline},
          {"alloc_event", a.alloc_event},
          {"free_event", a.free_event},
          {"alloc_op", a.alloc_op},
          {"free_op", a.free_op},
          {"category", to_string(a.category)}};
}

// Writes records [first, first + count) of `list` as a JSON array, one record's value built at a time.
template <typename T, typename F>
void write_records(std::ostream& out, const std::vector<T>& list, size_t first, size_t count, F to_json) {
  out << '[';
  const size_t end = std::min(list.size(), first + std::min(count, list.size()));
  for (size_t i = first; i < end; ++i) {
    if (i > first) out << ',';
    out << to_json(list[i]).dump();
  }
  out << ']';
}

// The document's fields other than its three record lists.
json header_value(const Trace& trace) {
  json j;
  j["schema_version"] = trace.schema_version;
  j["context"] = {{"gpucast_version", text_to_json(trace.context.gpucast_version)},
                  {"torch_version", text_to_json(trace.context.torch_version)},
                  {"device", text_to_json(trace.context.device)},
                  {"build_type", text_to_json(trace.context.build_type)},
                  {"cuda_build", trace.context.cuda_build}};
  j["start_ns"] = trace.start_ns;
  j["end_ns"] = trace.end_ns;
  json baseline = json::object();
  for (const auto& [dev, b] : trace.baseline) baseline[valid_utf8(dev, /*reversible=*/true)] = {{"bytes", b.bytes}, {"known", b.known}};
  j["baseline"] = std::move(baseline);
  const TraceCounters& c = trace.counters;
  j["counters"] = {{"dropped_ops", c.dropped_ops},           {"dropped_events", c.dropped_events},
                   {"unlinked_backward", c.unlinked_backward}, {"linked_backward", c.linked_backward},
                   {"unmatched_frees", c.unmatched_frees},     {"callback_errors", c.callback_errors},
                   {"threads", c.threads}};
  j["notes"] = notes_to_json(trace.notes);
  j["timing_source"] = text_to_json(trace.timing_source);
  if (!trace.timed_layers.empty()) j["timed_layers"] = texts_to_json(trace.timed_layers);
  return j;
}

}  // namespace

std::string trace_header_json(const Trace& trace) { return header_value(trace).dump(); }

void write_trace_json(const Trace& trace, std::ostream& out) {
  // The document is the header's fields and the three record lists, keys in nlohmann's (sorted) order, as one
  // json value would dump them; the lists are streamed, so that no copy of the whole trace is built in memory.
  json keys = header_value(trace);
  keys["ops"] = nullptr;
  keys["events"] = nullptr;
  keys["allocations"] = nullptr;
  out << '{';
  bool first = true;
  for (const auto& [key, value] : keys.items()) {
    out << (first ? "" : ",") << json(key).dump() << ':';
    first = false;
    if (key == "ops") write_records(out, trace.ops, 0, trace.ops.size(), op_to_json);
    else if (key == "events") write_records(out, trace.events, 0, trace.events.size(), event_to_json);
    else if (key == "allocations") write_records(out, trace.allocations, 0, trace.allocations.size(), allocation_to_json);
    else out << value.dump();
  }
  out << '}';
}

std::string trace_to_json(const Trace& trace) {
  std::ostringstream out;
  write_trace_json(trace, out);
  return out.str();
}

std::string trace_records_json(const Trace& trace, std::string_view kind, size_t first, size_t count) {
  std::ostringstream out;
  if (kind == "ops") write_records(out, trace.ops, first, count, op_to_json);
  else if (kind == "events") write_records(out, trace.events, first, count, event_to_json);
  else if (kind == "allocations") write_records(out, trace.allocations, first, count, allocation_to_json);
  else GPUCAST_USER_ERROR("trace records: kind should be ops, events or allocations, got '{}'", kind);
  return out.str();
}

namespace {

OpRecord op_from_json(const JsonFields& r, const json& o, size_t i) {
  const std::string w = fmt::format("ops[{}]", i);
  OpRecord op;
  op.id = r.get<int64_t>(o, "id", w);
  if (op.id != static_cast<int64_t>(i)) r.fail(w + ".id", fmt::format("{}", i), o["id"]);
  op.name = get_text(r, o, "name", w);
  op.overload = get_text_or(r, o, "overload", w, "");
  try {
    op.scope = scope_from_string(r.get<std::string>(o, "scope", w));
    op.phase = phase_from_string(r.get<std::string>(o, "phase", w));
  } catch (const UserError& e) {
    GPUCAST_USER_ERROR("{}: {}: {}", r.source(), w, e.what());
  }
  op.thread = r.get<uint64_t>(o, "thread", w);
  op.seq_nr = r.get_or<int64_t>(o, "seq_nr", w, -1);
  op.fwd_thread = r.get_or<uint64_t>(o, "fwd_thread", w, 0);
  op.parent = r.get_or<int64_t>(o, "parent", w, -1);
  op.depth = r.get_or<int32_t>(o, "depth", w, 0);
  op.nested = r.get_or<int64_t>(o, "nested", w, 0);
  op.start_ns = r.get<int64_t>(o, "start_ns", w);
  op.end_ns = r.get<int64_t>(o, "end_ns", w);
  op.start_seq = r.get_or<uint64_t>(o, "start_seq", w, 0);
  op.end_seq = r.get_or<uint64_t>(o, "end_seq", w, 0);
  op.complete = r.get_or<bool>(o, "complete", w, true);
  op.module = get_text_or(r, o, "module", w, "");
  op.fwd_op = r.get_or<int64_t>(o, "fwd_op", w, -1);
  op.bwd_node = r.get_or<int64_t>(o, "bwd_node", w, -1);
  op.device_ns = r.get_or<int64_t>(o, "device_ns", w, -1);
  if (o.contains("inputs")) op.inputs = values_from_json(r, o["inputs"], w + ".inputs");
  if (o.contains("outputs")) op.outputs = values_from_json(r, o["outputs"], w + ".outputs");
  return op;
}

// A block's bytes (negative for a free where allowed): at most kMaxTraceBlockBytes, so that sums over a trace's
// events cannot overflow.
void check_bytes(const JsonFields& r, int64_t bytes, const std::string& w, const json& got, bool negative) {
  if (bytes > kMaxTraceBlockBytes || bytes < (negative ? -kMaxTraceBlockBytes : 0)) {
    r.fail(w, fmt::format("a byte count {}up to {}", negative ? "(negative for a free) " : "of 0 ", kMaxTraceBlockBytes),
           got);
  }
}

// A record's "bytes" and "block_bytes" (block_bytes defaulting to bytes), each checked by check_bytes.
std::pair<int64_t, int64_t> sizes_from_json(const JsonFields& r, const json& o, const std::string& w, bool negative) {
  const auto bytes = r.get<int64_t>(o, "bytes", w);
  const auto block = r.get_or<int64_t>(o, "block_bytes", w, bytes);
  check_bytes(r, bytes, w + ".bytes", o["bytes"], negative);
  check_bytes(r, block, w + ".block_bytes", o.value("block_bytes", o["bytes"]), negative);
  return {bytes, block};
}

MemEvent event_from_json(const JsonFields& r, const json& o, size_t i) {
  const std::string w = fmt::format("events[{}]", i);
  MemEvent e;
  e.seq = r.get<uint64_t>(o, "seq", w);
  e.ptr = r.get<uint64_t>(o, "ptr", w);
  std::tie(e.bytes, e.block_bytes) = sizes_from_json(r, o, w, true);
  e.device = get_text(r, o, "device", w);
  e.thread = r.get_or<uint64_t>(o, "thread", w, 0);
  e.op = r.get_or<int64_t>(o, "op", w, -1);
  try {
    e.phase = phase_from_string(r.get_or<std::string>(o, "phase", w, "forward"));
  } catch (const UserError& err) {
    GPUCAST_USER_ERROR("{}: {}: {}", r.source(), w, err.what());
  }
  e.time_ns = r.get_or<int64_t>(o, "time_ns", w, 0);
  e.allocation = r.get_or<int64_t>(o, "allocation", w, -1);
  return e;
}

Allocation allocation_from_json(const JsonFields& r, const json& o, size_t i) {
  const std::string w = fmt::format("allocations[{}]", i);
  Allocation a;
  a.ptr = r.get<uint64_t>(o, "ptr", w);
  std::tie(a.bytes, a.block_bytes) = sizes_from_json(r, o, w, false);
  a.device = get_text(r, o, "device", w);
  a.baseline = r.get_or<bool>(o, "baseline", w, false);
  a.alloc_event = r.get_or<int64_t>(o, "alloc_event", w, -1);
  a.free_event = r.get_or<int64_t>(o, "free_event", w, -1);
  a.alloc_op = r.get_or<int64_t>(o, "alloc_op", w, -1);
  a.free_op = r.get_or<int64_t>(o, "free_op", w, -1);
  try {
    a.category = category_from_string(r.get_or<std::string>(o, "category", w, "other"));
  } catch (const UserError& err) {
    GPUCAST_USER_ERROR("{}: {}: {}", r.source(), w, err.what());
  }
  return a;
}

// The references between records, checked once all are read: each is -1 or an index into the list it names.
void check_references(const JsonFields& r, const Trace& t) {
  const auto n_ops = static_cast<int64_t>(t.ops.size());
  const auto n_events = static_cast<int64_t>(t.events.size());
  const auto n_allocs = static_cast<int64_t>(t.allocations.size());
  auto check = [&](int64_t ref, int64_t limit, const std::string& w) {
    if (ref < -1 || ref >= limit) r.fail(w, fmt::format("-1 or an index below {}", limit), json(ref));
  };
  for (size_t i = 0; i < t.ops.size(); ++i) {
    check(t.ops[i].parent, n_ops, fmt::format("ops[{}].parent", i));
    check(t.ops[i].fwd_op, n_ops, fmt::format("ops[{}].fwd_op", i));
    check(t.ops[i].bwd_node, n_ops, fmt::format("ops[{}].bwd_node", i));
  }
  for (size_t i = 0; i < t.events.size(); ++i) {
    check(t.events[i].op, n_ops, fmt::format("events[{}].op", i));
    check(t.events[i].allocation, n_allocs, fmt::format("events[{}].allocation", i));
  }
  for (size_t i = 0; i < t.allocations.size(); ++i) {
    check(t.allocations[i].alloc_event, n_events, fmt::format("allocations[{}].alloc_event", i));
    check(t.allocations[i].free_event, n_events, fmt::format("allocations[{}].free_event", i));
    check(t.allocations[i].alloc_op, n_ops, fmt::format("allocations[{}].alloc_op", i));
    check(t.allocations[i].free_op, n_ops, fmt::format("allocations[{}].free_op", i));
  }
}

// The notes: {"code", "text"} objects; version 1 wrote each as its text alone, read with the code "unclassified".
std::vector<Note> notes_from_json(const JsonFields& r, const json& j, int64_t version) {
  std::vector<Note> out;
  if (!j.contains("notes")) return out;
  const json& a = j["notes"];
  if (!a.is_array()) r.fail("notes", "a list", a);
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string w = fmt::format("notes[{}]", i);
    if (version == 1) out.push_back(Note{"unclassified", r.as<std::string>(a[i], w)});
    else out.push_back(Note{get_text(r, a[i], "code", w), get_text(r, a[i], "text", w)});
  }
  return out;
}

void read_header(const JsonFields& r, const json& j, int64_t version, Trace& t) {
  const json& ctx = r.field(j, "context", "");
  t.context.gpucast_version = get_text(r, ctx, "gpucast_version", "context");
  t.context.torch_version = get_text(r, ctx, "torch_version", "context");
  t.context.device = get_text(r, ctx, "device", "context");
  t.context.build_type = get_text_or(r, ctx, "build_type", "context", "");
  t.context.cuda_build = r.get_or<bool>(ctx, "cuda_build", "context", false);
  t.start_ns = r.get_or<int64_t>(j, "start_ns", "", 0);
  t.end_ns = r.get_or<int64_t>(j, "end_ns", "", 0);
  if (j.contains("baseline")) {
    const json& b = j["baseline"];
    if (!b.is_object()) r.fail("baseline", "an object", b);
    for (auto it = b.begin(); it != b.end(); ++it) {
      const std::string w = "baseline." + it.key();
      // Keys are escaped text from version 3 (valid_utf8, reversible); as they are before.
      std::optional<std::string> device = version >= 3 ? unescape_bytes(it.key()) : it.key();
      if (!device) r.fail("baseline", fmt::format("device names as {}", kEscapedText), json(it.key()));
      t.baseline[*device] = DeviceBaseline{r.get<int64_t>(it.value(), "bytes", w), r.get<bool>(it.value(), "known", w)};
    }
  }
  if (j.contains("counters")) {
    const json& c = j["counters"];
    if (!c.is_object()) r.fail("counters", "an object", c);
    TraceCounters& k = t.counters;
    k.dropped_ops = r.get_or<int64_t>(c, "dropped_ops", "counters", 0);
    k.dropped_events = r.get_or<int64_t>(c, "dropped_events", "counters", 0);
    k.unlinked_backward = r.get_or<int64_t>(c, "unlinked_backward", "counters", 0);
    k.linked_backward = r.get_or<int64_t>(c, "linked_backward", "counters", 0);
    k.unmatched_frees = r.get_or<int64_t>(c, "unmatched_frees", "counters", 0);
    k.callback_errors = r.get_or<int64_t>(c, "callback_errors", "counters", 0);
    k.threads = r.get_or<int64_t>(c, "threads", "counters", 0);
  }
  t.notes = notes_from_json(r, j, version);
  t.timing_source = get_text_or(r, j, "timing_source", "", "cpu_clock");
  if (j.contains("timed_layers")) t.timed_layers = texts_from_json(r, j["timed_layers"], "timed_layers");
  for (const char* list : {"ops", "events", "allocations"}) {
    const json& v = r.field(j, list, "");
    if (!v.is_array()) r.fail(list, "a list", v);
  }
}

}  // namespace

namespace {

// `parse` runs nlohmann's parser with the callback given to it, over a text or a file.
using ParseWith = std::function<json(const json::parser_callback_t&)>;

Trace read_trace(std::string_view source, const ParseWith& parse) {
  // Streamed: each record of the three lists becomes the Trace's as soon as it is parsed and is then dropped from
  // the document (nlohmann's parser callback), so reading never holds a second, far larger copy of the trace.
  // Keys come in any order (the writer sorts them: "allocations" before "schema_version"), so a record's error is
  // kept and raised only once the version is known to be this gpucast's.
  const JsonFields r(source);
  Trace t;
  std::string list;  // the top-level key whose value is being read
  size_t index = 0;
  std::optional<UserError> first_error;
  const json j = parse([&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) {
      list = parsed.get<std::string>();
      index = 0;
      return true;
    }
    if (depth != 2 || event != json::parse_event_t::object_end ||
        (list != "ops" && list != "events" && list != "allocations")) {
      return true;
    }
    if (!first_error) {
      try {
        if (list == "ops") t.ops.push_back(op_from_json(r, parsed, index));
        else if (list == "events") t.events.push_back(event_from_json(r, parsed, index));
        else t.allocations.push_back(allocation_from_json(r, parsed, index));
      } catch (const UserError& e) {
        first_error = e;
      }
    }
    ++index;
    return false;  // read: not kept in the document
  });
  if (!j.is_object() || !j.contains("schema_version")) {
    GPUCAST_USER_ERROR("{}: not a gpucast trace: no 'schema_version' field at the top level", source);
  }
  const int64_t version = r.get<int64_t>(j, "schema_version", "");
  if (version < kOldestTraceSchemaVersion || version > kTraceSchemaVersion) {
    GPUCAST_USER_ERROR(
        "{}: trace schema_version {} is not supported by this gpucast (reads versions {} to {}); record the "
        "trace again with this version",
        source, version, kOldestTraceSchemaVersion, kTraceSchemaVersion);
  }
  if (first_error) throw *first_error;
  read_header(r, j, version, t);
  check_references(r, t);
  return t;
}

}  // namespace

Trace trace_from_json(std::string_view text, std::string_view source) {
  return read_trace(source, [&](const json::parser_callback_t& cb) { return parse_json_input(text, source, cb); });
}

std::string trace_to_chrome_json(const Trace& trace) {
  // A viewer's file, never read back: strings that are not UTF-8 are shown with their bytes as \xNN (valid_utf8).
  json events = json::array();
  const int64_t t0 = trace.start_ns;
  // In double: a loaded file's clocks may lie anywhere in int64_t, where their difference would overflow.
  auto us = [t0](int64_t ns) { return (static_cast<double>(ns) - static_cast<double>(t0)) / 1000.0; };
  for (const OpRecord& op : trace.ops) {
    json args{{"id", op.id}, {"phase", to_string(op.phase)}, {"scope", to_string(op.scope)}};
    if (!op.module.empty()) args["module"] = valid_utf8(op.module);
    if (op.seq_nr >= 0) args["seq_nr"] = op.seq_nr;
    if (op.fwd_op >= 0) args["fwd_op"] = op.fwd_op;
    if (op.device_ns >= 0) args["device_us"] = static_cast<double>(op.device_ns) / 1000.0;
    json shapes = json::array();
    for (const Value& v : op.inputs) {
      if (v.kind == Value::Kind::Tensor && !v.tensors.empty()) shapes.push_back(v.tensors.front().shape);
      else shapes.push_back(json::array());
    }
    args["input_shapes"] = std::move(shapes);
    events.push_back({{"name", valid_utf8(op.name)},
                      {"cat", to_string(op.phase)},
                      {"ph", "X"},
                      {"ts", us(op.start_ns)},
                      {"dur", std::max(us(op.end_ns) - us(op.start_ns), 0.0)},
                      {"pid", 0},
                      {"tid", op.thread},
                      {"args", std::move(args)}});
  }
  std::map<std::string, int64_t> held;
  for (const MemEvent& e : trace.events) {
    int64_t& h = held[e.device];
    h += e.block_bytes;
    events.push_back({{"name", "bytes held (window) " + valid_utf8(e.device)},
                      {"ph", "C"},
                      {"ts", us(e.time_ns)},
                      {"pid", 0},
                      {"args", {{"bytes", h}}}});
  }
  json meta{{"schema_version", trace.schema_version},
            {"gpucast_version", valid_utf8(trace.context.gpucast_version)},
            {"torch_version", valid_utf8(trace.context.torch_version)},
            {"device", valid_utf8(trace.context.device)}};
  json doc{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", std::move(meta)}};
  return doc.dump();
}

Trace load_trace(const std::string& path) {
  return read_trace(path, [&](const json::parser_callback_t& cb) { return parse_json_file(path, cb); });
}

}  // namespace gpucast
