#include "gpucast/memory_forecast.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "gpucast/config.h"
#include "gpucast/checked.h"
#include "gpucast/error.h"
#include "gpucast/layer_model.h"
#include "gpucast/step_time.h"
#include "gpucast/trace_summary.h"
#include "least_squares.h"
#include "fsdp_memory.h"
#include "memory_plan.h"
#include "moe_routing.h"
#include "gpucast/note_json.h"

namespace gpucast {

// ---------------------------------------------------------------------------------------------------
// Device table. Capacities are the totals the driver reports (nvidia-smi memory.total); context bytes are
// typical CUDA 12/13 contexts with lazy module loading and PyTorch's kernels, measured values vary by a few
// hundred MiB with the driver: override with capacity= when you know yours. Default links: the GPU's usual
// node (DGX / HGX A100, H100, H200: 8 GPUs on NVLink 3 / 4 and one InfiniBand HDR / NDR NIC per GPU; the PCIe
// cards: 8 per node over PCIe and 100 Gb/s Ethernet).

// Compute capabilities: NVIDIA's CUDA GPUs table (developer.nvidia.com/cuda-gpus).
const std::vector<DeviceSpec>& device_table() {
  static const std::vector<DeviceSpec> table = {
      // Context bytes (520 MiB A100, 560 MiB H100 / H200, 420 MiB the others): estimates, no source; no measurement of
      // them is recorded here (measure: nvidia-smi used minus torch.cuda.memory_reserved() after a step).
      {"A100-40GB", 40960 * kMiB, 80, 520 * kMiB, "NVIDIA A100 datasheet (40 GB HBM2); nvidia-smi 40960 MiB",
       "intra:nvlink3,gpus_per_node:8,inter:ib-hdr"},
      {"A100-80GB", 81920 * kMiB, 80, 520 * kMiB, "NVIDIA A100 datasheet (80 GB HBM2e); nvidia-smi 81920 MiB",
       "intra:nvlink3,gpus_per_node:8,inter:ib-hdr"},
      {"H100-80GB", 81559 * kMiB, 90, 560 * kMiB, "NVIDIA H100 SXM datasheet (80 GB HBM3); nvidia-smi 81559 MiB",
       "intra:nvlink4,gpus_per_node:8,inter:ib-ndr"},
      {"H200-141GB", 143771 * kMiB, 90, 560 * kMiB, "NVIDIA H200 datasheet (141 GB HBM3e); nvidia-smi 143771 MiB",
       "intra:nvlink4,gpus_per_node:8,inter:ib-ndr"},
      {"L4", 23034 * kMiB, 89, 420 * kMiB, "NVIDIA L4 datasheet (24 GB GDDR6); nvidia-smi 23034 MiB",
       "intra:pcie4,gpus_per_node:8,inter:eth-100g"},
      {"V100-32GB", 32768 * kMiB, 70, 420 * kMiB, "NVIDIA V100 datasheet (32 GB HBM2); nvidia-smi 32768 MiB",
       "intra:pcie3,gpus_per_node:8,inter:eth-100g"},
      {"RTX-4090", 24564 * kMiB, 89, 420 * kMiB, "NVIDIA GeForce RTX 4090 specifications (24 GB GDDR6X); nvidia-smi 24564 MiB",
       "intra:pcie4,gpus_per_node:8,inter:eth-100g"},
  };
  return table;
}

const DeviceSpec* lookup_device(const std::string& name) {
  for (const DeviceSpec& d : device_table()) {
    if (ascii_lower(d.name) == ascii_lower(name)) return &d;
  }
  return nullptr;
}

std::string known_targets() {
  std::string known = "cpu";
  for (const DeviceSpec& d : device_table()) known += ", " + d.name;
  return known;
}

std::string canonical_target(const std::string& name, int64_t capacity_bytes) {
  if (ascii_lower(name) == "cpu") return "cpu";
  if (const DeviceSpec* d = lookup_device(name)) return d->name;
  if (capacity_bytes > 0 && !name.empty()) return name;
  return find_device(name).name;  // throws, listing the known names
}

const DeviceSpec& find_device(const std::string& name) {
  if (const DeviceSpec* d = lookup_device(name)) return *d;
  GPUCAST_USER_ERROR("unknown target '{}'; known targets: {} (or give a capacity for another GPU)", name,
                     known_targets());
}

int64_t cublas_workspace_bytes(int compute_capability, const std::string& config) {
  // PyTorch's default (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize): ":4096:2:16:8", and
  // 4096 * 8 * 1024 on Hopper (compute capability 9; recent versions also on Blackwell's 10 and 12).
  if (config.empty()) return compute_capability >= 90 ? 32 * kMiB : 4096 * 1024 * 2 + 16 * 1024 * 8;
  // ":SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]"
  std::vector<int64_t> numbers;
  size_t i = 0;
  while (i < config.size()) {
    if (config[i] != ':') break;
    size_t j = i + 1;
    while (j < config.size() && std::isdigit(static_cast<unsigned char>(config[j]))) ++j;
    if (j == i + 1) break;
    numbers.push_back(std::stoll(config.substr(i + 1, j - i - 1)));
    i = j;
  }
  if (i != config.size() || numbers.empty() || numbers.size() % 2 != 0) {
    GPUCAST_USER_ERROR("CUBLAS_WORKSPACE_CONFIG: expected ':SIZE_KiB:COUNT' pairs such as ':4096:8', got '{}'", config);
  }
  int64_t total = 0;
  for (size_t k = 0; k < numbers.size(); k += 2) total += numbers[k] * 1024 * numbers[k + 1];
  return total;
}

int64_t cudnn_conv_wscap_bytes(const std::string& text) {
  if (text.empty()) return -1;
  // 12 digits: under 10^12 MiB, whose bytes (about 2^60) fit int64_t.
  const bool digits = text.size() <= 12 && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) != 0;
  });
  if (!digits) {
    GPUCAST_USER_ERROR("CUDNN_CONV_WSCAP_DBG: expected a whole number of MiB such as '256', got '{}'", text);
  }
  return std::stoll(text) * kMiB;
}

// ---------------------------------------------------------------------------------------------------
// Streams

namespace {

using detail::Entry;
using detail::initial_ref;
using detail::insert_before;
using detail::kNone;
using detail::kSecondIterationRef;
using detail::Planned;

struct Stream {
  std::vector<int64_t> initial_bytes;
  std::vector<uint64_t> ptr_of;     // allocation position -> the block's address in the probe
  std::vector<Category> initial_category;
  std::vector<Entry> entries;
  int iterations = 1;
  int64_t zero_grad_entry = kNone;  // first entry inside an Optimizer.zero_grad scope before backward
  bool adam = false;
  bool fused_optimizer = false;     // aten::_fused_adam(w)_ in the trace: no foreach temporaries on CUDA either
};

// The allocations a call frees before it returns (its scratch): refs allocated and freed by entries of the same
// call, `call_of` naming each entry's call (`none` outside any).
template <class Key, class CallOf>
std::unordered_set<int64_t> freed_in_their_call(const std::vector<Entry>& entries, const Key& none, CallOf call_of) {
  std::map<int64_t, Key> alloc_call;  // ref -> call that allocated it
  for (const Entry& e : entries) {
    if (!e.alloc) continue;
    const Key k = call_of(e);
    if (k != none) alloc_call[e.ref] = k;
  }
  std::unordered_set<int64_t> out;
  for (const Entry& e : entries) {
    if (e.alloc) continue;
    auto it = alloc_call.find(e.ref);
    if (it != alloc_call.end() && it->second == call_of(e)) out.insert(e.ref);
  }
  return out;
}

// For each op of `ops`, the outermost op it runs in (itself included) for which is_call holds; kNone outside any.
// Each op's answer comes from its parent's, in whatever order the ops are held: walk up to an op already answered,
// then answer the ops on the way down; is_call is asked once per op.
template <class IsCall>
std::vector<int64_t> outermost_calls(const std::vector<OpRecord>& ops, IsCall is_call) {
  const int64_t n = static_cast<int64_t>(ops.size());
  std::vector<int64_t> out(ops.size(), kNone);
  std::vector<char> done(ops.size(), 0);
  std::vector<int64_t> chain;
  for (int64_t i = 0; i < n; ++i) {
    chain.clear();
    for (int64_t j = i; j >= 0 && j < n && !done[j] && static_cast<int64_t>(chain.size()) <= n; j = ops[j].parent) {
      chain.push_back(j);
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      const int64_t j = *it, parent = ops[j].parent;
      const int64_t above = parent >= 0 && parent < n && done[parent] ? out[parent] : kNone;
      out[j] = above != kNone ? above : is_call(ops[j]) ? j : kNone;
      done[j] = 1;
    }
  }
  return out;
}

// Ops that only allocate, cast, copy, fill or view: what a kernel calls through ATen for its outputs and scratch
// (kernel_call_of in the forecaster).
bool kernel_primitive(const std::string& name) {
  static const std::unordered_set<std::string> kNames = {
      "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
      "aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::scalar_tensor", "aten::resize_", "aten::to",
      "aten::_to_copy", "aten::copy_", "aten::fill_", "aten::zero_", "aten::as_strided", "aten::view",
      "aten::_reshape_alias", "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::select",
      "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::contiguous"};
  return kNames.count(name) != 0;
}

// Whether op `outer` is op `inner` or encloses it (64: a chosen guard, deeper than any nesting a trace holds).
bool encloses(const std::vector<OpRecord>& ops, int64_t outer, int64_t inner) {
  const auto n = static_cast<int64_t>(ops.size());
  for (int depth = 0; inner >= 0 && inner < n && depth < 64; ++depth) {
    if (inner == outer) return true;
    inner = ops[static_cast<size_t>(inner)].parent;
  }
  return false;
}

// Whether a block on device `on` is in the stream of probes on `probe_device`. Meta probes: a meta job's CPU
// tensors (AdamW's step counts, made on the CPU whatever the parameters' device: torch/optim/adam.py
// _init_group) are recorded beside its meta ones, as CPU probes record both on the CPU: the stream holds both.
bool in_probe_stream(const std::string& on, const std::string& probe_device) {
  return on == probe_device || (probe_device == "meta" && on == "cpu");
}

Stream extract(const Trace& t, const std::string& device, const std::unordered_set<uint64_t>& exclude) {
  Stream s;
  // Iteration boundaries: the end of each optimizer step.
  std::vector<uint64_t> ends = iteration_ends(t);
  std::sort(ends.begin(), ends.end());
  uint64_t zero_grad_start = 0, zero_grad_end = 0, first_backward = ~uint64_t{0};
  for (const OpRecord& op : t.ops) {
    if (is_optimizer_step(op) && op.name.find("Adam") != std::string::npos) s.adam = true;
    if (op.scope == Scope::UserScope && op.name.rfind("Optimizer.zero_grad#", 0) == 0 && zero_grad_start == 0) {
      zero_grad_start = op.start_seq;
      zero_grad_end = op.end_seq;
    }
    if (op.phase == Phase::Backward) first_backward = std::min(first_backward, op.start_seq);
    if (op.name.rfind("aten::_fused_adam", 0) == 0) s.fused_optimizer = true;
  }
  if (t.ops.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max()) ||
      ends.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    GPUCAST_USER_ERROR("forecast: a probe trace of {} ops and {} iterations; at most 2^31 - 1 of each",
                       t.ops.size(), ends.size());
  }
  s.iterations = std::max<int>(1, static_cast<int>(ends.size()));
  // Allocation index -> position (kUnplaced: not in this stream).
  constexpr int64_t kUnplaced = std::numeric_limits<int64_t>::min();
  std::vector<int64_t> position(t.allocations.size(), kUnplaced);
  for (size_t a = 0; a < t.allocations.size(); ++a) {
    const Allocation& al = t.allocations[a];
    if (!al.baseline || !in_probe_stream(al.device, device) || exclude.count(al.ptr) != 0) continue;
    // Meta probes: a CPU block held from the start that no hook claimed is the process's (a dataset, a copy), not
    // the job's, whose tensors are meta; CPU probes cannot tell them apart from the job's.
    if (device == "meta" && al.device == "cpu" && al.category == Category::Other) continue;
    position[a] = initial_ref(s.initial_bytes.size());
    s.initial_bytes.push_back(al.block_bytes);
    s.initial_category.push_back(al.category);
  }
  // The CUDA allocator reports what is held at the start but not block by block: one block stands for the rest.
  auto base = t.baseline.find(device);
  if (base != t.baseline.end() && base->second.known) {
    int64_t listed = 0;  // every block the allocator listed, excluded ones too
    for (const Allocation& al : t.allocations) {
      if (al.baseline && al.device == device) listed += al.block_bytes;
    }
    if (base->second.bytes > listed) {
      s.initial_bytes.push_back(base->second.bytes - listed);
      s.initial_category.push_back(Category::Other);
    }
  }
  // Sized exactly up front: a vector grown by doubling holds up to twice its entries, and both copies while it grows.
  size_t entries = 0, allocations = 0;
  for (const MemEvent& e : t.events) {
    if (!in_probe_stream(e.device, device) || e.allocation < 0) continue;
    ++entries;
    if (e.bytes > 0) ++allocations;
  }
  s.entries.reserve(entries);
  s.ptr_of.reserve(allocations);
  int64_t next = 0;
  for (const MemEvent& e : t.events) {
    if (!in_probe_stream(e.device, device) || e.allocation < 0) continue;
    const Allocation& al = t.allocations[e.allocation];
    Entry en;
    en.alloc = e.bytes > 0;
    en.category = al.category;
    en.phase = e.phase;
    en.op = static_cast<int32_t>(e.op);
    // 1 + the iterations that ended before it (ends sorted above).
    const auto ended = std::lower_bound(ends.begin(), ends.end(), e.seq) - ends.begin();
    en.iteration = static_cast<int32_t>(std::min<int64_t>(1 + ended, s.iterations));
    if (en.alloc) {
      en.ref = next++;
      en.bytes = al.block_bytes;
      en.probe_block = e.ptr != 0;
      s.ptr_of.push_back(e.ptr);
      position[static_cast<size_t>(e.allocation)] = en.ref;
    } else {
      const int64_t at = position[static_cast<size_t>(e.allocation)];
      if (at == kUnplaced) continue;  // an excluded block
      // Blocks held at the start that no hook claimed, freed meanwhile: garbage collection or other threads of
      // the process, not the training step. Leaving them out keeps probes comparable (and errs high).
      if (at < 0 && al.category == Category::Other) continue;
      en.ref = at;
    }
    if (zero_grad_start != 0 && s.zero_grad_entry == kNone && e.seq > zero_grad_start && e.seq < zero_grad_end &&
        e.seq < first_backward) {
      s.zero_grad_entry = static_cast<int64_t>(s.entries.size());
    }
    s.entries.push_back(en);
  }
  if (zero_grad_start != 0 && zero_grad_start < first_backward && s.zero_grad_entry == kNone) {
    // zero_grad freed nothing (the first iteration): place it at the first entry after its scope.
    for (size_t i = 0; i < s.entries.size(); ++i) {
      if (s.entries[i].op >= 0 && t.ops[s.entries[i].op].start_seq > zero_grad_end) {
        s.zero_grad_entry = static_cast<int64_t>(i);
        break;
      }
    }
  }
  return s;
}

bool uses_im2col_conv(const Trace& t) {
  return std::any_of(t.ops.begin(), t.ops.end(), [](const OpRecord& op) { return is_im2col_conv(op.name); });
}

// Where two probes' structures first differ; empty when they match.
std::string structure_difference(const Stream& a, const Trace& ta, const Stream& b, const Trace& tb) {
  const size_t n = std::min(a.entries.size(), b.entries.size());
  auto op_name = [](const Trace& t, int64_t op) { return op >= 0 ? t.ops[op].name : std::string("<no op>"); };
  for (size_t i = 0; i < n; ++i) {
    const Entry& x = a.entries[i];
    const Entry& y = b.entries[i];
    const bool same_op = op_name(ta, x.op) == op_name(tb, y.op);
    // Blocks held at the start are compared by category: their number may differ between probes.
    const bool same_ref = x.ref < 0 || y.ref < 0 ? (x.ref < 0 && y.ref < 0 && x.category == y.category) : x.ref == y.ref;
    if (x.alloc != y.alloc || !same_ref || !same_op) {
      const std::string where_a = x.op >= 0 ? ta.ops[x.op].module : "";
      return fmt::format("memory event {}: {} in {} ({}) against {} in {} ({})", i, x.alloc ? "allocation" : "free",
                         op_name(ta, x.op), where_a.empty() ? "no module" : where_a, y.alloc ? "allocation" : "free",
                         op_name(tb, y.op), y.op >= 0 && !tb.ops[y.op].module.empty() ? tb.ops[y.op].module : "no module");
    }
  }
  if (a.entries.size() != b.entries.size()) {
    return fmt::format("{} memory events against {}", a.entries.size(), b.entries.size());
  }
  return "";
}

