#include "gpucast/trace_exporters.h"

#include <algorithm>
#include <array>
#include <map>

#include <nlohmann/json.hpp>

#include "gpucast/error.h"

namespace gpucast {
namespace {

using nlohmann::json;

json frames_of(const Trace& t, int64_t op) {
  json frames = json::array();
  if (op < 0) return frames;
  const OpRecord& o = t.ops[op];
  // Shown in PyTorch's memory viewer: bytes that are not UTF-8 as \xNN (valid_utf8), so that dump() never throws.
  frames.push_back({{"filename", o.module.empty() ? "<no module>" : valid_utf8(o.module)}, {"line", 0},
                    {"name", valid_utf8(o.name)}});
  return frames;
}

}  // namespace

std::string trace_to_memory_snapshot_json(const Trace& t) {
  // Device order: cuda:0..n-1, then meta where the trace holds meta storages, then cpu (always last). Meta has a
  // trace of its own: its blocks are named by tokens, not addresses, and would overlap the CPU's in a segment.
  int max_cuda = -1;
  bool meta = false;
  for (const Allocation& a : t.allocations) {
    if (a.device.rfind("cuda:", 0) == 0) max_cuda = std::max(max_cuda, std::stoi(a.device.substr(5)));
    meta = meta || a.device == "meta";
  }
  auto device_index = [&](const std::string& dev) {
    if (dev.rfind("cuda:", 0) == 0) return std::stoi(dev.substr(5));
    if (dev == "meta") return max_cuda + 1;
    return max_cuda + (meta ? 2 : 1);
  };
  const int n_devices = max_cuda + (meta ? 3 : 2);
  json traces = json::array();
  for (int i = 0; i < n_devices; ++i) traces.push_back(json::array());
  for (const Allocation& a : t.allocations) {
    if (!a.baseline) continue;
    traces[device_index(a.device)].push_back({{"action", "alloc"}, {"addr", a.ptr}, {"size", a.block_bytes},
                                              {"stream", 0}, {"frames", json::array()}, {"category", "baseline"}});
  }
  for (const MemEvent& e : t.events) {
    const int d = device_index(e.device);
    const std::string category =
        e.allocation >= 0 ? std::string(to_string(t.allocations[e.allocation].category)) : std::string("unknown");
    if (e.bytes > 0) {
      traces[d].push_back({{"action", "alloc"}, {"addr", e.ptr}, {"size", e.block_bytes}, {"stream", 0},
                           {"frames", frames_of(t, e.op)}, {"category", category}, {"time_us", e.time_ns / 1000}});
    } else {
      for (const char* action : {"free_requested", "free_completed"}) {
        traces[d].push_back({{"action", action}, {"addr", e.ptr}, {"size", -e.block_bytes}, {"stream", 0},
                             {"frames", frames_of(t, e.op)}, {"time_us", e.time_ns / 1000}});
      }
    }
  }
  // Segments: per device, one range from the lowest to the highest live block at the end; on meta, whose tokens are
  // not addresses of the bytes they stand for (their ranges overlap), one segment per block.
  std::map<int, std::vector<const Allocation*>> live;
  for (const Allocation& a : t.allocations) {
    if (a.free_event < 0) live[device_index(a.device)].push_back(&a);
  }
  json segments = json::array();
  if (meta) {
    for (const Allocation* a : live[max_cuda + 1]) {
      segments.push_back({{"device", max_cuda + 1}, {"address", a->ptr}, {"total_size", a->block_bytes},
                          {"allocated_size", a->block_bytes}, {"stream", 0}, {"segment_type", "large"},
                          {"blocks", json::array({json{{"size", a->block_bytes}, {"state", "active_allocated"},
                                                       {"requested_size", a->bytes},
                                                       {"frames", frames_of(t, a->alloc_op)}}})}});
    }
    live.erase(max_cuda + 1);
  }
  for (auto& [d, blocks] : live) {
    std::sort(blocks.begin(), blocks.end(), [](const Allocation* x, const Allocation* y) { return x->ptr < y->ptr; });
    const uint64_t base = blocks.front()->ptr;
    json seg_blocks = json::array();
    uint64_t cursor = base;
    for (const Allocation* a : blocks) {
      if (a->ptr < cursor) continue;  // overlapping views cannot happen for blocks; skip defensively
      if (a->ptr > cursor) seg_blocks.push_back({{"size", a->ptr - cursor}, {"state", "inactive"}});
      seg_blocks.push_back({{"size", a->block_bytes}, {"state", "active_allocated"}, {"requested_size", a->bytes},
                            {"frames", frames_of(t, a->alloc_op)}});
      cursor = a->ptr + static_cast<uint64_t>(a->block_bytes);
    }
    segments.push_back({{"device", d}, {"address", base}, {"total_size", cursor - base},
                        {"allocated_size", cursor - base}, {"stream", 0}, {"segment_type", "large"},
                        {"blocks", std::move(seg_blocks)}});
  }
  return json{{"device_traces", std::move(traces)}, {"segments", std::move(segments)}}.dump();
}

std::string memory_series_json(const Trace& t, const std::string& device) {
  std::array<int64_t, kNumCategories> held{};
  for (const Allocation& a : t.allocations) {
    if (a.baseline && a.device == device) held[static_cast<size_t>(a.category)] += a.block_bytes;
  }
  json times = json::array(), events = json::array(), bytes = json::array();
  times.push_back(t.start_ns);
  events.push_back(-1);
  bytes.push_back(held);
  for (size_t i = 0; i < t.events.size(); ++i) {
    const MemEvent& e = t.events[i];
    if (e.device != device || e.allocation < 0) continue;
    held[static_cast<size_t>(t.allocations[e.allocation].category)] += e.block_bytes;
    times.push_back(e.time_ns);
    events.push_back(static_cast<int64_t>(i));
    bytes.push_back(held);
  }
  json cats = json::array();
  for (int c = 0; c < kNumCategories; ++c) cats.push_back(to_string(static_cast<Category>(c)));
  return json{{"device", device}, {"categories", cats}, {"time_ns", times}, {"event", events}, {"bytes", bytes}}.dump();
}

}  // namespace gpucast
