#include "gpucast/trace_assembly.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

namespace gpucast {
namespace {

// A block is identified by its address on its device.
struct PtrKey {
  uint64_t ptr;
  std::string device;
  bool operator==(const PtrKey& o) const { return ptr == o.ptr && device == o.device; }
};
struct PtrKeyHash {
  size_t operator()(const PtrKey& k) const {
    return std::hash<uint64_t>()(k.ptr) ^ (std::hash<std::string>()(k.device) << 1);
  }
};

}  // namespace

namespace detail {

void link_backward(Trace& trace) {
  // (forward thread, sequence number) -> the forward op that created the node. Every op records the number the
  // next node will take, so the ops that create none (no input needing a gradient: a frozen layer) share it with
  // the next op that creates one: the creator is in the latest outermost op holding the number (its chain of ops
  // nested in one another), and innermost there; later starts win ties.
  std::vector<int64_t> head(trace.ops.size());
  for (size_t i = 0; i < trace.ops.size(); ++i) {  // parents come before the ops inside them
    const int64_t p = trace.ops[i].parent;
    head[i] = p >= 0 && static_cast<size_t>(p) < i && trace.ops[p].scope == Scope::Function ? head[p]
                                                                                           : static_cast<int64_t>(i);
  }
  std::unordered_map<uint64_t, std::unordered_map<int64_t, int64_t>> fwd;
  for (const OpRecord& op : trace.ops) {
    if (op.scope != Scope::Function || op.seq_nr < 0 || op.bwd_node >= 0 || op.phase == Phase::Backward) continue;
    auto& slot = fwd[op.thread];
    auto it = slot.find(op.seq_nr);
    if (it == slot.end() || head[it->second] < head[op.id] ||
        (head[it->second] == head[op.id] && trace.ops[it->second].depth <= op.depth)) {
      slot[op.seq_nr] = op.id;
    }
  }
  for (OpRecord& op : trace.ops) {
    if (op.scope != Scope::BackwardFunction) continue;
    op.fwd_op = -1;
    if (op.seq_nr >= 0) {
      auto t = fwd.find(op.fwd_thread);
      if (t != fwd.end()) {
        auto it = t->second.find(op.seq_nr);
        if (it != t->second.end()) op.fwd_op = it->second;
      }
    }
    if (op.fwd_op >= 0) {
      ++trace.counters.linked_backward;
      op.module = trace.ops[op.fwd_op].module;
    } else {
      ++trace.counters.unlinked_backward;
    }
  }
  // Ops run inside a backward node inherit its link (ops are ordered by start, nodes come first).
  for (OpRecord& op : trace.ops) {
    if (op.scope == Scope::BackwardFunction || op.bwd_node < 0) continue;
    const OpRecord& node = trace.ops[op.bwd_node];
    op.fwd_op = node.fwd_op;
    if (node.fwd_op >= 0) op.module = node.module;
  }
}

void build_allocations(Trace& trace, const std::vector<BaselineBlock>& baseline_blocks) {
  trace.allocations.clear();
  std::unordered_map<PtrKey, int64_t, PtrKeyHash> live;
  for (const BaselineBlock& b : baseline_blocks) {
    Allocation a;
    a.ptr = b.ptr;
    a.bytes = b.bytes;
    a.block_bytes = b.block_bytes;
    a.device = b.device;
    a.baseline = true;
    trace.allocations.push_back(std::move(a));
  }
  for (size_t i = 0; i < trace.allocations.size(); ++i) {
    live[PtrKey{trace.allocations[i].ptr, trace.allocations[i].device}] = static_cast<int64_t>(i);
  }
  for (size_t e = 0; e < trace.events.size(); ++e) {
    MemEvent& ev = trace.events[e];
    if (ev.bytes > 0) {
      Allocation a;
      a.ptr = ev.ptr;
      a.bytes = ev.bytes;
      a.block_bytes = ev.block_bytes;
      a.device = ev.device;
      a.alloc_event = static_cast<int64_t>(e);
      a.alloc_op = ev.op;
      ev.allocation = static_cast<int64_t>(trace.allocations.size());
      trace.allocations.push_back(std::move(a));
      live[PtrKey{ev.ptr, ev.device}] = ev.allocation;
    } else {
      auto it = live.find(PtrKey{ev.ptr, ev.device});
      if (it == live.end()) {
        ++trace.counters.unmatched_frees;
        continue;
      }
      Allocation& a = trace.allocations[it->second];
      a.free_event = static_cast<int64_t>(e);
      a.free_op = ev.op;
      ev.allocation = it->second;
      live.erase(it);
    }
  }
}

void assign_categories(Trace& trace, const std::vector<Tag>& tags, bool optimizer_state_from_phase) {
  constexpr uint64_t kOpen = ~uint64_t{0};
  // Per (ptr, device), the allocations in order of their start, to find the one live at a tag's time.
  std::unordered_map<PtrKey, std::vector<int64_t>, PtrKeyHash> by_ptr;
  for (size_t i = 0; i < trace.allocations.size(); ++i) {
    by_ptr[PtrKey{trace.allocations[i].ptr, trace.allocations[i].device}].push_back(static_cast<int64_t>(i));
  }
  auto alloc_seq = [&](const Allocation& a) -> uint64_t {
    return a.alloc_event < 0 ? 0 : trace.events[a.alloc_event].seq;
  };
  auto free_seq = [&](const Allocation& a) -> uint64_t {
    return a.free_event < 0 ? kOpen : trace.events[a.free_event].seq;
  };
  std::vector<int> tagged(trace.allocations.size(), kNumCategories);
  for (const Tag& tag : tags) {
    auto it = by_ptr.find(PtrKey{tag.ptr, tag.device});
    if (it == by_ptr.end()) continue;
    for (int64_t idx : it->second) {
      const Allocation& a = trace.allocations[idx];
      if (alloc_seq(a) <= tag.seq && tag.seq < free_seq(a)) {
        tagged[idx] = std::min(tagged[idx], static_cast<int>(tag.category));
        break;
      }
    }
  }
  for (size_t i = 0; i < trace.allocations.size(); ++i) {
    Allocation& a = trace.allocations[i];
    if (tagged[i] < kNumCategories) {
      a.category = static_cast<Category>(tagged[i]);
      continue;
    }
    a.category = Category::Other;
    if (a.alloc_event < 0) continue;
    const MemEvent& alloc = trace.events[a.alloc_event];
    if (optimizer_state_from_phase && alloc.phase == Phase::Optimizer && a.free_event < 0) {
      // What an optimizer step allocated and still holds when the window ends: its state (exp_avg, momentum, the
      // step counters), as torch.optim's state dict would list it.
      a.category = Category::OptimizerState;
      continue;
    }
    if (a.free_event >= 0) {
      const MemEvent& fr = trace.events[a.free_event];
      if (a.alloc_op >= 0) {
        // Freed on the same thread before the op that allocated it ended: scratch space of that op.
        const OpRecord& op = trace.ops[a.alloc_op];
        if (fr.thread == alloc.thread && fr.seq > op.start_seq && (!op.complete || fr.seq < op.end_seq)) {
          a.category = Category::Temporary;
          continue;
        }
      }
      if (alloc.phase == Phase::Forward && fr.phase == Phase::Backward) {
        a.category = Category::Activation;
        continue;
      }
    }
  }
}

namespace {

bool touches_meta(const OpRecord& op) {
  for (const std::vector<Value>* values : {&op.inputs, &op.outputs}) {
    for (const Value& v : *values) {
      for (const TensorMeta& t : v.tensors) {
        if (t.device == "meta") return true;
      }
    }
  }
  return false;
}

// root[i]: the outermost folded op op i is in (itself included), -1 outside any.
std::vector<int64_t> fold_roots(const RawThread& t, const std::function<bool(const OpRecord&)>& in_python) {
  const int64_t n = static_cast<int64_t>(t.ops.size());
  std::vector<char> meta_inside(t.ops.size(), 0);
  for (const MemEvent& e : t.events) {
    if (e.device != "meta") continue;
    // Up the chain of enclosing ops; each step goes to an earlier op, so the walk ends.
    for (int64_t o = e.op; o >= 0 && o < n && !meta_inside[o]; o = t.ops[o].parent < o ? t.ops[o].parent : -1) {
      meta_inside[o] = 1;
    }
  }
  std::vector<int64_t> root(t.ops.size(), -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = t.ops[i].parent;
    if (p >= 0 && p < i && root[p] >= 0) {
      root[i] = root[p];
    } else if ((meta_inside[i] || touches_meta(t.ops[i])) && in_python(t.ops[i])) {
      root[i] = i;
    }
  }
  return root;
}

// Marks the events of blocks allocated and freed inside one folded op (root) on this thread.
std::vector<char> fold_temporaries(const RawThread& t, const std::vector<int64_t>& root) {
  auto root_of = [&](int64_t op) { return op >= 0 && op < static_cast<int64_t>(root.size()) ? root[op] : -1; };
  std::vector<char> drop(t.events.size(), 0);
  std::unordered_map<PtrKey, size_t, PtrKeyHash> open;  // block -> its allocation event, made inside a folded op
  for (size_t i = 0; i < t.events.size(); ++i) {
    const MemEvent& e = t.events[i];
    const PtrKey key{e.ptr, e.device};
    const int64_t r = root_of(e.op);
    if (e.bytes > 0) {
      if (r >= 0) open[key] = i;
      else open.erase(key);
      continue;
    }
    auto it = open.find(key);
    if (it == open.end()) continue;
    if (r >= 0 && root_of(t.events[it->second].op) == r) drop[it->second] = drop[i] = 1;
    open.erase(it);
  }
  return drop;
}

// The blocks each folded op allocated and kept, in the order of its outputs (their storages), then the rest in
// the order they came: a CPU or GPU kernel allocates its outputs first, in order (a structured kernel's meta
// function sets output 0, then 1...; native_layer_norm's CPU kernel allocates the result, then mean, then rstd),
// where a Python meta kernel may allocate them in any order (its decomposition computes mean and rstd first). Each
// event slot keeps its place in the order of events (seq, time); the blocks move between the slots.
void order_as_outputs(std::vector<MemEvent>& events, const std::vector<OpRecord>& ops,
                      const std::vector<char>& folded) {
  std::unordered_map<int64_t, std::vector<size_t>> slots;  // folded op -> its allocation events
  for (size_t i = 0; i < events.size(); ++i) {
    const int64_t op = events[i].op;
    if (events[i].bytes > 0 && op >= 0 && folded[static_cast<size_t>(op)]) slots[op].push_back(i);
  }
  for (auto& [op, at] : slots) {
    if (at.size() < 2) continue;
    std::unordered_map<uint64_t, size_t> rank;  // storage -> position among the outputs
    for (const Value& v : ops[static_cast<size_t>(op)].outputs) {
      for (const TensorMeta& t : v.tensors) {
        if (t.storage != 0) rank.emplace(t.storage, rank.size());
      }
    }
    std::vector<MemEvent> moved;
    moved.reserve(at.size());
    for (size_t i : at) moved.push_back(events[i]);
    std::stable_sort(moved.begin(), moved.end(), [&](const MemEvent& a, const MemEvent& b) {
      auto ra = rank.find(a.ptr), rb = rank.find(b.ptr);
      return (ra == rank.end() ? rank.size() : ra->second) < (rb == rank.end() ? rank.size() : rb->second);
    });
    for (size_t k = 0; k < at.size(); ++k) {
      MemEvent& slot = events[at[k]];
      const uint64_t seq = slot.seq;
      const int64_t time = slot.time_ns;
      slot = std::move(moved[k]);
      slot.seq = seq;
      slot.time_ns = time;
    }
  }
}

}  // namespace

MetaFold fold_meta_kernels(RawThread& t, const std::function<bool(const OpRecord&)>& in_python) {
  MetaFold out;
  if (!in_python || t.ops.empty()) return out;
  const std::vector<int64_t> root = fold_roots(t, in_python);
  const std::vector<char> drop = fold_temporaries(t, root);
  // New index of each kept op (outside any folded op, or a folded op itself).
  std::vector<int64_t> index(t.ops.size(), -1);
  std::vector<OpRecord> kept;
  kept.reserve(t.ops.size());
  for (size_t i = 0; i < t.ops.size(); ++i) {
    if (root[i] >= 0 && root[i] != static_cast<int64_t>(i)) {
      ++out.ops;
      continue;
    }
    if (root[i] >= 0) ++out.kernels;
    index[i] = static_cast<int64_t>(kept.size());
    kept.push_back(std::move(t.ops[i]));
  }
  auto remap = [&](int64_t op) {
    if (op < 0 || op >= static_cast<int64_t>(index.size())) return int64_t{-1};
    return index[root[op] >= 0 ? root[op] : op];
  };
  for (OpRecord& op : kept) {
    op.parent = remap(op.parent);
    op.bwd_node = remap(op.bwd_node);
  }
  std::vector<MemEvent> events;
  events.reserve(t.events.size());
  for (size_t i = 0; i < t.events.size(); ++i) {
    if (drop[i]) continue;
    MemEvent e = std::move(t.events[i]);
    e.op = remap(e.op);
    events.push_back(std::move(e));
  }
  out.temporaries = static_cast<int64_t>(t.events.size() - events.size()) / 2;
  std::vector<char> folded(kept.size(), 0);
  for (size_t i = 0; i < root.size(); ++i) {
    if (root[i] == static_cast<int64_t>(i)) folded[static_cast<size_t>(index[i])] = 1;
  }
  order_as_outputs(events, kept, folded);
  t.ops = std::move(kept);
  t.events = std::move(events);
  return out;
}

}  // namespace detail

Trace assemble_trace(AssemblyInput input) {
  Trace trace;
  trace.context = std::move(input.context);
  trace.start_ns = input.start_ns;
  trace.end_ns = input.end_ns;
  trace.baseline = std::move(input.baseline);
  trace.counters = input.counters;
  trace.notes = std::move(input.notes);
  trace.timing_source = std::move(input.timing_source);
  trace.timed_layers = std::move(input.timed_layers);
  trace.counters.threads = 0;

  detail::MetaFold folded;
  for (RawThread& t : input.threads) {
    const detail::MetaFold f = detail::fold_meta_kernels(t, input.meta_kernel_in_python);
    folded.kernels += f.kernels;
    folded.ops += f.ops;
    folded.temporaries += f.temporaries;
  }
  if (folded.kernels > 0) {
    trace.notes.push_back(Note{"meta-kernels-folded",
                               std::to_string(folded.kernels) + " meta ops run by PyTorch's Python meta kernels are "
                               "recorded as the CPU and GPU run them, one kernel each: " +
                               std::to_string(folded.ops) + " ops inside them and " +
                               std::to_string(folded.temporaries) + " temporaries of theirs left out"});
  }

  // Global op order: by start sequence.
  struct Ref { size_t thread; size_t local; uint64_t seq; };
  std::vector<Ref> refs;
  for (size_t t = 0; t < input.threads.size(); ++t) {
    if (!input.threads[t].ops.empty() || !input.threads[t].events.empty()) ++trace.counters.threads;
    for (size_t i = 0; i < input.threads[t].ops.size(); ++i) {
      refs.push_back({t, i, input.threads[t].ops[i].start_seq});
    }
  }
  std::sort(refs.begin(), refs.end(), [](const Ref& a, const Ref& b) { return a.seq < b.seq; });
  std::vector<std::vector<int64_t>> global(input.threads.size());
  for (size_t t = 0; t < input.threads.size(); ++t) global[t].assign(input.threads[t].ops.size(), -1);
  for (size_t g = 0; g < refs.size(); ++g) global[refs[g].thread][refs[g].local] = static_cast<int64_t>(g);

  auto remap = [&](size_t t, int64_t local) -> int64_t {
    return local < 0 || static_cast<size_t>(local) >= global[t].size() ? -1 : global[t][local];
  };
  trace.ops.reserve(refs.size());
  for (const Ref& r : refs) {
    OpRecord op = std::move(input.threads[r.thread].ops[r.local]);
    op.id = static_cast<int64_t>(trace.ops.size());
    op.thread = input.threads[r.thread].thread;
    op.parent = remap(r.thread, op.parent);
    op.bwd_node = remap(r.thread, op.bwd_node);
    trace.ops.push_back(std::move(op));
  }

  std::vector<Tag> tags;
  for (size_t t = 0; t < input.threads.size(); ++t) {
    for (MemEvent& ev : input.threads[t].events) {
      ev.op = remap(t, ev.op);
      ev.thread = input.threads[t].thread;
      trace.events.push_back(std::move(ev));
    }
    for (Tag& tag : input.threads[t].tags) tags.push_back(std::move(tag));
  }
  std::sort(trace.events.begin(), trace.events.end(),
            [](const MemEvent& a, const MemEvent& b) { return a.seq < b.seq; });

  detail::link_backward(trace);
  detail::build_allocations(trace, input.baseline_blocks);
  detail::assign_categories(trace, tags, input.optimizer_state_from_phase);
  return trace;
}

}  // namespace gpucast