// Where two probes' top-level ops (those no other op encloses: what the training code called, and the backward
// nodes) first differ; empty when they are the same sequence. Probes with the same top-level ops whose memory
// events differ ran other kernels inside them (cuDNN and cuBLAS choose by size; a large CUDA reduction stages
// through a buffer): their allocations can be matched op by op. Other top-level ops mean other control flow.
std::string op_sequence_difference(const Trace& a, const Trace& b) {
  std::vector<const OpRecord*> x, y;
  for (const OpRecord& op : a.ops) {
    if (op.parent < 0) x.push_back(&op);
  }
  for (const OpRecord& op : b.ops) {
    if (op.parent < 0) y.push_back(&op);
  }
  const size_t n = std::min(x.size(), y.size());
  for (size_t i = 0; i < n; ++i) {
    if (x[i]->name != y[i]->name) {
      return fmt::format("top-level op {}: {} ({}) against {} ({})", i, x[i]->name,
                         x[i]->module.empty() ? "no module" : x[i]->module, y[i]->name,
                         y[i]->module.empty() ? "no module" : y[i]->module);
    }
  }
  if (x.size() != y.size()) return fmt::format("{} top-level ops against {}", x.size(), y.size());
  return "";
}

// What an allocation is, for matching it across probes: the op that made it (name and module), its category,
// phase and iteration.
uint64_t allocation_key(const Entry& e, const Trace& t) {
  const std::string op = e.op >= 0 ? t.ops[static_cast<size_t>(e.op)].name + '\x1f' + t.ops[static_cast<size_t>(e.op)].module
                                   : std::string("\x1f");
  uint64_t h = std::hash<std::string>()(op);
  for (uint64_t v : {static_cast<uint64_t>(e.category), static_cast<uint64_t>(e.phase), static_cast<uint64_t>(e.iteration)}) {
    // 0x9e3779b97f4a7c15: 2^64 divided by the golden ratio, with boost::hash_combine's shifts (6, 2).
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  }
  return h;
}

// The longest common subsequence of two key sequences by Myers' O((N+M)·D) difference algorithm: for each
// element of `b`, the index of its match in `a` (-1: none). Empty when more than max_d insertions and
// deletions separate them.
std::vector<int64_t> match_sequences(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b, int64_t max_d) {
  const int64_t n = static_cast<int64_t>(a.size());
  const int64_t m = static_cast<int64_t>(b.size());
  max_d = std::min(max_d, n + m);
  std::vector<std::vector<int64_t>> history;  // V after each round d, over k in [-d, d]
  std::vector<int64_t> v(static_cast<size_t>(2 * max_d + 3), 0);
  const int64_t off = max_d + 1;
  int64_t end_d = -1;
  for (int64_t d = 0; d <= max_d && end_d < 0; ++d) {
    for (int64_t k = -d; k <= d; k += 2) {
      int64_t x = (k == -d || (k != d && v[k - 1 + off] < v[k + 1 + off])) ? v[k + 1 + off] : v[k - 1 + off] + 1;
      int64_t y = x - k;
      while (x < n && y < m && a[static_cast<size_t>(x)] == b[static_cast<size_t>(y)]) {
        ++x;
        ++y;
      }
      v[k + off] = x;
      if (x >= n && y >= m) end_d = d;
    }
    history.emplace_back(v.begin() + (off - d), v.begin() + (off + d + 1));
  }
  if (end_d < 0) return {};
  std::vector<int64_t> match(static_cast<size_t>(m), -1);
  int64_t x = n, y = m;
  for (int64_t d = end_d; d >= 0; --d) {
    const int64_t k = x - y;
    int64_t start_x = 0, start_y = 0;  // where the snake ending at (x, y) begins
    int64_t prev_x = 0, prev_y = 0;
    if (d > 0) {
      const std::vector<int64_t>& prev = history[static_cast<size_t>(d - 1)];  // k' in [-(d-1), d-1]
      auto at = [&](int64_t kk) { return prev[static_cast<size_t>(kk + d - 1)]; };
      const bool down = k == -d || (k != d && at(k - 1) < at(k + 1));
      const int64_t prev_k = down ? k + 1 : k - 1;
      prev_x = at(prev_k);
      prev_y = prev_x - prev_k;
      start_x = down ? prev_x : prev_x + 1;
      start_y = down ? prev_y + 1 : prev_y;
    }
    while (x > start_x && y > start_y) {
      --x;
      --y;
      match[static_cast<size_t>(y)] = x;
    }
    x = prev_x;
    y = prev_y;
  }
  return match;
}

// Size as a function of the batch: exact linear fit when the probes allow, else least-squares quadratic.
struct Fit {
  double c0 = 0, c1 = 0, c2 = 0;
  double cl = 0, cbl = 0, cbll = 0;  // sequence-length terms: L, b L, b L^2
  bool linear = true;
  int64_t at(double b, double l = 0) const {
    return std::max<int64_t>(0, std::llround(c0 + c1 * b + c2 * b * b + cl * l + cbl * b * l + cbll * b * l * l));
  }
};

// One probe's size at another batch: model states kept, everything else in proportion to the batch.
Fit proportional_fit(int64_t bytes, Category c, double batch) {
  Fit f;
  if (c == Category::Parameter || c == Category::Gradient || c == Category::OptimizerState) {
    f.c0 = static_cast<double>(bytes);
  } else {
    f.c1 = static_cast<double>(bytes) / batch;
  }
  return f;
}

// Probes that run the same ops are matched allocation by allocation, top-level op by top-level op, up to this many
// unmatched ones in one op; an op beyond it keeps its allocations unmatched.
// 2048: a chosen bound (the matching costs O((N+M)·D)); not tuned on a recorded measurement.
constexpr int64_t kMaxUnmatchedAllocations = 2048;

// For each entry of a stream, the ordinal of the top-level op it happened in (parent < 0, in start order: the
// ordinals op_sequence_difference compares): the op it names, or for an entry that names none (a parallel
// kernel's worker threads run no op), the op of the entry before it.
std::vector<int64_t> entry_segments(const Stream& st, const Trace& t) {
  const int64_t n = static_cast<int64_t>(t.ops.size());
  std::vector<int64_t> ordinal(t.ops.size(), -1);
  int64_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (t.ops[static_cast<size_t>(i)].parent < 0) ordinal[static_cast<size_t>(i)] = next++;
  }
  std::vector<int64_t> seg;
  seg.reserve(st.entries.size());
  int64_t current = -1;
  for (const Entry& e : st.entries) {
    if (e.op >= 0 && e.op < n) {
      int64_t o = e.op;
      // 4096: a chosen guard, deeper than any op nesting a trace holds.
      for (int guard = 0; guard < 4096; ++guard) {  // up to the outermost op (a malformed parent link ends it)
        const int64_t parent = t.ops[static_cast<size_t>(o)].parent;
        if (parent < 0 || parent >= n || parent == o) break;
        o = parent;
      }
      current = ordinal[static_cast<size_t>(o)];
    }
    seg.push_back(current);
  }
  return seg;
}

// For each top-level op of `probe` (in start order: entry_segments' ordinals), the reference's top-level op it is
// matched to by name and module (-1: none), as the longest common subsequence; empty when more than max_d ops are
// unmatched. Probes whose routed layers ran other experts differ by whole expert calls: the rest matches.
std::vector<int64_t> top_level_matches(const Trace& ref, const Trace& probe, int64_t max_d) {
  auto keys = [](const Trace& t) {
    std::vector<uint64_t> k;
    for (const OpRecord& op : t.ops) {
      if (op.parent < 0) k.push_back(std::hash<std::string>()(op.name + '\x1f' + op.module));
    }
    return k;
  };
  return match_sequences(keys(ref), keys(probe), max_d);
}

// Least squares over {1, b, L, b L, b L^2}; linear = exact at every probe.
Fit fit_batch_and_seq(const std::vector<double>& b, const std::vector<double>& l, const std::vector<double>& s) {
  Fit f;
  const size_t n = b.size();
  if (std::all_of(s.begin(), s.end(), [&](double v) { return v == s[0]; })) {
    f.c0 = s[0];
    return f;
  }
  // A singular design (probes at one length, or one batch size) leaves the unresolved terms at zero.
  std::vector<std::vector<double>> rows;
  for (size_t i = 0; i < n; ++i) rows.push_back({1.0, b[i], l[i], b[i] * l[i], b[i] * l[i] * l[i]});
  const detail::LeastSquaresFit fit = detail::least_squares(rows, s);
  const std::vector<double>& x = fit.coef;
  const bool rank_ok = fit.full_rank;
  f.c0 = x[0];
  f.c1 = x[1];
  f.cl = x[2];
  f.cbl = x[3];
  f.cbll = x[4];
  // 0.5: half a byte, sizes being whole bytes.
  for (size_t i = 0; i < n; ++i) f.linear = f.linear && std::abs(f.at(b[i], l[i]) - s[i]) <= 0.5;
  f.linear = f.linear && rank_ok;
  return f;
}

Fit fit(const std::vector<double>& b, const std::vector<double>& s) {
  Fit f;
  const size_t n = b.size();
  if (n == 1 || std::all_of(s.begin(), s.end(), [&](double v) { return v == s[0]; })) {
    f.c0 = s[0];
    return f;
  }
  double mb = 0, ms = 0;
  for (size_t i = 0; i < n; ++i) {
    mb += b[i];
    ms += s[i];
  }
  mb /= static_cast<double>(n);
  ms /= static_cast<double>(n);
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < n; ++i) {
    sxy += (b[i] - mb) * (s[i] - ms);
    sxx += (b[i] - mb) * (b[i] - mb);
  }
  f.c1 = sxy / sxx;
  f.c0 = ms - f.c1 * mb;
  bool exact = true;
  // 0.5: half a byte, sizes being whole bytes.
  for (size_t i = 0; i < n; ++i) exact = exact && std::abs(f.c0 + f.c1 * b[i] - s[i]) <= 0.5;
  if (exact || n < 3) return f;
  // Not linear over all probes. Quadratic growth shows as slopes growing with the batch, c2 (b_i + b_j);
  // padding and minimum sizes at small batches show as the small probes alone being off. Decide by the last
  // two slopes; in the second case, the two largest probes give the line (the probes arrive sorted).
  const double slope_prev = (s[n - 2] - s[n - 3]) / (b[n - 2] - b[n - 3]);
  const double slope_last = (s[n - 1] - s[n - 2]) / (b[n - 1] - b[n - 2]);
  const double quad_ratio = (b[n - 1] + b[n - 2]) / (b[n - 2] + b[n - 3]);
  // 0.25: a chosen tolerance, a quarter of the growth a quadratic predicts between the two slopes.
  const bool quadratic = slope_prev > 0 && std::abs(slope_last / slope_prev - quad_ratio) < 0.25 * (quad_ratio - 1.0);
  if (!quadratic) {
    f.c1 = slope_last;
    f.c0 = s[n - 1] - f.c1 * b[n - 1];
    f.linear = false;
    return f;
  }
  // Quadratic least squares over {1, b, b^2}.
  std::vector<std::vector<double>> rows;
  for (size_t i = 0; i < n; ++i) rows.push_back({1.0, b[i], b[i] * b[i]});
  const detail::LeastSquaresFit q = detail::least_squares(rows, s);
  if (!q.full_rank) return f;
  f.c0 = q.coef[0];
  f.c1 = q.coef[1];
  f.c2 = q.coef[2];
  f.linear = false;
  return f;
}

// An allocation sized by the tokens a routed layer's expert receives: which call and expert, and its size as a
// line through the expert's load (moe_routing.h).
struct RoutedFit {
  int64_t call = -1, unit = -1;
  int64_t other = -1;  // the expert on the other side, where a line through its load fits as well: the larger load
  Fit fit;             // c0 + c1 * load
};

// A line through (x, y) within `tolerance` of every point, least squares; none when the points do not fix one.
std::optional<Fit> line_through(const std::vector<double>& x, const std::vector<double>& y, double tolerance) {
  if (x.size() < 2 || std::all_of(x.begin(), x.end(), [&](double v) { return v == x[0]; })) return std::nullopt;
  std::vector<std::vector<double>> rows;
  for (double v : x) rows.push_back({1.0, v});
  const detail::LeastSquaresFit ls = detail::least_squares(rows, y);
  if (!ls.full_rank) return std::nullopt;
  Fit f;
  f.c0 = ls.coef[0];
  f.c1 = ls.coef[1];
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::abs(f.c0 + f.c1 * x[i] - y[i]) > tolerance) return std::nullopt;
  }
  return f;
}

struct Model {
  const Stream* shape = nullptr;  // the largest probe's stream: structure, categories, ops
  const Trace* trace = nullptr;
  std::vector<Fit> initial_fits;
  std::vector<Fit> alloc_fits;    // per allocation position (an allocation's ref)
  int64_t nonlinear = 0;
  std::vector<detail::RoutedCall> routed_calls;      // the largest probe's routed layer calls
  std::unordered_map<int64_t, RoutedFit> routed;    // allocation position -> its expert's line
  int64_t routed_unexplained = 0;                    // allocations in routed calls sized by neither
};

bool is_matmul(const std::string& name) {
  static const std::set<std::string> kMatmul = {"aten::mm",     "aten::addmm",  "aten::bmm",    "aten::baddbmm",
                                                "aten::matmul", "aten::linear", "aten::addmv",  "aten::mv",
                                                "aten::_scaled_mm", "aten::addbmm"};
  return kMatmul.count(name) != 0;
}

struct Replay {
  int64_t peak_allocated = 0, peak_reserved = 0;
  int64_t first_peak = 0, steady_peak = 0;
  int64_t peak_entry = kNone;  // entry index at the allocated peak (-1: initial blocks)
  double fragmentation = 0;
  std::array<int64_t, kNumCategories> breakdown{};
  // At the conv_call markers: the largest workspace per call that leaves the peaks as they are (-1: no marker).
  int64_t conv_headroom_allocated = -1, conv_headroom_reserved = -1;
};

Replay replay(const Planned& p, bool gpu, const AllocatorConfig& cfg) {
  Replay r;
  std::unordered_map<int64_t, std::pair<int64_t, Category>> live;  // ref -> bytes counted, category
  std::array<int64_t, kNumCategories> held{};
  int64_t total = 0;
  AllocatorSim sim(cfg, SimOptions{});
  auto on_alloc = [&](int64_t ref, int64_t bytes, Category c) {
    int64_t counted = bytes;
    if (gpu) {
      sim.malloc(ref, bytes);
      counted = sim.block_bytes(ref);
    }
    live[ref] = {counted, c};
    held[static_cast<size_t>(c)] += counted;
    total += counted;
  };
  auto snapshot = [&](int64_t entry) {
    const int64_t now = gpu ? sim.stats().allocated : total;
    if (now > r.peak_allocated) {
      r.peak_allocated = now;
      r.peak_entry = entry;
      r.breakdown = held;
    }
  };
  for (size_t i = 0; i < p.initial.size(); ++i) {
    if (p.initial[i] > 0) on_alloc(initial_ref(i), p.initial[i], p.initial_category[i]);
  }
  snapshot(-1);
  struct Mark {
    int64_t allocated, reserved, cached;
  };
  std::vector<Mark> marks;
  for (size_t i = 0; i < p.entries.size(); ++i) {
    const Entry& e = p.entries[i];
    if (e.conv_call) {
      if (gpu) marks.push_back({sim.stats().allocated, sim.stats().reserved, sim.largest_cached_request()});
      continue;
    }
    if (e.alloc) {
      if (e.bytes <= 0) continue;
      on_alloc(e.ref, e.bytes, e.category);
      snapshot(static_cast<int64_t>(i));
      const int64_t now = gpu ? sim.stats().allocated : total;
      if (e.iteration == 1) r.first_peak = std::max(r.first_peak, now);
      else r.steady_peak = std::max(r.steady_peak, now);
    } else {
      auto it = live.find(e.ref);
      if (it == live.end()) continue;
      held[static_cast<size_t>(it->second.second)] -= it->second.first;
      total -= it->second.first;
      if (gpu) sim.free(e.ref);
      live.erase(it);
    }
  }
  if (gpu) {
    r.peak_reserved = sim.stats().peak_reserved;
    r.fragmentation = r.peak_reserved > 0 ? 1.0 - static_cast<double>(r.peak_allocated) / static_cast<double>(r.peak_reserved) : 0.0;
    for (const Mark& m : marks) {
      // A workspace fits under the allocated peak when its 512-byte blocks do; under the reserved peak when a
      // cached block serves it or the segment it needs stays under the peak.
      // 512: kMinBlockSize (c10/core/AllocatorConfig.h:19).
      const int64_t a = (r.peak_allocated - m.allocated) / 512 * 512;
      const int64_t res = std::max(m.cached, cfg.largest_request_in_segment(r.peak_reserved - m.reserved));
      r.conv_headroom_allocated = r.conv_headroom_allocated < 0 ? a : std::min(r.conv_headroom_allocated, a);
      r.conv_headroom_reserved = r.conv_headroom_reserved < 0 ? res : std::min(r.conv_headroom_reserved, res);
    }
  } else {
    r.peak_reserved = r.peak_allocated;
  }
  return r;
}

