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