class Forecaster {
 public:
  Forecaster(const MemoryForecastInput& in, MemoryForecast& out) : in_(in), out_(out) {}

  // The target's row; a GPU the table lacks, given with its capacity: a CUDA device of that capacity whose context
  // (outside the allocator) is not known, said in a note.
  DeviceSpec device_spec() {
    if (const DeviceSpec* d = lookup_device(in_.target); d != nullptr || in_.capacity_bytes <= 0) {
      return find_device(in_.target);
    }
    out_.notes.push_back(Note{"unknown-device",
                              fmt::format("'{}' is not in the device table: forecast as a CUDA device of the capacity "
                                          "given, without its CUDA context (outside the allocator), and with the "
                                          "cuBLAS workspace PyTorch sizes below Hopper",
                                          in_.target)});
    DeviceSpec spec;
    spec.name = in_.target;
    spec.capacity_bytes = in_.capacity_bytes;
    spec.source = "given capacity";
    return spec;
  }

  void run() {
    validate();
    const bool gpu = in_.target != "cpu";
    out_.capacity_bytes = in_.capacity_bytes;
    if (gpu) {
      spec_ = device_spec();
      out_.capacity_bytes = in_.capacity_bytes > 0 ? in_.capacity_bytes : spec_.capacity_bytes;
      out_.outside_allocator_bytes = spec_.context_bytes;
      const int64_t world = in_.parallel.dp * in_.parallel.tp * in_.parallel.pp;
      if (world > 1) {
        // 256 MiB: an estimate, no measurement behind it. For scale: NCCL's Simple-protocol buffer is 4 MiB per
        // channel and peer (NCCL 2.30.7, which torch 2.14.1 ships: src/init.cc:813 DEFAULT_BUFFSIZE): 64 of them.
        out_.outside_allocator_bytes += 256 * kMiB;
        out_.notes.push_back(Note{"nccl-buffers", "NCCL buffers outside the allocator estimated at 256 MiB per rank"});
      }
      if (!in_.allocator.native_backend) {
        out_.notes.push_back(Note{"async-allocator-not-simulated", 
            "backend:cudaMallocAsync is not simulated: reserved bytes are forecast as for the native caching allocator"});
      }
    }
    std::unordered_set<uint64_t> exclude(in_.exclude_ptrs.begin(), in_.exclude_ptrs.end());
    for (const Trace* t : in_.probes) streams_.push_back(extract(*t, in_.probe_device, exclude));
    build_model();
    // Only the reference probe's stream is read from here on: the others' memory goes back now.
    for (Stream& st : streams_) {
      if (&st != model_.shape) st = Stream{};
    }
    out_.target = in_.target;
    out_.batch_size = in_.target_batch;
    const int64_t per = per_rank(in_.target_batch);
    out_.per_rank_batch = per;
    out_.seq_len = in_.target_seq;
    // Each group of data-parallel ranks that hold alike, planned and replayed; the one that peaks highest is the
    // forecast's peak_* and everything said of its peak.
    plan_routing(per, gpu);
    Planned plan;
    Replay r;
    int64_t largest_rank = -1;
    for (const std::vector<int64_t>& group : rank_groups()) {
      rank_ = group.front();
      Planned candidate = planned(per, gpu);
      const Replay rr = replay(candidate, gpu, in_.allocator);
      out_.per_rank.push_back(rank_memory(group, rr));
      if (largest_rank < 0 || rr.peak_allocated > r.peak_allocated) {
        plan = std::move(candidate);
        r = rr;
        largest_rank = rank_;
      }
    }
    rank_ = largest_rank;
    gloo_ordering_note(per, gpu, r.peak_allocated);
    routing_note(r);
    out_.allocations = static_cast<int64_t>(std::count_if(plan.entries.begin(), plan.entries.end(),
                                                          [](const Entry& e) { return e.alloc; }));
    out_.peak_allocated_bytes = r.peak_allocated;
    out_.peak_reserved_bytes = r.peak_reserved;
    out_.first_iteration_peak_bytes = r.first_peak;
    out_.steady_peak_bytes = r.steady_peak;
    out_.fragmentation = r.fragmentation;
    out_.conv_workspace_headroom_allocated_bytes = r.conv_headroom_allocated;
    out_.conv_workspace_headroom_reserved_bytes = r.conv_headroom_reserved;
    if (out_.conv_calls_measured > 0) {
      int64_t largest = 0;
      for (const auto& [key, bytes] : in_.conv_workspaces) largest = std::max(largest, bytes);
      out_.notes.push_back(Note{"conv-workspace-measured", fmt::format(
          "cuDNN: the workspaces of {} of {} convolution call(s) per iteration measured on the GPU at the target "
          "batch (up to {} per call) replace the probes'",
          out_.conv_calls_measured, out_.conv_calls, format_bytes(largest))});
    }
    if (out_.conv_calls > 0 && conv_workspace_ < 0 && r.conv_headroom_allocated >= 0 && gpu_probes()) {
      out_.notes.push_back(Note{"conv-workspace-headroom", fmt::format(
          "cuDNN: each of {} convolution call(s) per iteration ran with the workspace its algorithm took at the "
          "probes' sizes (up to {} per call at batch {}); cuDNN chooses again at the target batch, and another "
          "algorithm may take more: the forecast holds while each call's workspace stays under {} (peak "
          "allocated) and {} (peak reserved)",
          out_.conv_calls - out_.conv_calls_measured, format_bytes(probe_conv_workspace_),
          in_.probe_batch[largest_probe()],
          format_bytes(r.conv_headroom_allocated), format_bytes(r.conv_headroom_reserved))});
    } else if (out_.conv_calls > 0 && conv_workspace_ < 0 && r.conv_headroom_allocated >= 0) {
      out_.notes.push_back(Note{"conv-workspace-unmodelled", fmt::format(
          "cuDNN: the workspace of each of {} convolution call(s) per iteration is chosen on the GPU and not "
          "modelled; the forecast holds while each stays under {} (peak allocated) and {} (peak reserved): set "
          "conv_workspace, or CUDNN_CONV_WSCAP_DBG, to model one{}",
          out_.conv_calls, format_bytes(r.conv_headroom_allocated), format_bytes(r.conv_headroom_reserved),
          conv_scratch_text())});
    }
    for (int c = 0; c < kNumCategories; ++c) {
      if (r.breakdown[c] != 0) out_.breakdown[std::string(to_string(static_cast<Category>(c)))] = r.breakdown[c];
    }
    if (r.peak_entry >= 0) {
      const Entry& e = plan.entries[r.peak_entry];
      out_.peak_phase = std::string(to_string(e.phase));
      out_.peak_iteration = e.iteration;
      if (e.op >= 0) {
        out_.peak_op = model_.trace->ops[e.op].name;
        out_.peak_module = model_.trace->ops[e.op].module;
      }
    } else {
      out_.peak_phase = "start";
    }
    plan = Planned{};  // its memory back before the search below plans at other batch sizes
    out_.max_batch_size = out_.capacity_bytes > 0 ? max_batch(gpu) : 0;
  }

 private:
  // FSDP2 on gloo: what the worst ordering of gloo's frees adds to the largest rank's peak over the usual one (each
  // collective's tensors freed as soon as FSDP drops them), said in a note with both peaks.
  void gloo_ordering_note(int64_t per, bool gpu, int64_t worst) {
    const ParallelConfig& par = in_.parallel;
    if (gpu || par.dp_mode != "fsdp" || par.fsdp_units.empty() || model_.trace == nullptr || par.dp < 2 ||
        par.traced_world > 0) {
      return;
    }
    fsdp_held_works_ = 0;
    const int64_t usual = replay(planned(per, gpu), gpu, in_.allocator).peak_allocated;
    fsdp_held_works_ = detail::kGlooThreads;
    out_.notes.push_back(Note{"gloo-late-frees", fmt::format(
        "gloo: the peak is forecast for the worst ordering of its worker threads, which free a collective's tensors "
        "(an all-gather's output, a reduce-scatter's clone) when they next run, up to {} collectives later; freed at "
        "once, as in most runs, the peak is {} ({} lower)",
        detail::kGlooThreads, format_bytes(usual), format_bytes(worst - usual))});
  }

  // Routed layers: what the forecast assumed of the routing, both peaks, and what it could not size.
  // The bound's peaks are raised to the highest of the routings tried (plan_routing).
  void routing_note(Replay& bound) {
    if (!out_.moe) return;
    MoeForecast& moe = *out_.moe;
    bound.peak_allocated = std::max(bound.peak_allocated, routing_floor_allocated_);
    bound.peak_reserved = std::max(bound.peak_reserved, routing_floor_reserved_);
    moe.bound_peak_allocated_bytes = bound.peak_allocated;
    moe.bound_peak_reserved_bytes = bound.peak_reserved;
    out_.notes.push_back(Note{"moe-routing", fmt::format(
        "{} routed layer call(s) per trace (up to {} experts, top-{}): the peak is forecast for the bound, each "
        "call's {} most-loaded experts receiving {:.0f} % of its tokens (moe_skew={:g}): {} allocated, {} reserved; "
        "with the tokens spread evenly over the experts, {} allocated, {} reserved ({} allocations sized by their "
        "expert's load{})",
        moe.routed_calls, moe.experts, moe.top_k, moe.top_k, 100.0 * moe.skew, moe.skew,
        format_bytes(moe.bound_peak_allocated_bytes), format_bytes(moe.bound_peak_reserved_bytes),
        format_bytes(moe.expected_peak_allocated_bytes), format_bytes(moe.expected_peak_reserved_bytes),
        moe.routed_allocations,
        moe.unexplained_allocations > 0
            ? fmt::format("; {} others in routed calls follow neither the batch nor a load, fitted by the batch",
                          moe.unexplained_allocations)
            : std::string())});
  }

  static RankMemory rank_memory(const std::vector<int64_t>& ranks, const Replay& r) {
    RankMemory m;
    m.ranks = ranks;
    m.peak_allocated_bytes = r.peak_allocated;
    m.peak_reserved_bytes = r.peak_reserved;
    for (int c = 0; c < kNumCategories; ++c) {
      if (r.breakdown[c] != 0) m.breakdown[std::string(to_string(static_cast<Category>(c)))] = r.breakdown[c];
    }
    return m;
  }

  void validate() {
    if (in_.probes.empty()) GPUCAST_USER_ERROR("forecast: no probe traces given");
    if (in_.probe_device == "meta" && in_.target == "cpu") {
      GPUCAST_USER_ERROR("forecast: probes on the meta device forecast a GPU target (target='H100-80GB', ...); "
                         "target 'cpu' is forecast from probes on the CPU");
    }
    if (in_.probes.size() != in_.probe_batch.size()) {
      GPUCAST_USER_ERROR("forecast: {} probe traces but {} probe batch sizes", in_.probes.size(), in_.probe_batch.size());
    }
    for (int64_t b : in_.probe_batch) {
      if (b < 1) GPUCAST_USER_ERROR("forecast: probe batch sizes must be at least 1, got {}", b);
    }
    if (in_.target_batch < 1) GPUCAST_USER_ERROR("forecast: batch_size must be at least 1, got {}", in_.target_batch);
    if (seq_scaling()) {
      if (in_.probe_seq.size() != in_.probes.size()) {
        GPUCAST_USER_ERROR("forecast: {} probe traces but {} probe sequence lengths", in_.probes.size(), in_.probe_seq.size());
      }
      for (int64_t l : in_.probe_seq) {
        if (l < 1) GPUCAST_USER_ERROR("forecast: probe sequence lengths must be at least 1, got {}", l);
      }
      // 5: the terms of fit_batch_and_seq's least squares, {1, b, L, b L, b L^2}.
      if (in_.probes.size() < 5) {
        GPUCAST_USER_ERROR("forecast: scaling by sequence length needs at least 5 probes, got {}", in_.probes.size());
      }
    }
    if (in_.conv_workspace_bytes < -1) {
      GPUCAST_USER_ERROR("forecast: conv_workspace must be a number of bytes of at least 0, got {}",
                         in_.conv_workspace_bytes);
    }
    if (in_.target != "cpu") {  // cuDNN's cap means nothing to a CPU target
      conv_workspace_ = in_.conv_workspace_bytes >= 0 ? in_.conv_workspace_bytes
                                                      : cudnn_conv_wscap_bytes(in_.cudnn_conv_wscap);
    }
    if (!(in_.moe_skew > 0.0 && in_.moe_skew <= 1.0)) {
      GPUCAST_USER_ERROR("forecast: moe_skew must be in (0, 1], got {}", in_.moe_skew);
    }
    if (!(in_.safety_fraction > 0.0 && in_.safety_fraction <= 1.0)) {
      GPUCAST_USER_ERROR("forecast: safety fraction must be in (0, 1], got {}", in_.safety_fraction);
    }
    const ParallelConfig& p = in_.parallel;
    if (p.dp < 1 || p.tp < 1 || p.pp < 1 || p.micro_batches < 1) {
      GPUCAST_USER_ERROR("parallel: dp, tp, pp and micro_batches must be at least 1, got dp={}, tp={}, pp={}, micro_batches={}",
                         p.dp, p.tp, p.pp, p.micro_batches);
    }
    if (p.dp_mode != "ddp" && p.dp_mode != "zero1" && p.dp_mode != "zero2" && p.dp_mode != "fsdp") {
      GPUCAST_USER_ERROR("parallel: dp_mode expects one of ddp|zero1|zero2|fsdp, got '{}'", p.dp_mode);
    }
    // Ranks given different batches hold different activations: a forecast of the smaller would be low.
    const int64_t shares = checked_mul(p.dp, p.micro_batches, "parallel");
    if (in_.target_batch % shares != 0) {
      GPUCAST_USER_ERROR("parallel: dp={} x micro_batches={} does not divide batch_size {}: give a batch_size that "
                         "is a multiple of {}", p.dp, p.micro_batches, in_.target_batch, shares);
    }
  }

  bool seq_scaling() const { return in_.target_seq > 0; }

  int64_t per_rank(int64_t global) const {
    const int64_t div = in_.parallel.dp * in_.parallel.micro_batches;
    return std::max<int64_t>(1, global / div);
  }

  void build_model() {
    // The largest probe gives the structure; the others must match it to scale.
    size_t ref = 0;
    auto size_of_probe = [&](size_t i) { return in_.probe_batch[i] * (seq_scaling() ? in_.probe_seq[i] : 1); };
    for (size_t i = 1; i < in_.probes.size(); ++i) {
      if (size_of_probe(i) > size_of_probe(ref)) ref = i;
    }
    model_.shape = &streams_[ref];
    model_.trace = in_.probes[ref];
    std::vector<size_t> usable = {ref};
    std::vector<size_t> routing_dropped;  // probes whose routed layers ran other experts than the reference's
    std::vector<std::pair<size_t, std::string>> differing;  // probes that ran other ops: where they differ
    std::vector<std::vector<int64_t>> op_map(streams_.size());  // such probes: top_level_matches
    model_.routed_calls = detail::find_routed_calls(*model_.trace);
    std::vector<std::string> kernel_diffs(streams_.size());  // per probe matched op by op: where it first differs
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (i == ref) continue;
      const std::string diff = structure_difference(streams_[i], *in_.probes[i], streams_[ref], *in_.probes[ref]);
      if (!diff.empty() && !seq_scaling() && op_sequence_difference(*in_.probes[i], *in_.probes[ref]).empty()) {
        kernel_diffs[i] = diff;  // the same ops, other kernels inside them
        usable.push_back(i);
        continue;
      }
      if (!diff.empty() && !seq_scaling() && routing_differs(*in_.probes[i])) {
        // Other experts ran: matched op by op where the top-level ops match, else left out.
        op_map[i] = top_level_matches(*in_.probes[ref], *in_.probes[i], kMaxUnmatchedAllocations);
        if (op_map[i].empty()) {
          routing_dropped.push_back(i);
          continue;
        }
        kernel_diffs[i] = diff;
        usable.push_back(i);
        continue;
      }
      if (!diff.empty()) {
        differing.emplace_back(i, diff);
        continue;
      }
      usable.push_back(i);
    }
    if (!routing_dropped.empty()) routing_dropped_note(routing_dropped, usable, ref);
    if (!differing.empty()) differing_note(differing, usable, ref);
    if (!out_.scaled) usable = {ref};
    const Stream& s = streams_[ref];
    if (in_.probes.size() == 1) {
      // One probe: model states stay, everything else scales in proportion to the batch size.
      const double b0 = static_cast<double>(in_.probe_batch[ref]);
      auto proportional = [b0](int64_t bytes, Category c) { return proportional_fit(bytes, c, b0); };
      for (size_t k = 0; k < s.initial_bytes.size(); ++k) {
        model_.initial_fits.push_back(proportional(s.initial_bytes[k], s.initial_category[k]));
      }
      model_.alloc_fits.reserve(s.ptr_of.size());
      for (const Entry& e : s.entries) {
        if (e.alloc) model_.alloc_fits.push_back(proportional(e.bytes, e.category));
      }
      out_.notes.push_back(Note{"one-probe", 
          "one probe: parameters, gradients and optimizer state kept, all other allocations scaled in proportion "
          "to the batch size"});
      return;
    }
    std::sort(usable.begin(), usable.end(), [&](size_t x, size_t y) { return in_.probe_batch[x] < in_.probe_batch[y]; });
    // GPU probes list the blocks held at the start in address order (the caching allocator's snapshot), which
    // differs between probes wherever a probe's batch landed: there they are put in one order, by category and
    // then by size, block by block (a block keeps its own pool and segment in the simulation).
    if (!host_probes()) {
      for (size_t i : usable) order_initial(streams_[i]);
    }
    bool same_initial = true;
    for (size_t i : usable) {
      same_initial = same_initial && streams_[i].initial_category == s.initial_category;
    }
    if (!same_initial) {
      // Match what each probe held at the start by category; frees of such blocks are then left out.
      for (size_t i : usable) aggregate_initial(streams_[i]);
      out_.notes.push_back(Note{"baseline-blocks-differ", 
          "the probes held different numbers of blocks at the start (the process allocated or freed memory "
          "between them): matched by category"});
    }
    // Each usable probe's allocation for each of the reference's: the same position (same_position), or for
    // probes that ran other kernels, the one matched op by op (match; -1: none).
    std::vector<char> same_position(streams_.size(), 0);
    std::vector<std::vector<int64_t>> match(streams_.size());
    std::vector<uint64_t> ref_keys;
    for (size_t i : usable) {
      if (kernel_diffs[i].empty()) {
        same_position[i] = 1;
        continue;
      }
      if (ref_keys.empty()) {
        for (const Entry& e : s.entries) ref_keys.push_back(e.alloc ? allocation_key(e, *in_.probes[ref]) : 0);
      }
      // Allocations only (frees follow the reference's), top-level op by top-level op: the probes run the same
      // top-level ops, and a kernel that allocates by the batch (a parallel kernel's buffers per chunk of work)
      // then moves no match into another op.
      std::vector<int64_t> seg_mine = entry_segments(streams_[i], *in_.probes[i]);
      if (!op_map[i].empty()) {  // the reference's ordinals; kNone - 1 (no op of the reference's) where unmatched
        for (int64_t& seg : seg_mine) {
          seg = seg >= 0 && seg < static_cast<int64_t>(op_map[i].size()) && op_map[i][static_cast<size_t>(seg)] >= 0
                    ? op_map[i][static_cast<size_t>(seg)]
                    : kNone - 1;
        }
      }
      const std::vector<int64_t> seg_ref = entry_segments(s, *in_.probes[ref]);
      struct Side {
        std::vector<uint64_t> keys;
        std::vector<int64_t> at;
      };
      std::map<int64_t, std::pair<Side, Side>> ops;  // top-level op -> (this probe's, the reference's)
      int64_t mine_total = 0, theirs_total = 0;
      for (size_t k = 0; k < streams_[i].entries.size(); ++k) {
        if (!streams_[i].entries[k].alloc) continue;
        Side& side = ops[seg_mine[k]].first;
        side.keys.push_back(allocation_key(streams_[i].entries[k], *in_.probes[i]));
        side.at.push_back(static_cast<int64_t>(k));
        ++mine_total;
      }
      for (size_t k = 0; k < s.entries.size(); ++k) {
        if (!s.entries[k].alloc) continue;
        Side& side = ops[seg_ref[k]].second;
        side.keys.push_back(ref_keys[k]);
        side.at.push_back(static_cast<int64_t>(k));
        ++theirs_total;
      }
      match[i].assign(s.entries.size(), -1);
      int64_t matched = 0, beyond = 0;
      for (const auto& [op, sides] : ops) {
        const auto& [mine, theirs] = sides;
        if (theirs.keys.empty() || mine.keys.empty()) continue;
        const std::vector<int64_t> m = match_sequences(mine.keys, theirs.keys, kMaxUnmatchedAllocations);
        if (m.empty()) {
          ++beyond;
          continue;
        }
        for (size_t j = 0; j < m.size(); ++j) {
          if (m[j] < 0) continue;
          match[i][static_cast<size_t>(theirs.at[j])] = mine.at[static_cast<size_t>(m[j])];
          ++matched;
        }
      }
      if (matched == 0 && theirs_total > 0) {
        out_.scaled = false;
        out_.warnings.push_back(Note{"no-allocation-match", fmt::format(
            "probes at batch {} and {} run the same ops but no allocation matches between them ({}): the forecast "
            "is not scaled: it repeats the batch-{} probe",
            in_.probe_batch[i], in_.probe_batch[ref], kernel_diffs[i], in_.probe_batch[ref])});
        match[i].clear();
        continue;
      }
      const int64_t theirs_size = theirs_total;
      if (!op_map[i].empty()) {
        out_.notes.push_back(Note{"moe-experts-differ", fmt::format(
            "probes at batch {} and {} ran other experts of their routed layers (an expert that received no token "
            "is not run; {}): {} of the batch-{} probe's {} allocations matched op by op, {} of the batch-{} probe's "
            "without a match",
            in_.probe_batch[i], in_.probe_batch[ref], kernel_diffs[i], matched, in_.probe_batch[ref], theirs_size,
            mine_total - matched, in_.probe_batch[i])});
        continue;
      }
      out_.notes.push_back(Note{"kernels-differ", fmt::format(
          "probes at batch {} and {} run the same ops with other kernels inside some ({}; cuDNN and cuBLAS choose "
          "by size, large reductions stage through a buffer{}): {} of the batch-{} probe's {} allocations matched "
          "op by op, {} of the batch-{} probe's without a match",
          in_.probe_batch[i], in_.probe_batch[ref], kernel_diffs[i],
          uses_im2col_conv(*in_.probes[i]) != uses_im2col_conv(*in_.probes[ref])
              ? ", PyTorch's CPU convolution leaves im2col at batch 16 for 1x1 stride-1 kernels on one thread"
              : "",
          matched, in_.probe_batch[ref], theirs_size, mine_total - matched, in_.probe_batch[i])});
      if (beyond > 0) {
        out_.notes.push_back(Note{"ops-scaled-by-batch", fmt::format(
            "{} top-level op(s) differ in more than {} allocations between the probes at batch {} and {}: their "
            "allocations in the batch-{} probe scale in proportion to the batch where no other probe matches them",
            beyond, kMaxUnmatchedAllocations, in_.probe_batch[i], in_.probe_batch[ref], in_.probe_batch[ref])});
      }
    }
    if (!out_.scaled) {
      usable = {ref};
    }
    std::vector<double> b, l;
    for (size_t i : usable) {
      b.push_back(static_cast<double>(in_.probe_batch[i]));
      l.push_back(seq_scaling() ? static_cast<double>(in_.probe_seq[i]) : 0.0);
    }
    auto fit_any = [&](const std::vector<double>& v) { return seq_scaling() ? fit_batch_and_seq(b, l, v) : fit(b, v); };
    // 5: the terms of fit_batch_and_seq's least squares, {1, b, L, b L, b L^2}.
    if (seq_scaling() && usable.size() < 5) {
      out_.warnings.push_back(Note{"seq-not-scaled", "scaling by sequence length needs five probes of the same structure: sizes not scaled"});
      out_.scaled = false;
    }
    for (size_t k = 0; k < s.initial_bytes.size(); ++k) {
      std::vector<double> v;
      for (size_t i : usable) v.push_back(static_cast<double>(streams_[i].initial_bytes[k]));
      model_.initial_fits.push_back(fit_any(v));
    }
    model_.alloc_fits.reserve(s.ptr_of.size());
    for (size_t k = 0; k < s.entries.size(); ++k) {
      if (!s.entries[k].alloc) continue;
      std::vector<double> v, bk;
      for (size_t n = 0; n < usable.size(); ++n) {
        const size_t u = usable[n];
        const int64_t at = same_position[u] != 0 ? static_cast<int64_t>(k) : match[u].empty() ? -1 : match[u][k];
        if (at < 0) continue;
        v.push_back(static_cast<double>(streams_[usable[n]].entries[static_cast<size_t>(at)].bytes));
        bk.push_back(b[n]);
      }
      Fit f;
      if (v.size() == usable.size()) {
        f = fit_any(v);
      } else if (v.size() >= 2) {  // matched in some probes: fitted over those
        f = fit(bk, v);
      } else {  // the reference's alone: in proportion to the batch, model states kept
        f = proportional_fit(s.entries[k].bytes, s.entries[k].category, static_cast<double>(in_.probe_batch[ref]));
      }
      if (!f.linear) ++model_.nonlinear;
      model_.alloc_fits.push_back(f);
    }
    if (out_.scaled) {
      fit_routed(ref, usable, [&](size_t u, size_t k) -> int64_t {
        return same_position[u] != 0 ? static_cast<int64_t>(k) : match[u].empty() ? -1 : match[u][k];
      });
    }
    for (const Fit& f : model_.initial_fits) {
      if (!f.linear) ++model_.nonlinear;
    }
    out_.nonlinear_allocations = model_.nonlinear;
  }

  // Routed layers (moe_routing.h): each allocation made in one of their calls whose size is not a line through the
  // batch but is a line through the load of the expert it ran in, or of an expert beside it (the rows picked for the
  // next expert, the output of the one before), is sized by that expert's load at the target (routing_loads).
  // at(u, k): the entry of usable probe u matched to the reference's entry k (-1: none).
  // Whether a probe's routed layer calls differ from the reference's in their experts (a routed layer whose expert
  // received no token does not run it: transformers' Mixtral loops over the experts hit).
  bool routing_differs(const Trace& t) const {
    if (model_.routed_calls.empty()) return false;
    const std::vector<detail::RoutedCall> calls = detail::find_routed_calls(t);
    if (calls.size() != model_.routed_calls.size()) return true;
    for (size_t c = 0; c < calls.size(); ++c) {
      if (calls[c].units.size() != model_.routed_calls[c].units.size()) return true;
    }
    return false;
  }

  // Probes that ran other ops than the reference (a small batch's views and copies differ: a slice of one sample is
  // contiguous; data-dependent control flow): left out where two probes or more run the reference's ops, said in a
  // note, the forecast then sized from those nearest the target; else the forecast is not scaled, with a warning.
  void differing_note(const std::vector<std::pair<size_t, std::string>>& differing, const std::vector<size_t>& usable,
                      size_t ref) {
    if (usable.size() >= 2) {
      std::string kept;
      for (size_t u : usable) kept += (kept.empty() ? "" : ", ") + std::to_string(in_.probe_batch[u]);
      for (const auto& [i, diff] : differing) {
        out_.notes.push_back(Note{"probe-left-out", fmt::format(
            "the probe at batch {} differs in structure from the batch-{} probe ({}): left out, the forecast is sized "
            "from the probes at batch {}, which run the same ops",
            in_.probe_batch[i], in_.probe_batch[ref], diff, kept)});
      }
      return;
    }
    out_.scaled = false;
    for (const auto& [i, diff] : differing) {
      // PyTorch's CPU convolution picks its kernel by batch size (im2col for 1x1, stride-1 kernels on one
      // thread below 16, mkldnn from 16 on): a known cause, named as such.
      const bool kernels = uses_im2col_conv(*in_.probes[i]) != uses_im2col_conv(*in_.probes[ref]);
      out_.warnings.push_back(Note{"probe-structure-differs", fmt::format(
          "probes at batch {} and {} differ in structure ({}): {} The forecast is not scaled: it repeats the "
          "batch-{} probe",
          in_.probe_batch[i], in_.probe_batch[ref], diff,
          kernels ? "PyTorch's CPU convolution changes kernels at batch 16 (im2col below, mkldnn from 16 on, for "
                    "1x1 stride-1 kernels on one thread); keep all probes below 16 or all at 16 and above."
                  : "data-dependent control flow?",
          in_.probe_batch[ref])});
    }
  }

  // Probes left out because their routed layers ran other experts: said, and with fewer than two probes left the
  // forecast is not scaled.
  void routing_dropped_note(const std::vector<size_t>& dropped, const std::vector<size_t>& usable, size_t ref) {
    std::string batches;
    for (size_t i : dropped) batches += (batches.empty() ? "" : ", ") + std::to_string(in_.probe_batch[i]);
    if (usable.size() >= 2 || in_.probes.size() == 1) {
      out_.notes.push_back(Note{"moe-probes-dropped", fmt::format(
          "the probes at batch {} ran other experts than the batch-{} probe (an expert of a routed layer received no "
          "token): left out, the forecast is sized from the other {} probes",
          batches, in_.probe_batch[ref], usable.size())});
      return;
    }
    out_.scaled = false;
    out_.warnings.push_back(Note{"moe-probes-differ", fmt::format(
        "the probes at batch {} ran other experts than the batch-{} probe (an expert of a routed layer received no "
        "token), and fewer than two probes ran the same experts: the forecast is not scaled, it repeats the "
        "batch-{} probe; probes of more tokens (probe_batch_sizes) let every expert receive some",
        batches, in_.probe_batch[ref], in_.probe_batch[ref])});
  }

  template <class At>
  void fit_routed(size_t ref, const std::vector<size_t>& usable, At at) {
    if (model_.routed_calls.empty()) return;
    // The probes whose routed calls match the reference's, call by call and expert by expert.
    std::vector<std::pair<size_t, std::vector<detail::RoutedCall>>> probes;
    for (size_t u : usable) {
      std::vector<detail::RoutedCall> calls = u == ref ? model_.routed_calls : detail::find_routed_calls(*in_.probes[u]);
      bool same = calls.size() == model_.routed_calls.size();
      for (size_t c = 0; same && c < calls.size(); ++c) same = calls[c].container == model_.routed_calls[c].container;
      if (same) probes.emplace_back(u, std::move(calls));
    }
    // Host probes hold exact bytes; the CUDA allocator rounds each block up to 512 bytes.
    const double tolerance = host_probes() ? 0.5 : 512.0;
    const Stream& s = *model_.shape;
    for (size_t k = 0; k < s.entries.size(); ++k) {
      const Entry& e = s.entries[k];
      if (!e.alloc) continue;
      const detail::RoutedPlace place = detail::routed_place(*model_.trace, model_.routed_calls, e.op);
      if (place.call < 0) continue;
      const Fit& by_batch = model_.alloc_fits.at(static_cast<size_t>(e.ref));
      // Two probes fix any line: where two hold the allocation, sizes are taken as in proportion (through the
      // origin) to the batch or to a load, which is what a tensor of rows is.
      const bool two = std::count_if(usable.begin(), usable.end(), [&](size_t u) { return at(u, k) >= 0; }) < 3;
      // Made inside an expert: sized by its load where a line through the loads holds (loads can fall on a line
      // through the batch by chance). Between experts: by the batch where that holds (the router's own tensors).
      const bool inside = place.before == place.after;
      if (!inside && by_batch.linear && (!two || proportional_to_batch(usable, k, at))) continue;
      std::optional<RoutedFit> chosen;
      for (const int64_t unit : {place.before, place.after}) {
        if (unit < 0 || (chosen && chosen->unit == unit)) continue;
        std::vector<double> load, bytes;
        const std::string& path =
            model_.routed_calls[static_cast<size_t>(place.call)].units[static_cast<size_t>(unit)].path;
        for (const auto& [u, calls] : probes) {
          const int64_t j = at(u, k);
          if (j < 0) continue;
          // The same expert in this probe's call (a probe whose router sent it no token did not run it).
          const std::vector<detail::RoutedUnit>& units = calls[static_cast<size_t>(place.call)].units;
          const auto same = std::find_if(units.begin(), units.end(), [&](const detail::RoutedUnit& x) { return x.path == path; });
          if (same == units.end()) continue;
          load.push_back(static_cast<double>(same->load));
          bytes.push_back(static_cast<double>(streams_[u].entries[static_cast<size_t>(j)].bytes));
        }
        if (load.size() < 2) continue;
        if (load.size() < 3) {
          load.push_back(0.0);
          bytes.push_back(0.0);
        }
        if (const std::optional<Fit> f = line_through(load, bytes, tolerance)) {
          // Both sides fit (loads in proportion to each other): sized by the larger of the two at the target, the
          // bound's side.
          if (chosen) {
            chosen->other = unit;
          } else {
            chosen = RoutedFit{place.call, unit, -1, *f};
          }
        }
      }
      if (chosen) {
        model_.routed.emplace(e.ref, *chosen);
      } else if (!by_batch.linear) {  // (inside an expert, sized by the batch, is the batch's)
        ++model_.routed_unexplained;
      }
    }
  }

  // Whether the reference's allocation k and those matched to it are in proportion to the probes' batch sizes.
  template <class At>
  bool proportional_to_batch(const std::vector<size_t>& usable, size_t k, At at) const {
    const size_t ref = static_cast<size_t>(model_.shape - streams_.data());
    const double per_sample = static_cast<double>(model_.shape->entries[k].bytes) /
                              static_cast<double>(in_.probe_batch[ref]);
    for (size_t u : usable) {
      const int64_t j = at(u, k);
      if (j < 0) continue;
      const double bytes = static_cast<double>(streams_[u].entries[static_cast<size_t>(j)].bytes);
      // 0.5: half a byte, sizes being whole bytes.
      if (std::abs(bytes - per_sample * static_cast<double>(in_.probe_batch[u])) > 0.5) return false;
    }
    return true;
  }

  // Each routed call's expert loads at a per-rank batch, under the routing this forecast plans (routing_).
  std::vector<std::vector<int64_t>> routing_loads(int64_t batch) const {
    const size_t ref = static_cast<size_t>(model_.shape - streams_.data());
    double scale = static_cast<double>(batch) / static_cast<double>(in_.probe_batch[ref]);
    if (seq_scaling()) scale *= static_cast<double>(in_.target_seq) / static_cast<double>(in_.probe_seq[ref]);
    std::vector<std::vector<int64_t>> loads;
    loads.reserve(model_.routed_calls.size());
    for (const detail::RoutedCall& c : model_.routed_calls) {
      loads.push_back(routing_ == Routing::Expected ? detail::expected_loads(c, scale)
                                                    : detail::skewed_loads(c, scale, in_.moe_skew, heavy_first_));
    }
    return loads;
  }

  // Routed layers: the peak at the target under routing spread evenly (fc.memory.moe's expected) and under the
  // stated skew, its most-loaded experts the first or the last each call ran, whichever peaks higher: the bound,
  // which the forecast's peaks then are.
  void plan_routing(int64_t per, bool gpu) {
    if (model_.routed.empty() || !out_.scaled) return;
    rank_ = rank_groups().front().front();
    MoeForecast moe;
    routing_ = Routing::Expected;
    const Replay expected = replay(planned(per, gpu), gpu, in_.allocator);
    routing_ = Routing::Bound;
    heavy_first_ = true;
    const Replay first = replay(planned(per, gpu), gpu, in_.allocator);
    heavy_first_ = false;
    const Replay last = replay(planned(per, gpu), gpu, in_.allocator);
    heavy_first_ = first.peak_allocated > last.peak_allocated ||
                   (first.peak_allocated == last.peak_allocated && first.peak_reserved >= last.peak_reserved);
    // Each peak the highest of the routings tried (the placement is chosen by the allocated peak; the other's
    // reserved peak may be higher).
    routing_floor_allocated_ = std::max({expected.peak_allocated, first.peak_allocated, last.peak_allocated});
    routing_floor_reserved_ = std::max({expected.peak_reserved, first.peak_reserved, last.peak_reserved});
    moe.routed_calls = static_cast<int64_t>(model_.routed_calls.size());
    for (const detail::RoutedCall& c : model_.routed_calls) {
      moe.experts = std::max<int64_t>(moe.experts, static_cast<int64_t>(c.units.size()));
      moe.top_k = std::max(moe.top_k, c.top_k());
    }
    moe.skew = in_.moe_skew;
    moe.routed_allocations = static_cast<int64_t>(model_.routed.size());
    moe.unexplained_allocations = model_.routed_unexplained;
    moe.expected_peak_allocated_bytes = expected.peak_allocated;
    moe.expected_peak_reserved_bytes = expected.peak_reserved;
    out_.moe = moe;
  }

  // The blocks held at the start by category, then largest first; the references to them follow.
  static void order_initial(Stream& st) {
    std::vector<size_t> order(st.initial_bytes.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      if (st.initial_category[x] != st.initial_category[y]) return st.initial_category[x] < st.initial_category[y];
      return st.initial_bytes[x] > st.initial_bytes[y];
    });
    std::vector<int64_t> bytes, moved_to(order.size());
    std::vector<Category> category;
    for (size_t n = 0; n < order.size(); ++n) {
      bytes.push_back(st.initial_bytes[order[n]]);
      category.push_back(st.initial_category[order[n]]);
      moved_to[order[n]] = static_cast<int64_t>(n);
    }
    st.initial_bytes = std::move(bytes);
    st.initial_category = std::move(category);
    for (Entry& e : st.entries) {
      if (e.ref < 0) e.ref = initial_ref(static_cast<size_t>(moved_to[static_cast<size_t>(-2 - e.ref)]));
    }
  }

  static void aggregate_initial(Stream& st) {
    std::vector<int64_t> bytes(kNumCategories, 0);
    for (size_t i = 0; i < st.initial_bytes.size(); ++i) bytes[static_cast<size_t>(st.initial_category[i])] += st.initial_bytes[i];
    st.initial_bytes = bytes;
    st.initial_category.clear();
    for (int c = 0; c < kNumCategories; ++c) st.initial_category.push_back(static_cast<Category>(c));
    std::vector<Entry> kept;
    for (const Entry& e : st.entries) {
      if (e.alloc || e.ref >= 0) kept.push_back(e);
    }
    st.entries = std::move(kept);
    if (st.zero_grad_entry >= static_cast<int64_t>(st.entries.size())) st.zero_grad_entry = kNone;
  }

  Planned planned(int64_t batch, bool gpu) {
    const Stream& s = *model_.shape;
    const ParallelConfig& par = in_.parallel;
    const double bb = static_cast<double>(batch);
    const double ll = static_cast<double>(in_.target_seq);
    auto size_of = [&](const Fit& f, int64_t fallback) { return out_.scaled ? f.at(bb, ll) : fallback; };
    Planned p;
    p.initial.reserve(s.initial_bytes.size());
    p.initial_category.reserve(s.initial_bytes.size());
    // Room for all that follows, exactly, without a reallocation (which holds two copies at once): a synthesized
    // second iteration and a GPU target's additions (two cuBLAS workspaces, an allocation and a free per step).
    const size_t steps = static_cast<size_t>(std::max(2, s.iterations));
    p.entries.reserve(s.entries.size() + (s.iterations < 2 ? steady_plan(s).entries : 0) + 2 * steps + 2);
    for (size_t k = 0; k < s.initial_bytes.size(); ++k) {
      p.initial.push_back(size_of(model_.initial_fits[k], s.initial_bytes[k]));
      p.initial_category.push_back(s.initial_category[k]);
    }
    const std::vector<std::vector<int64_t>> loads =
        model_.routed.empty() || !out_.scaled ? std::vector<std::vector<int64_t>>{} : routing_loads(batch);
    for (Entry e : s.entries) {
      if (e.alloc) {
        e.bytes = size_of(model_.alloc_fits.at(static_cast<size_t>(e.ref)), e.bytes);
        if (auto it = model_.routed.find(e.ref); !loads.empty() && it != model_.routed.end()) {
          const RoutedFit& r = it->second;
          const std::vector<int64_t>& call = loads[static_cast<size_t>(r.call)];
          const int64_t load = std::max(call[static_cast<size_t>(r.unit)],
                                        r.other >= 0 ? call[static_cast<size_t>(r.other)] : int64_t{0});
          e.bytes = r.fit.at(static_cast<double>(load));
        }
      }
      p.entries.push_back(e);
    }
    if (s.iterations < 2) synthesize_steady_iteration(p, s);
    apply_parallel(p, par);
    if (!gpu && batch == in_.op_workspace_batch && !in_.op_workspaces.empty()) replace_op_scratch(p);
    if (gpu && host_probes()) add_device_allocations(p, s);
    else if (gpu) mark_conv_calls(p);
    return p;
  }

  // From a one-iteration trace, the second iteration: optimizer state exists, gradients from iteration 1
  // are freed where zero_grad runs (set_to_none, PyTorch's default) or kept and accumulated into.
  void synthesize_steady_iteration(Planned& p, const Stream& s) {
    const SteadyPlan& plan = steady_plan(s);
    const size_t n = p.entries.size();
    auto freed_in_iteration_2 = [](int64_t ref, Phase phase) {
      return Entry::made(false, ref, 0, Category::Other, phase, kNone, 2);
    };
    const bool zero_grad = s.zero_grad_entry != kNone;
    // No zero_grad ran before the backward: iteration 1's gradients are taken as kept into iteration 2 and
    // accumulated into (zero_grad(set_to_none=False), or none), the bound that cannot be low. A loop that frees them
    // where the trace cannot see (zero_grad after the step, nn.Module.zero_grad before the forward) holds up to their
    // bytes less: said, with the bytes.
    if (!zero_grad && plan.persistent_grad_bytes > 0) {
      out_.notes.push_back(Note{"gradients-kept", fmt::format(
          "no zero_grad ran in the traced iteration before its backward: its gradients ({} bytes) are taken as kept "
          "into the next iteration and accumulated into; a loop that frees them elsewhere (zero_grad after the step, "
          "nn.Module.zero_grad) peaks up to that much lower",
          plan.persistent_grad_bytes)});
    }
    for (size_t i = 0; i < n; ++i) {
      if (zero_grad && static_cast<int64_t>(i) == s.zero_grad_entry) {
        for (int64_t r : plan.persistent_grads) p.entries.push_back(freed_in_iteration_2(r, Phase::Optimizer));
      }
      Entry e = p.entries[i];  // a copy: the push below may move the vector
      if (plan.skipped(e.ref)) continue;
      const int64_t ref = e.ref;
      if (e.ref >= 0) e.ref += kSecondIterationRef;
      else if (!e.alloc) continue;  // initial blocks freed in iteration 1 are gone
      e.iteration = 2;
      p.entries.push_back(e);
      // What iteration 1 left behind besides its gradients (the loss, outputs the caller keeps) is replaced by
      // iteration 2's counterpart: a loop's `loss = ...` frees the old value once the new one is bound, a cache
      // made once holds one copy. Freed right after the counterpart is allocated.
      if (e.alloc && plan.left_behind(ref)) p.entries.push_back(freed_in_iteration_2(ref, e.phase));
    }
  }

  // What synthesize_steady_iteration() repeats and frees, from the stream's structure alone (the same at every
  // batch size the largest-batch search tries): worked out once.
  struct SteadyPlan {
    std::vector<char> skip;  // by allocation position: not allocated again in iteration 2
    std::vector<int64_t> persistent_grads, persistent_other;  // allocations iteration 1 never freed
    int64_t persistent_grad_bytes = 0;                         // the probe's bytes of persistent_grads
    size_t entries = 0;      // the entries iteration 2 adds
    std::vector<char> other;  // by allocation position: in persistent_other
    bool skipped(int64_t ref) const {
      return ref >= 0 && ref < static_cast<int64_t>(skip.size()) && skip[static_cast<size_t>(ref)] != 0;
    }
    bool left_behind(int64_t ref) const {
      return ref >= 0 && ref < static_cast<int64_t>(other.size()) && other[static_cast<size_t>(ref)] != 0;
    }
  };

  const SteadyPlan& steady_plan(const Stream& s) {
    if (steady_built_) return steady_;
    steady_built_ = true;
    SteadyPlan& plan = steady_;
    // Refs of allocations are their positions (0, 1, ...), of initial blocks -2, -3, ...: flags by position.
    const auto positions = static_cast<int64_t>(s.ptr_of.size());
    std::vector<char> freed(s.ptr_of.size(), 0);
    for (const Entry& e : s.entries) {
      if (!e.alloc && e.ref >= 0 && e.ref < positions) freed[static_cast<size_t>(e.ref)] = 1;
    }
    plan.skip.assign(s.ptr_of.size(), 0);
    for (const Entry& e : s.entries) {
      if (!e.alloc || e.ref < 0 || e.ref >= positions || freed[static_cast<size_t>(e.ref)] != 0) continue;
      if (e.category == Category::OptimizerState) plan.skip[static_cast<size_t>(e.ref)] = 1;
      else if (e.category == Category::Gradient) {
        plan.persistent_grads.push_back(e.ref);
        plan.persistent_grad_bytes += e.bytes;
      } else {
        plan.persistent_other.push_back(e.ref);
      }
    }
    plan.other.assign(s.ptr_of.size(), 0);
    for (int64_t r : plan.persistent_other) plan.other[static_cast<size_t>(r)] = 1;
    const bool zero_grad = s.zero_grad_entry != kNone;
    if (!zero_grad) {
      for (int64_t r : plan.persistent_grads) plan.skip[static_cast<size_t>(r)] = 1;  // accumulated into, not allocated again
    }
    for (const Entry& e : s.entries) {
      if (!plan.skipped(e.ref) && (e.ref >= 0 || e.alloc)) ++plan.entries;
    }
    plan.entries += (zero_grad ? plan.persistent_grads.size() : 0) + plan.persistent_other.size();
    return plan;
  }

  // DDP's buckets (ZeRO-1 is PyTorch's ZeroRedundancyOptimizer, which runs over DDP): a flat copy of every gradient
  // (first bucket 1 MiB, the rest 25 MiB), allocated at construction (torch/csrc/distributed/c10d/reducer.cpp,
  // initialize_buckets) and held for the run. With gradient_as_bucket_view the gradients become views of the
  // buckets, but only once autograd has made them: after zero_grad(set_to_none=True), PyTorch's default, every
  // backward allocates each gradient anew and DDP copies it into its bucket before pointing .grad at the view
  // (reducer.cpp, mark_variable_ready_dense). The buckets are therefore counted in both cases, and autograd's
  // gradients as the probes held them: for set_to_none=False, where .grad stays the view, that is up to one gradient
  // copy high (said in the note), never low.
  void add_ddp_buckets(Planned& p, const ParallelConfig& par, int64_t bytes) {
    p.initial.push_back(bytes);
    p.initial_category.push_back(Category::Gradient);
    if (!par.gradient_as_bucket_view) {
      out_.notes.push_back(Note{"ddp-bucket-copy", "DDP bucket buffers: a second copy of the gradients (gradient_as_bucket_view=False)"});
    } else {
      out_.notes.push_back(Note{"ddp-bucket-view", fmt::format(
          "DDP bucket buffers ({}) counted with gradient_as_bucket_view=True too: after zero_grad(set_to_none=True) "
          "autograd allocates each gradient anew and DDP copies it into its bucket; where zero_grad keeps them "
          "(set_to_none=False) the gradients are the buckets' views and the forecast is up to that much high",
          format_bytes(bytes))});
    }
  }

  // A rule not matched to its engine: said once as a warning, and the forecast marked approximate with the reasons.
  void mark_approximate(const std::string& reason) {
    out_.approximate = true;
    if (out_.approximate_reason.find(reason) == std::string::npos) {
      out_.approximate_reason += (out_.approximate_reason.empty() ? "" : "; ") + reason;
    }
    out_.warnings.push_back(Note{"approximate-rule", "the memory forecast is approximate: " + reason});
  }

  // Each rank's share of the parameters under ZeroRedundancyOptimizer's partition, which is its share of the
  // optimizer state (Adam's state is two tensors of each parameter's size): parameters sorted largest first, each
  // given to the rank with the fewest so far, the first such rank on a tie (torch 2.14.1
  // torch/distributed/optim/zero_redundancy_optimizer.py, _partition_parameters; by numel, here by bytes, the same
  // for one dtype). The parameters are the reference probe's blocks held at the start and tagged as such (the plan's
  // own initial blocks may have been merged by category); none: even shares. Worked out once.
  const std::vector<double>& zero1_shares(int64_t dp) {
    if (!zero1_shares_.empty()) return zero1_shares_;
    std::vector<int64_t> params;
    if (model_.trace != nullptr) {
      for (const Allocation& a : model_.trace->allocations) {
        if (a.baseline && a.category == Category::Parameter && a.bytes > 0) params.push_back(a.bytes);
      }
    }
    int64_t total = 0;
    for (int64_t b : params) total += b;
    zero1_shares_.assign(static_cast<size_t>(dp), 1.0 / static_cast<double>(dp));
    if (total == 0) return zero1_shares_;
    std::stable_sort(params.begin(), params.end(), std::greater<>());
    std::vector<int64_t> sizes(static_cast<size_t>(dp), 0);
    zero1_largest_.assign(static_cast<size_t>(dp), 0);
    for (int64_t b : params) {
      const auto r = static_cast<size_t>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      sizes[r] += b;
      zero1_largest_[r] = std::max(zero1_largest_[r], b);
    }
    for (size_t r = 0; r < sizes.size(); ++r) zero1_shares_[r] = static_cast<double>(sizes[r]) / static_cast<double>(total);
    return zero1_shares_;
  }

  // ZeRO-1's local optimizer steps the rank's own parameters largest first (the partition's order), where the probes
  // stepped all of them in the model's order. A step's temporaries per parameter are alike, but one can outlive its
  // parameter's turn (the single-tensor loop, CPU tensors' default, keeps AdamW's `denom` until the next parameter's
  // replaces it), so the largest two can meet. Bound: a block of the rank's largest parameter held through each
  // optimizer step (torch 2.14.1 torch/optim/adamw.py, _single_tensor_adamw; traced on real ranks,
  // tests/python/test_dist_memory.py).
  void hold_during_step(Planned& p, int64_t bytes) {
    if (bytes <= 0) return;
    std::map<int32_t, std::pair<size_t, size_t>> span;  // iteration -> first and last optimizer-phase entry
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const Entry& e = p.entries[i];
      if (e.phase != Phase::Optimizer || e.op < 0) continue;
      auto [it, fresh] = span.emplace(e.iteration, std::make_pair(i, i));
      if (!fresh) it->second.second = i;
    }
    std::vector<std::pair<size_t, Entry>> adds;
    // 2^53: a chosen ref range of its own, above every other (memory_plan.h's and fsdp_memory.h's).
    int64_t ref = int64_t{1} << 53;
    for (const auto& [iteration, se] : span) {
      adds.emplace_back(se.first, Entry::made(true, ref, bytes, Category::Temporary, Phase::Optimizer, kNone, iteration));
      adds.emplace_back(se.second + 1, Entry::made(false, ref, 0, Category::Temporary, Phase::Optimizer, kNone, iteration));
      ++ref;
    }
    insert_before(p.entries, adds);
    out_.notes.push_back(Note{"zero1-step-order", fmt::format(
        "ZeRO-1: each rank steps its own parameters largest first, so two of its largest parameters' step "
        "temporaries can meet: a block of its largest parameter (up to {}) held through each optimizer step",
        format_bytes(*std::max_element(zero1_largest_.begin(), zero1_largest_.end())))});
  }

  // The data-parallel ranks in groups that hold the same bytes (FSDP2: the same rows of every parameter; ZeRO-1:
  // the same share of the parameters; otherwise all alike), each group's ranks in order.
  std::vector<std::vector<int64_t>> rank_groups() {
    const ParallelConfig& par = in_.parallel;
    if (par.traced_world > 0) return {{par.traced_rank}};  // the probes' own rank, the only one traced
    std::map<std::vector<int64_t>, std::vector<int64_t>> by_key;
    for (int64_t r = 0; r < par.dp; ++r) {
      std::vector<int64_t> key;
      if (par.dp_mode == "fsdp" && !par.fsdp_units.empty() && model_.trace != nullptr) {
        for (const detail::FsdpParam& q : fsdp_layout(par).params) key.push_back(detail::fsdp_local_rows(q.rows, par.dp, r));
      } else if (par.dp_mode == "zero1") {
        key.push_back(static_cast<int64_t>(std::llround(zero1_shares(par.dp)[static_cast<size_t>(r)] * 1e12)));
      }
      by_key[key].push_back(r);
    }
    std::vector<std::vector<int64_t>> groups;
    for (auto& [key, ranks] : by_key) groups.push_back(std::move(ranks));
    std::sort(groups.begin(), groups.end());
    return groups;
  }

  void apply_parallel(Planned& p, const ParallelConfig& par) {
    const int64_t dp = par.dp;
    auto shard = [](int64_t bytes, int64_t ways) { return (bytes + ways - 1) / ways; };
    int64_t grad_bytes = 0;
    for (const Entry& e : p.entries) {
      if (e.alloc && e.category == Category::Gradient && e.iteration == 1) grad_bytes += e.bytes;
    }
    int64_t param_bytes = 0;
    for (size_t i = 0; i < p.initial.size(); ++i) {
      if (p.initial_category[i] == Category::Parameter) param_bytes += p.initial[i];
    }
    if (par.traced_world > 0) {
      // A fake group's collectives finish at once; gloo's worker threads can hold a collective's tensors after the
      // job drops them (the FSDP2 rule's gloo-late-frees), which a traced rank does not show.
      out_.notes.push_back(Note{"rank-traced", fmt::format(
          "the probes ran as rank {} of {} (simulated ranks): the forecast is that rank's memory as PyTorch's own "
          "parallel modules built it, with no parallel rule applied{}", par.traced_rank, par.traced_world,
          in_.target == "cpu" ? "; on gloo a run can peak higher by the tensors of a collective its worker threads "
                                "let go of late, which a simulated rank does not show"
                              : "")});
      return;
    }
    if (par.tp > 1 || par.pp > 1) {
      // Model states and activations divided over tensor-parallel ranks and pipeline stages; the first stage holds
      // in_flight micro-batches of its 1/pp of the layers (first_stage_in_flight, gpucast/parallel.h), divided by tp.
      const int64_t model_ways = par.tp * par.pp;
      const int64_t in_flight = first_stage_in_flight(par.pp, par.micro_batches);
      for (size_t i = 0; i < p.initial.size(); ++i) {
        if (p.initial_category[i] != Category::Input) p.initial[i] = shard(p.initial[i], model_ways);
      }
      for (Entry& e : p.entries) {
        if (!e.alloc) continue;
        if (e.category == Category::Activation) e.bytes = shard(checked_mul(e.bytes, in_flight, "parallel"), model_ways);
        else if (e.category != Category::Input) e.bytes = shard(e.bytes, model_ways);
      }
      out_.notes.push_back(Note{"model-parallel-rule", fmt::format(
          "tp={} pp={}: model states divided by {}, activations of {} micro-batches in flight (1F1B, first stage) "
          "divided by {}; a coarse rule, not yet checked against measurements",
          par.tp, par.pp, model_ways, in_flight, model_ways)});
      mark_approximate("tensor and pipeline parallelism: model states and activations divided by a coarse rule, "
                       "not yet matched to PyTorch's tensor parallelism or pipelining");
    }
    if (dp == 1 && par.dp_mode != "fsdp") return;
    if (par.dp_mode == "ddp" || par.dp_mode == "zero1") add_ddp_buckets(p, par, grad_bytes > 0 ? grad_bytes : param_bytes);
    if (par.dp_mode == "ddp") return;
    if (par.dp_mode == "zero2") {
      mark_approximate("ZeRO-2: gradients and optimizer state divided evenly over the ranks, a rule not yet matched "
                       "to an engine");
    } else if (par.dp_mode == "fsdp" && !par.fsdp_units.empty() && model_.trace != nullptr) {
      apply_fsdp2(p, par, rank_);
      return;
    } else if (par.dp_mode == "fsdp") {
      mark_approximate("FSDP without fsdp_units: every layer with parameters taken as a unit, and all-gather buffers "
                       "of two of the largest parameter block held for the whole step, gradients as if born sharded; "
                       "give fsdp_units for FSDP2's own rule");
    }
    // ZeRO-1's optimizer state follows its parameters' partition; ZeRO-2 and FSDP shard every tensor evenly.
    const double state_share = par.dp_mode == "zero1" ? zero1_shares(dp)[static_cast<size_t>(rank_)] : 1.0 / static_cast<double>(dp);
    auto state_shard = [&](int64_t bytes) {
      return par.dp_mode == "zero1" ? static_cast<int64_t>(std::ceil(static_cast<double>(bytes) * state_share))
                                    : shard(bytes, dp);
    };
    // On CUDA, Adam and AdamW default to their foreach path (one list of temporaries for all the rank's
    // parameters: add_device_allocations' rule), where no parameter's temporary waits for the next one's.
    if (par.dp_mode == "zero1" && in_.target == "cpu") hold_during_step(p, zero1_largest_[static_cast<size_t>(rank_)]);
    for (Entry& e : p.entries) {
      if (!e.alloc) continue;
      if (e.category == Category::OptimizerState) e.bytes = state_shard(e.bytes);
      if ((par.dp_mode == "zero2" || par.dp_mode == "fsdp") && e.category == Category::Gradient) e.bytes = shard(e.bytes, dp);
    }
    for (size_t i = 0; i < p.initial.size(); ++i) {
      if (p.initial_category[i] == Category::OptimizerState) p.initial[i] = state_shard(p.initial[i]);
      if ((par.dp_mode == "zero2" || par.dp_mode == "fsdp") && p.initial_category[i] == Category::Gradient) {
        p.initial[i] = shard(p.initial[i], dp);
      }
      if (par.dp_mode == "fsdp" && p.initial_category[i] == Category::Parameter) p.initial[i] = shard(p.initial[i], dp);
    }
    if (par.dp_mode == "fsdp") {
      // No units given: every layer with parameters taken as one, gathered into two buffers of the largest
      // parameter block for the whole step (a coarse bound; two: FSDP's in-flight all-gathers).
      const int64_t largest = p.initial.empty() ? 0 : *std::max_element(p.initial.begin(), p.initial.end());
      p.initial.push_back(2 * std::max<int64_t>(largest * dp, 0));
      p.initial_category.push_back(Category::Parameter);
      out_.notes.push_back(Note{"fsdp-gather-buffers", "FSDP: all-gather buffers for two units, sized by the largest parameter block"});
    }
  }

  // FSDP2 with its units given: the probes' stream rewritten into what rank `rank` holds (fsdp_memory.h).
  void apply_fsdp2(Planned& p, const ParallelConfig& par, int64_t rank) {
    detail::apply_fsdp(p, fsdp_layout(par), rank, fsdp_held_works_);
    if (par.param_dtype_bytes > 0 && par.param_dtype_bytes != 4) {
      mark_approximate("FSDP2 mixed precision: what forward and backward compute is taken in param_dtype wherever the "
                       "float32 probes made float32, so blocks that stay float32 under it (normalisation statistics, "
                       "a loss upcast) are counted smaller; the buffers follow FSDP2");
    }
    out_.notes.push_back(Note{"fsdp2-rule", fmt::format(
        "FSDP2 (fully_shard) over {} ranks with {} units and the root: sharded parameters padded to whole rows, each "
        "unit gathered before its forward and backward (the next one ahead in backward), resharded after forward "
        "({}), its gradients reduce-scattered after its backward; optimizer state of each rank's own rows",
        par.dp, par.fsdp_units.size(),
        par.reshard_after_forward < 0 ? "the units but the root, fully_shard's default"
        : par.reshard_after_forward == 1 ? "True" : par.reshard_after_forward == 0 ? "False"
                                         : fmt::format("to {} ranks", par.reshard_after_forward))});
  }

  // The FSDP2 layout of the reference probe, worked out once: each parameter (a block held at the start, tagged as
  // one) with its rows (dim 0 of the first op input on its storage) and its unit (the unit of the first op that
  // reads it; none: the root's); each op's unit, from its module (backward: the module of the forward op its node
  // came from); and for the optimizer's ops the parameter whose rows their blocks follow.
  const detail::FsdpLayout& fsdp_layout(const ParallelConfig& par) {
    if (fsdp_layout_built_) return fsdp_layout_;
    fsdp_layout_built_ = true;
    const Trace& t = *model_.trace;
    detail::FsdpLayout& l = fsdp_layout_;
    l.dp = par.dp;
    l.units = static_cast<int32_t>(par.fsdp_units.size()) + 1;
    l.root = l.units - 1;
    l.reshard_after_forward = par.reshard_after_forward < 0 ? 1 : par.reshard_after_forward;
    l.root_reshard_after_forward = par.reshard_after_forward < 0 ? 0 : par.reshard_after_forward;
    l.gloo = in_.target == "cpu";
    // Mixed precision, against parameters in float32 (4 bytes: what MixedPrecisionPolicy is used with).
    if (par.param_dtype_bytes > 0) {
      l.param_scale = static_cast<double>(par.param_dtype_bytes) / 4.0;
      l.reduce_scale = static_cast<double>(par.reduce_dtype_bytes > 0 ? par.reduce_dtype_bytes : par.param_dtype_bytes) / 4.0;
      l.float_op.assign(t.ops.size(), 0);
      for (const OpRecord& op : t.ops) {
        l.float_op[static_cast<size_t>(op.id)] = !op.outputs.empty() && !op.outputs[0].tensors.empty() &&
                                                 op.outputs[0].tensors[0].dtype == "float32";
      }
    } else if (par.reduce_dtype_bytes > 0) {
      l.reduce_scale = static_cast<double>(par.reduce_dtype_bytes) / 4.0;
    }
    // Each op's module (backward: the module of the forward op its node came from), then its unit by FSDP's one
    // rule over module paths (fsdp_units(), step_time.h; UserError for a path that holds no module the probes ran).
    std::vector<std::string> modules;
    std::unordered_map<std::string, int32_t> module_index;
    std::vector<int32_t> op_module(t.ops.size(), -1);
    for (const OpRecord& op : t.ops) {
      if (op.phase == Phase::Optimizer) continue;
      std::string_view module = op.module;
      if (op.phase == Phase::Backward) {
        // The engine's record around a node frees the node's inputs and saved tensors as it ends: the node inside
        // it (the next op) is the one whose unit they are, not the latest that ran before it.
        const auto next = static_cast<size_t>(op.id) + 1;
        const bool record = op.name.rfind("autograd::engine::evaluate_function", 0) == 0 && next < t.ops.size() &&
                            t.ops[next].parent == op.id && t.ops[next].scope == Scope::BackwardFunction &&
                            t.ops[next].fwd_op >= 0;
        const int64_t node = record ? static_cast<int64_t>(next) : gradient_node(t, op);
        const int64_t fwd = node >= 0 ? t.ops[static_cast<size_t>(node)].fwd_op : -1;
        if (fwd >= 0) module = t.ops[static_cast<size_t>(fwd)].module;
      }
      if (module.empty()) continue;
      const auto [it, fresh] = module_index.emplace(std::string(module), static_cast<int32_t>(modules.size()));
      if (fresh) modules.push_back(it->first);
      op_module[static_cast<size_t>(op.id)] = it->second;
    }
    const FsdpUnits units = fsdp_units(modules, std::vector<double>(modules.size(), 0.0), par.fsdp_units);
    l.op_unit.assign(t.ops.size(), detail::kOutsideUnits);
    for (size_t o = 0; o < t.ops.size(); ++o) {
      if (op_module[o] >= 0) l.op_unit[o] = static_cast<int32_t>(units.unit_of[static_cast<size_t>(op_module[o])]);
    }
    // The parameters, by address.
    std::unordered_map<uint64_t, int32_t> param_at;
    for (const Allocation& a : t.allocations) {
      if (!a.baseline || a.category != Category::Parameter || a.bytes <= 0) continue;
      param_at[a.ptr] = static_cast<int32_t>(l.params.size());
      l.params.push_back(detail::FsdpParam{l.root, a.bytes, 1});
    }
    auto param_input = [&](const OpRecord& op) -> int32_t {
      for (const Value& v : op.inputs) {
        for (const TensorMeta& m : v.tensors) {
          if (auto it = param_at.find(m.storage); it != param_at.end()) return it->second;
        }
      }
      return detail::kUnknownParam;
    };
    // A parameter's rows: dim 0 of the largest contiguous tensor seen on its storage (ops also read views of it:
    // a slice, a transpose; the optimizer reads it whole). Its unit: the unit of the first forward op reading it.
    std::vector<int64_t> numel(l.params.size(), 0);
    std::vector<char> placed(l.params.size(), 0);
    for (const OpRecord& op : t.ops) {
      for (const Value& v : op.inputs) {
        for (const TensorMeta& m : v.tensors) {
          const auto it = param_at.find(m.storage);
          if (it == param_at.end()) continue;
          const auto q = static_cast<size_t>(it->second);
          int64_t n = 1, stride = 1;
          bool contiguous = m.strides.size() == m.shape.size();
          for (size_t d = m.shape.size(); d-- > 0;) {
            if (contiguous && m.shape[d] > 1 && m.strides[d] != stride) contiguous = false;
            stride *= m.shape[d];
            n *= m.shape[d];
          }
          if (contiguous && n > numel[q]) {
            numel[q] = n;
            l.params[q].rows = m.shape.empty() ? 1 : std::max<int64_t>(1, m.shape[0]);
          }
          if (op.phase == Phase::Forward && !placed[q]) {
            placed[q] = 1;
            const int32_t u = l.op_unit[static_cast<size_t>(op.id)];
            l.params[q].unit = u >= 0 ? u : l.root;
          }
        }
      }
    }
    // The optimizer's blocks: shaped like the parameter an op (or one it runs inside, up to 8 levels) reads.
    // 8: a chosen bound (zeros_like -> empty_like -> empty_strided is 3 deep).
    l.state_param.assign(t.ops.size(), detail::kUnknownParam);
    for (const OpRecord& op : t.ops) {
      if (op.phase != Phase::Optimizer) continue;
      int32_t q = detail::kUnknownParam;
      for (int64_t o = op.id, depth = 0; o >= 0 && depth < 8 && q < 0; o = t.ops[static_cast<size_t>(o)].parent, ++depth) {
        q = param_input(t.ops[static_cast<size_t>(o)]);
      }
      if (q < 0 && !op.outputs.empty() && op.outputs[0].tensors.size() == 1 && op.outputs[0].tensors[0].shape.empty() &&
          !op.outputs[0].tensors[0].dtype.empty()) {
        q = detail::kScalarState;
      }
      l.state_param[static_cast<size_t>(op.id)] = q;
    }
    return l;
  }

  // The tensors scaled-dot-product attention saves for backward differ between the CPU kernels the probes
  // ran and the CUDA kernels the target runs. Rule (from the kernels' output shapes): q is [B, H, L, E];
  //  - CPU flash (_scaled_dot_product_flash_attention_for_cpu) saves logsumexp [B, H, L] float32. On CUDA,
  //    16-bit inputs run flash attention, which saves the same; float32 inputs run memory-efficient
  //    attention, whose logsumexp is [B, H, ceil(L / 32) * 32].
  //  - The CPU math path (_scaled_dot_product_attention_math) saves the attention weights [B, H, L, S]; CUDA
  //    runs memory-efficient attention instead, which saves a logsumexp [B, H, ceil(L / 32) * 32] float32.
  // Returns the number of allocations resized.
  int64_t adjust_attention(Planned& p) {
    const Trace& t = *model_.trace;
    const std::unordered_map<uint64_t, double>& factor = attention_factors();
    if (factor.empty()) return 0;
    int64_t changed = 0;
    for (Entry& e : p.entries) {
      if (!e.alloc || !e.probe_block) continue;
      const int64_t pos = e.ref >= kSecondIterationRef ? e.ref - kSecondIterationRef : e.ref;
      if (pos < 0 || pos >= static_cast<int64_t>(model_.shape->ptr_of.size())) continue;
      auto it = factor.find(model_.shape->ptr_of[static_cast<size_t>(pos)]);
      if (it == factor.end() || it->second == 1.0 || e.op < 0) continue;
      // Only the allocation made by that attention call (the address may be reused later).
      const OpRecord* op = &t.ops[e.op];
      while (op->parent >= 0 && op->name.find("scaled_dot_product") == std::string::npos) op = &t.ops[op->parent];
      if (op->name.find("scaled_dot_product") == std::string::npos) continue;
      e.bytes = static_cast<int64_t>(std::llround(static_cast<double>(e.bytes) * it->second));
      ++changed;
    }
    return changed;
  }

  // The saved outputs' storages of the reference trace's attention calls -> their size factor on CUDA (above);
  // found once (planned() runs at every batch size the largest-batch search tries).
  const std::unordered_map<uint64_t, double>& attention_factors() {
    if (attention_factors_found_) return attention_factors_;
    attention_factors_found_ = true;
    std::unordered_map<uint64_t, double>& factor = attention_factors_;
    const Trace& t = *model_.trace;
    for (const OpRecord& op : t.ops) {
      const bool flash = op.name == "aten::_scaled_dot_product_flash_attention_for_cpu";
      const bool math = op.name == "aten::_scaled_dot_product_attention_math";
      if ((!flash && !math) || op.phase != Phase::Forward || op.inputs.empty() || op.outputs.size() < 2) continue;
      const Value& q = op.inputs[0];
      const Value& saved = op.outputs[1];
      if (q.kind != Value::Kind::Tensor || saved.kind != Value::Kind::Tensor || q.tensors[0].shape.size() != 4) continue;
      const TensorMeta& qt = q.tensors[0];
      const TensorMeta& st = saved.tensors[0];
      const double L = static_cast<double>(qt.shape[2]);
      // 32: kAlignLSE (torch 2.14.1 ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h:114).
      const double padded = std::ceil(L / 32.0) * 32.0;
      if (flash) {
        if (qt.dtype == "float32") factor[st.storage] = padded / L;
      } else if (st.shape.size() == 4) {
        const double elem = st.dtype == "float32" ? 4.0 : st.dtype == "float64" ? 8.0 : 2.0;
        factor[st.storage] = padded * 4.0 / (L * static_cast<double>(st.shape[3]) * elem);
      }
    }
    return factor;
  }

  // Per op of the reference trace: a matrix multiply (found once, as above).
  const std::vector<char>& matmul_ops() {
    if (matmul_ops_.empty() && !model_.trace->ops.empty()) {
      matmul_ops_.reserve(model_.trace->ops.size());
      for (const OpRecord& op : model_.trace->ops) matmul_ops_.push_back(is_matmul(op.name) ? 1 : 0);
    }
    return matmul_ops_;
  }

  // The outermost convolution op (forward: aten::conv2d, aten::convolution...; backward:
  // aten::convolution_backward) each op of the reference trace runs in; kNone outside convolutions.
  const std::vector<int64_t>& conv_call_of() {
    if (conv_call_of_.empty()) {
      conv_call_of_ = outermost_calls(model_.trace->ops, [](const OpRecord& op) { return op_cost_kind(op.name) == "conv"; });
    }
    return conv_call_of_;
  }

  // Per op of the reference trace: the kernel call it runs in (kNone: none). A kernel call is the outermost op
  // whose ops inside, if any, only allocate, cast, copy or view (kernel_primitive): one CPU kernel with the
  // allocations it makes through ATen (aten::native_batch_norm and its aten::empty scratch; aten::mul_ and the cast
  // TensorIterator makes of a double scalar; the CPU's flash attention and its per-thread buffers).
  const std::vector<int64_t>& kernel_call_of() {
    const std::vector<OpRecord>& ops = model_.trace->ops;
    if (!kernel_call_of_.empty() || ops.empty()) return kernel_call_of_;
    const auto n = static_cast<int64_t>(ops.size());
    std::vector<char> pure(ops.size(), 1);  // every op inside is a primitive
    for (int64_t i = 0; i < n; ++i) {
      if (kernel_primitive(ops[static_cast<size_t>(i)].name)) continue;
      // 64: a chosen guard, deeper than any nesting a trace holds; each step goes to an enclosing op.
      int64_t o = ops[static_cast<size_t>(i)].parent;
      for (int depth = 0; o >= 0 && o < n && pure[static_cast<size_t>(o)] && depth < 64; ++depth) {
        pure[static_cast<size_t>(o)] = 0;
        o = ops[static_cast<size_t>(o)].parent;
      }
    }
    kernel_call_of_ = outermost_calls(ops, [&](const OpRecord& op) {
      return op.scope == Scope::Function && pure[static_cast<size_t>(&op - ops.data())];
    });
    return kernel_call_of_;
  }

  // Whether an allocation of the probes' stream (its ref; a synthesized second iteration's too) holds at most 8
  // bytes at every batch: a constant fit of that size.
  bool one_element(int64_t ref) const {
    const int64_t pos = ref >= kSecondIterationRef ? ref - kSecondIterationRef : ref;
    if (pos < 0 || pos >= static_cast<int64_t>(model_.alloc_fits.size())) return false;
    const Fit& f = model_.alloc_fits[static_cast<size_t>(pos)];
    return f.c1 == 0 && f.c2 == 0 && f.cl == 0 && f.cbl == 0 && f.cbll == 0 && f.c0 > 0 && f.c0 <= 8;
  }

  // GPU target from host probes: what a CPU kernel allocates and frees before it returns is that kernel's own
  // scratch, never what the CUDA kernel allocates: batch norm's statistics buffers, oneDNN's scratchpads, the CPU
  // flash attention's per-thread buffers (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), and the input
  // casts TensorIterator makes only where an op runs on the CPU (aten/src/ATen/TensorIterator.cpp, compute_types:
  // "Creates temporaries for CPU operations", under common_device == kCPU; a CUDA kernel casts as it reads). Such
  // blocks are left out. A meta kernel allocates its outputs only (Python ones folded so: trace_assembly.h), so
  // meta probes have none of these, and both come to the stream the GPU's kernels make, where the meta device runs
  // the kernels the CPU does (docs/design.md, "The meta device"). Convolutions keep their own rule
  // (replace_conv_scratch), which puts cuDNN's workspace in their scratch's place.
  void drop_cpu_kernel_scratch(Planned& p) {
    const std::vector<int64_t>& call = kernel_call_of();
    const std::vector<int64_t>& conv = conv_call_of();
    if (call.empty()) return;
    auto call_of = [&](const Entry& e) {
      if (e.op < 0 || e.op >= static_cast<int64_t>(call.size()) || conv[static_cast<size_t>(e.op)] != kNone) return kNone;
      return call[static_cast<size_t>(e.op)];
    };
    std::unordered_set<int64_t> scratch = freed_in_their_call(p.entries, kNone, call_of);
    // Wrapped numbers: a Python or C++ scalar an op takes as a tensor is a one-element tensor on the CPU whatever
    // the op's device (aten/src/ATen/ScalarOps.h, wrapped_scalar_tensor; the Python argument parser's
    // scalar_to_tensor), so in a GPU job it is never GPU memory. In host probes such a block is one element (at most
    // 8 bytes) freed in the op it was made in (or the scope around ops that made it, when made before dispatch).
    // A device's own one-element temporary made and freed inside one op is left out with them: 8 bytes, one
    // 512-byte block of the caching allocator each. One element at every batch: its fitted size is a constant (a
    // block of a few bytes per sample is not), so the same entries go at every batch size.
    const std::vector<OpRecord>& ops = model_.trace->ops;
    std::unordered_map<int64_t, int64_t> small;  // ref -> the op that made it
    for (const Entry& e : p.entries) {
      if (e.alloc && e.op >= 0 && one_element(e.ref)) small[e.ref] = e.op;
    }
    for (const Entry& e : p.entries) {
      auto it = e.alloc ? small.end() : small.find(e.ref);
      if (it != small.end() && e.op >= 0 && encloses(ops, it->second, e.op)) scratch.insert(e.ref);
    }
    if (!scratch.empty()) std::erase_if(p.entries, [&](const Entry& e) { return scratch.count(e.ref) != 0; });
  }

  // Convolutions on CUDA (cuDNN, aten/src/ATen/native/cudnn/Conv_v8.cpp): what the CPU kernels allocate and
  // free inside a convolution (oneDNN's reorders and scratch, im2col columns) is not what CUDA allocates; there
  // cuDNN runs each convolution with one workspace from the caching allocator, taken after the outputs and
  // freed when the call returns. Those CPU allocations are left out, and after each call's last remaining
  // allocation comes its workspace (conv_workspace_ bytes) or, when that is unknown, a marker where the replay
  // measures how large it could be.
  // Probes on the GPU ran each convolution with the workspace cuDNN chose for their sizes: it stays in the
  // stream (fitted over the probes) unless a workspace is known (conv_workspace, or one measured for that call
  // at the target batch: conv_workspaces), and otherwise the marker follows the call.
  void replace_conv_scratch(Planned& p) {
    // What to do with each entry depends on the stream's structure only, the same at every batch size: worked
    // out once (0 keep, 1 leave out, 2 keep and add the workspace after it).
    if (conv_plan_.size() != p.entries.size()) plan_conv_calls(p);
    if (out_.conv_calls == 0 && conv_scratch_ == 0) return;
    // 2^50 - 1: a chosen ref range of its own, below kWorkspaceRef (2^50) and far above any trace position.
    constexpr int64_t kConvWorkspaceRef = (int64_t{1} << 50) - 1;
    const bool gpu_probe = gpu_probes();
    const std::vector<int64_t>& call = conv_call_of();
    // The workspace after a call: given for every call, else measured for this one (GPU probes), else -1.
    auto workspace = [&](const Entry& e) -> int64_t {
      if (conv_workspace_ >= 0 || !gpu_probe || in_.conv_workspaces.empty()) return conv_workspace_;
      if (e.op < 0 || e.op >= static_cast<int64_t>(call.size()) || call[e.op] == kNone) return -1;
      const OpRecord& op = model_.trace->ops[static_cast<size_t>(call[e.op])];
      auto it = in_.conv_workspaces.find(op.module + "|" + std::string(to_string(op.phase)));
      return it == in_.conv_workspaces.end() ? -1 : it->second;
    };
    std::vector<Entry> out;
    out.reserve(p.entries.size() + 2 * static_cast<size_t>(out_.conv_calls) * 2);
    out_.conv_calls_measured = 0;
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const Entry& e = p.entries[i];
      const int64_t ws = conv_plan_[i] != 0 ? workspace(e) : -1;
      // The CPU kernels' scratch is never what CUDA allocates; a GPU probe's is, unless another is known.
      if (conv_plan_[i] == 1 && (!gpu_probe || ws >= 0)) continue;
      out.push_back(e);
      if (conv_plan_[i] != 2) continue;
      if (gpu_probe && conv_workspace_ < 0 && ws >= 0 && e.iteration == 1) ++out_.conv_calls_measured;
      if (ws > 0) {
        out.push_back(Entry::made(true, kConvWorkspaceRef, ws, Category::Temporary, e.phase, e.op, e.iteration));
        out.push_back(Entry::made(false, kConvWorkspaceRef, 0, Category::Temporary, e.phase, e.op, e.iteration));
      } else if (ws < 0) {
        Entry mark = Entry::made(true, kConvWorkspaceRef, 0, Category::Temporary, e.phase, e.op, e.iteration);
        mark.conv_call = true;
        out.push_back(mark);
      }
    }
    p.entries = std::move(out);
  }

  void plan_conv_calls(const Planned& p) {
    conv_plan_.assign(p.entries.size(), 0);
    conv_scratch_ = 0;
    out_.conv_calls = 0;
    const std::vector<int64_t>& call = conv_call_of();
    if (call.empty()) return;
    auto call_of = [&](const Entry& e) { return e.op >= 0 && e.op < static_cast<int64_t>(call.size()) ? call[e.op] : kNone; };
    const std::unordered_set<int64_t> scratch = freed_in_their_call(p.entries, kNone, call_of);
    // The last kept allocation of each call (a call: its op and iteration).
    std::map<std::pair<int64_t, int>, size_t> last_of;
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const Entry& e = p.entries[i];
      if (scratch.count(e.ref) != 0) {
        conv_plan_[i] = 1;
        conv_scratch_ += e.alloc && e.iteration == 1 ? 1 : 0;
      } else if (e.alloc && call_of(e) != kNone) {
        last_of[{call_of(e), e.iteration}] = i;
      }
    }
    for (const auto& [key, i] : last_of) {
      conv_plan_[i] = 2;
      if (key.second == 1) ++out_.conv_calls;
    }
  }

  // CPU target: each matrix-multiply call with a scratch measured at this batch (op_workspaces) has what it
  // allocates and frees inside left out, and one block of the measured bytes allocated and freed after its
  // last remaining entry, over what it returns. A call: the op itself or the nearest enclosing op measured; its
  // instances in each iteration apart.
  void replace_op_scratch(Planned& p) {
    const std::vector<OpRecord>& ops = model_.trace->ops;
    const auto n = static_cast<int64_t>(ops.size());
    if (op_call_of_.size() != ops.size()) {
      op_call_of_.assign(ops.size(), kNone);
      for (int64_t j = 0; j < n; ++j) {
        // 64: a chosen guard, deeper than any op nesting a trace holds.
        for (int64_t k = j, depth = 0; k >= 0 && k < n && depth < 64; k = ops[k].parent, ++depth) {
          if (in_.op_workspaces.count(k) != 0) op_call_of_[j] = k;  // the outermost measured one
        }
      }
    }
    using Call = std::pair<int64_t, int>;  // a call instance: its op and iteration
    const Call none{kNone, 0};
    auto call_of = [&](const Entry& e) -> Call {
      if (e.op < 0 || e.op >= n || op_call_of_[e.op] == kNone) return none;
      return {op_call_of_[e.op], e.iteration};
    };
    const std::unordered_set<int64_t> scratch = freed_in_their_call(p.entries, none, call_of);
    std::map<std::pair<int64_t, int>, size_t> last;  // call instance -> its last remaining entry
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const Entry& e = p.entries[i];
      if (call_of(e) != none && scratch.count(e.ref) == 0) last[call_of(e)] = i;
    }
    std::vector<uint8_t> after(p.entries.size(), 0);
    for (const auto& [call, i] : last) after[i] = 1;
    // 2^51: a chosen ref range of its own, above the conv and device workspaces' (2^50).
    constexpr int64_t kOpWorkspaceRef = int64_t{1} << 51;
    int64_t next = kOpWorkspaceRef, calls = 0, largest = 0, dropped = 0;
    std::vector<Entry> out;
    out.reserve(p.entries.size() + 2 * last.size());
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const Entry& e = p.entries[i];
      if (scratch.count(e.ref) != 0) {
        dropped += e.alloc && e.iteration == 1 ? 1 : 0;
        continue;
      }
      out.push_back(e);
      if (after[i] == 0) continue;
      const int64_t ws = in_.op_workspaces.at(call_of(e).first);
      if (e.iteration == 1) ++calls;
      largest = std::max(largest, ws);
      if (ws <= 0) continue;
      out.push_back(Entry::made(true, next, ws, Category::Temporary, e.phase, e.op, e.iteration));
      out.push_back(Entry::made(false, next, 0, Category::Temporary, e.phase, e.op, e.iteration));
      ++next;
    }
    p.entries = std::move(out);
    // Said where it changed something: a scratch measured, or the probes' left out.
    if (op_scratch_noted_ || calls == 0 || (largest == 0 && dropped == 0)) return;
    op_scratch_noted_ = true;
    out_.notes.push_back(Note{"op-workspace-measured", fmt::format(
        "matrix multiplies: the scratch of {} call(s) per iteration measured at batch {} (up to {} per call) "
        "replaces the probes' ({} allocation(s) per iteration)",
        calls, in_.op_workspace_batch, format_bytes(largest), dropped)});
  }

  // What a CUDA run allocates through the caching allocator that CPU probes cannot show.
  void add_device_allocations(Planned& p, const Stream& s) {
    const int64_t ws = cublas_workspace_bytes(spec_.compute_capability, in_.cublas_workspace_config);
    // 2^50: a chosen ref range of its own, far above any trace position.
    constexpr int64_t kWorkspaceRef = int64_t{1} << 50;
    bool fwd_done = false, bwd_done = false;
    int64_t adam_bytes = 0;
    for (const Entry& e : p.entries) {
      if (e.alloc && e.category == Category::OptimizerState && e.iteration == 1) adam_bytes += e.bytes;
    }
    for (size_t i = 0; i < p.initial.size(); ++i) {
      if (p.initial_category[i] == Category::OptimizerState) adam_bytes += p.initial[i];
    }
    // torch/optim/adam.py:762 (torch 2.14.1, _multi_tensor_adam): torch._foreach_sqrt(device_exp_avg_sqs).
    adam_bytes /= 2;  // exp_avg_sq only: foreach sqrt makes one temporary list of that size
    const int64_t sdpa_changed = adjust_attention(p);
    drop_cpu_kernel_scratch(p);
    replace_conv_scratch(p);
    int last_optimizer_iteration = 0;
    const std::vector<char>& matmul = matmul_ops();
    std::vector<std::pair<size_t, Entry>> adds;  // (the entry each goes before, the entry), in order
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const Entry& e = p.entries[i];
      const bool mm = e.op >= 0 && matmul[static_cast<size_t>(e.op)] != 0;
      // cuBLAS workspaces: one per handle; the autograd engine's device thread has its own handle.
      if (mm && e.phase == Phase::Forward && !fwd_done) {
        adds.emplace_back(i, Entry::made(true, kWorkspaceRef, ws, Category::Other, Phase::Forward, e.op, e.iteration));
        fwd_done = true;
      }
      if (mm && e.phase == Phase::Backward && !bwd_done) {
        adds.emplace_back(i, Entry::made(true, kWorkspaceRef + 1, ws, Category::Other, Phase::Backward, e.op,
                                         e.iteration));
        bwd_done = true;
      }
      if (s.adam && !s.fused_optimizer && e.phase == Phase::Optimizer && e.iteration != last_optimizer_iteration &&
          adam_bytes > 0) {
        last_optimizer_iteration = e.iteration;
        const int64_t ref = kWorkspaceRef + 2 + e.iteration;
        adds.emplace_back(i, Entry::made(true, ref, adam_bytes, Category::Temporary, Phase::Optimizer, e.op,
                                         e.iteration));
        // Held over the step's start only, not across its first entry: in host probes that entry is whatever the
        // CPU's single-tensor path allocates first (a parameter's denominator), which the GPU's foreach path
        // does not allocate beside this temporary.
        adds.emplace_back(i, Entry::made(false, ref, 0, Category::Temporary, Phase::Optimizer, e.op, e.iteration));
      }
    }
    insert_before(p.entries, adds);
    if (notes_added_) return;
    notes_added_ = true;
    out_.notes.push_back(Note{"cublas-workspace", fmt::format("cuBLAS workspace {} per handle (forward thread and autograd thread) added",
                                     format_bytes(ws))});
    if (s.adam && !s.fused_optimizer) {
      out_.notes.push_back(Note{"foreach-adam-temporary", "foreach Adam/AdamW on CUDA: one temporary list of exp_avg_sq's size per step added"});
    }
    if (sdpa_changed > 0) {
      out_.notes.push_back(Note{"sdpa-saved-resized", fmt::format(
          "scaled-dot-product attention: {} saved tensor(s) resized to what CUDA's kernel saves (memory-efficient "
          "attention for float32: logsumexp rows padded to 32; flash for 16-bit: unchanged; the math path's "
          "attention weights replaced by a logsumexp)",
          sdpa_changed)});
    }
    if (out_.conv_calls > 0) {
      out_.conv_workspace_bytes = conv_workspace_;
      if (conv_workspace_ >= 0) {  // else run() notes the headroom the replay found
        out_.notes.push_back(Note{"conv-workspace-modelled", fmt::format(
            "cuDNN: a {} workspace at each of {} convolution call(s) per iteration ({}){}", format_bytes(conv_workspace_),
            out_.conv_calls,
            in_.conv_workspace_bytes >= 0 ? "conv_workspace" : "CUDNN_CONV_WSCAP_DBG's cap: an upper bound",
            conv_scratch_text())});
      }
    }
  }

  bool gpu_probes() const { return in_.target != "cpu" && !host_probes(); }
  // Probes on the host: the CPU, or the meta device (whose blocks are what the same tensors take on the CPU).
  bool host_probes() const { return in_.probe_device == "cpu" || in_.probe_device == "meta"; }

  size_t largest_probe() const {
    size_t ref = 0;
    for (size_t i = 1; i < in_.probe_batch.size(); ++i) {
      if (in_.probe_batch[i] > in_.probe_batch[ref]) ref = i;
    }
    return ref;
  }

  // GPU probes: the reference probe's largest workspace (allocated and freed inside one convolution call), for
  // the note, found once; then the calls as replace_conv_scratch rewrites them.
  void mark_conv_calls(Planned& p) {
    if (probe_conv_workspace_ < 0) {
      const std::vector<int64_t>& call = conv_call_of();
      auto call_of = [&](const Entry& e) { return e.op >= 0 && e.op < static_cast<int64_t>(call.size()) ? call[e.op] : kNone; };
      std::unordered_map<int64_t, std::pair<int64_t, int64_t>> inside;  // ref -> (call, bytes)
      probe_conv_workspace_ = 0;
      for (const Entry& e : model_.shape->entries) {
        if (e.alloc && call_of(e) != kNone) {
          inside[e.ref] = {call_of(e), e.bytes};
        } else if (!e.alloc) {
          auto it = inside.find(e.ref);
          if (it != inside.end() && it->second.first == call_of(e)) {
            probe_conv_workspace_ = std::max(probe_conv_workspace_, it->second.second);
          }
        }
      }
    }
    replace_conv_scratch(p);
  }

  std::string conv_scratch_text() const {
    if (conv_scratch_ == 0) return "";
    return fmt::format("; the CPU kernels' scratch inside convolutions ({} allocation(s) per iteration) left out",
                       conv_scratch_);
  }

  int64_t max_batch(bool gpu) {
    const auto limit = static_cast<int64_t>(static_cast<double>(out_.capacity_bytes) * in_.safety_fraction);
    // What a global batch reserves on a rank, with what the allocator does not count.
    auto need = [&](int64_t global) {
      return replay(planned(per_rank(global), gpu), gpu, in_.allocator).peak_reserved + out_.outside_allocator_bytes;
    };
    const int64_t step = in_.parallel.dp * in_.parallel.micro_batches;
    // 2^30: a chosen ceiling on the global batch searched; 8 * step below (the first bracket) and guess / 64 (the
    // first widening) are chosen to need few replays, not measured.
    constexpr int64_t kMaxGlobal = int64_t{1} << 30;
    if (!out_.scaled) return 0;
    const int64_t need_step = need(step);
    int64_t lo = step, need_lo = need_step;
    if (need_lo > limit) return 0;
    // Reserved bytes grow about linearly with the batch (the allocator's rounding aside): a first bracket from
    // the line through two batches, then interpolation inside it, each step at most half the bracket's width
    // away from its middle (a bisection where the line misleads). Every replay costs the simulation of a whole
    // run, so few of them: about 6 where doubling and bisection took about 30.
    int64_t hi = 0, need_hi = 0;
    {
      const int64_t far = std::min(kMaxGlobal, 8 * step);
      const int64_t need_far = need(far);
      if (need_far > limit) {
        hi = far, need_hi = need_far;
      } else {
        lo = far, need_lo = need_far;
        const double slope = static_cast<double>(need_far - need_step) / static_cast<double>(far - step);
        int64_t guess = slope > 0 ? far + static_cast<int64_t>(static_cast<double>(limit - need_far) / slope) : 2 * far;
        guess = std::clamp(guess / step * step, far + step, kMaxGlobal);
        // Around the guess: a little above it where it fits, below it where it does not, widening each time.
        int64_t delta = std::max(step, guess / 64 / step * step);
        while (hi == 0) {
          if (guess <= lo) guess = lo + step;
          if (guess > kMaxGlobal) return lo;
          const int64_t n = need(guess);
          if (n <= limit) {
            lo = guess, need_lo = n;
            guess = lo + delta;
          } else {
            hi = guess, need_hi = n;
          }
          delta *= 2;
        }
      }
    }
    bool bisect = false;
    while (hi - lo > step) {
      int64_t mid = (lo + hi) / 2 / step * step;
      if (!bisect && need_hi > need_lo) {
        const double w = static_cast<double>(limit - need_lo) / static_cast<double>(need_hi - need_lo);
        mid = (lo + static_cast<int64_t>(w * static_cast<double>(hi - lo))) / step * step;
      }
      mid = std::clamp(mid, lo + step, hi - step);
      const int64_t width = hi - lo;
      const int64_t n = need(mid);
      if (n <= limit) lo = mid, need_lo = n;
      else hi = mid, need_hi = n;
      bisect = !bisect && 2 * (hi - lo) > width;  // the line's step left more than half: halve next
    }
    return lo;
  }

  const MemoryForecastInput& in_;
  MemoryForecast& out_;
  DeviceSpec spec_;
  std::vector<Stream> streams_;
  SteadyPlan steady_;                     // steady_plan()
  bool steady_built_ = false;
  Model model_;
  bool notes_added_ = false;
  int64_t conv_workspace_ = -1;           // cuDNN workspace per convolution call; -1 unknown
  std::vector<int64_t> conv_call_of_;     // per op of the reference trace (conv_call_of())
  std::vector<int64_t> kernel_call_of_;   // per op of the reference trace (kernel_call_of())
  std::unordered_map<uint64_t, double> attention_factors_;  // attention_factors()
  bool attention_factors_found_ = false;
  detail::FsdpLayout fsdp_layout_;        // fsdp_layout()
  bool fsdp_layout_built_ = false;
  int64_t rank_ = 0;                      // the data-parallel rank planned
  enum class Routing { Expected, Bound };
  Routing routing_ = Routing::Bound;      // routed layers' loads planned (plan_routing)
  bool heavy_first_ = true;               // Bound: the most-loaded experts are the first each call ran
  int64_t routing_floor_allocated_ = 0, routing_floor_reserved_ = 0;  // plan_routing's highest peaks
  int64_t fsdp_held_works_ = detail::kGlooThreads;  // apply_fsdp()'s worst ordering of gloo's frees
  std::vector<double> zero1_shares_;      // zero1_shares()
  std::vector<int64_t> zero1_largest_;    // zero1_shares(): each rank's largest parameter
  std::vector<char> matmul_ops_;                           // matmul_ops()
  std::vector<int64_t> op_call_of_;       // per op of the reference trace: its measured call (replace_op_scratch())
  bool op_scratch_noted_ = false;
  std::vector<uint8_t> conv_plan_;        // per entry of the planned stream (replace_conv_scratch())
  int64_t conv_scratch_ = 0;              // CPU scratch allocations left out of the first iteration
  int64_t probe_conv_workspace_ = -1;     // GPU probes: the largest workspace of a call in the reference probe
};

}  // namespace

std::string probe_structure_difference(const Trace& a, const Trace& b, const std::string& device) {
  return structure_difference(extract(a, device, {}), a, extract(b, device, {}), b);
}

MemoryForecast forecast_memory(const MemoryForecastInput& input) {
  const auto t0 = std::chrono::steady_clock::now();
  MemoryForecast out;
  Forecaster(input, out).run();
  // A probe trace that hit its cap (TraceOptions max_ops / max_events) lacks the ops or memory events past it: what
  // it held there is not counted, so the forecast can only be lower than the job's need.
  for (size_t i = 0; i < input.probes.size(); ++i) {
    const TraceCounters& c = input.probes[i]->counters;
    if (c.dropped_ops > 0 || c.dropped_events > 0) {
      out.warnings.push_back(Note{"trace-capped", fmt::format(
          "the probe trace at batch {} reached its cap and dropped {} ops and {} memory events (max_ops, "
          "max_events): the forecast is a lower bound", i < input.probe_batch.size() ? input.probe_batch[i] : 0,
          c.dropped_ops, c.dropped_events)});
    }
  }
  // Rules applied at every batch the largest-batch search simulates say so once: each note and warning once, in
  // the order first given.
  for (std::vector<Note>* lines : {&out.notes, &out.warnings}) {
    std::unordered_set<std::string> seen;
    std::vector<Note> once;
    for (Note& line : *lines) {
      if (seen.insert(line.text).second) once.push_back(std::move(line));
    }
    *lines = std::move(once);
  }
  out.forecast_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

std::string memory_forecast_to_json(const MemoryForecast& f) { return memory_forecast_json(f).dump(); }

nlohmann::json per_rank_json(const std::vector<RankMemory>& groups) {
  nlohmann::json out = nlohmann::json::array();
  for (const RankMemory& m : groups) {
    out.push_back({{"ranks", m.ranks},
                   {"peak_allocated_bytes", m.peak_allocated_bytes},
                   {"peak_reserved_bytes", m.peak_reserved_bytes},
                   {"breakdown", m.breakdown}});
  }
  return out;
}

nlohmann::json memory_forecast_json(const MemoryForecast& f) {
  nlohmann::json j{{"target", f.target},
                   {"batch_size", f.batch_size},
                   {"per_rank_batch", f.per_rank_batch},
                   {"seq_len", f.seq_len},
                   {"peak_allocated_bytes", f.peak_allocated_bytes},
                   {"peak_reserved_bytes", f.peak_reserved_bytes},
                   {"first_iteration_peak_bytes", f.first_iteration_peak_bytes},
                   {"steady_peak_bytes", f.steady_peak_bytes},
                   {"capacity_bytes", f.capacity_bytes},
                   {"outside_allocator_bytes", f.outside_allocator_bytes},
                   {"max_batch_size", f.max_batch_size},
                   {"fragmentation", f.fragmentation},
                   {"breakdown", f.breakdown},
                   {"peak_phase", f.peak_phase},
                   {"peak_op", f.peak_op},
                   {"peak_module", f.peak_module},
                   {"peak_iteration", f.peak_iteration},
                   {"scaled", f.scaled},
                   {"approximate", f.approximate},
                   {"approximate_reason", f.approximate_reason},
                   {"per_rank", per_rank_json(f.per_rank)},
                   {"nonlinear_allocations", f.nonlinear_allocations},
                   {"allocations", f.allocations},
                   {"conv_calls", f.conv_calls},
                   {"conv_calls_measured", f.conv_calls_measured},
                   {"conv_workspace_bytes", f.conv_workspace_bytes},
                   {"conv_workspace_headroom_allocated_bytes", f.conv_workspace_headroom_allocated_bytes},
                   {"conv_workspace_headroom_reserved_bytes", f.conv_workspace_headroom_reserved_bytes},
                   {"warnings", f.warnings},
                   {"notes", f.notes},
                   {"forecast_ms", f.forecast_ms}};
  if (f.moe) {
    const MoeForecast& m = *f.moe;
    j["moe"] = {{"routed_calls", m.routed_calls},
                {"experts", m.experts},
                {"top_k", m.top_k},
                {"skew", m.skew},
                {"routed_allocations", m.routed_allocations},
                {"unexplained_allocations", m.unexplained_allocations},
                {"expected_peak_allocated_bytes", m.expected_peak_allocated_bytes},
                {"expected_peak_reserved_bytes", m.expected_peak_reserved_bytes},
                {"bound_peak_allocated_bytes", m.bound_peak_allocated_bytes},
                {"bound_peak_reserved_bytes", m.bound_peak_reserved_bytes}};
  }
  return j;
}

}  // namespace gpucast
