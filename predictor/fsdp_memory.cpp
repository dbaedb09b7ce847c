// FSDP2's memory on one rank (fsdp_memory.h says what it holds and where PyTorch does it).
#include "fsdp_memory.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

namespace gpucast::detail {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where, in one iteration, each unit's work lies: entry indices (-1: none).
struct Span {
  int64_t first = -1, last = -1;
  void add(int64_t i) {
    if (first < 0) first = i;
    last = i;
  }
};

struct IterationSpans {
  std::vector<Span> forward, backward;  // per unit
  Span model_forward, model_backward;   // any unit's entries
  int64_t backward_end = -1;            // the last entry in backward
};

enum class Kind : uint8_t { PostBackward, PostForward, ForwardEnd, BackwardEnd, RootPre, Pre };

struct Action {
  size_t pos;  // before this entry
  Kind kind;
  int32_t unit;
  int32_t iteration;
  Phase phase;
};

class Rewrite {
 public:
  Rewrite(Planned& p, const FsdpLayout& l, int64_t rank, int64_t held_works)
      : p_(p), l_(l), rank_(rank), held_works_(held_works) {
    const auto units = static_cast<size_t>(l.units);
    params_of_.resize(units);
    padded_.assign(units, 0);
    for (size_t q = 0; q < l.params.size(); ++q) {
      const FsdpParam& fp = l.params[q];
      if (fp.unit < 0 || fp.unit >= l.units) continue;
      params_of_[static_cast<size_t>(fp.unit)].push_back(q);
      padded_[static_cast<size_t>(fp.unit)] += padded_unsharded(fp);
    }
    state_.assign(units, State{});
    grads_.resize(units);
    pre_backward_at_.assign(units, 0);
    first_grad_bytes_.assign(units, 0);
  }

  void run() {
    shard_initial();
    std::vector<Action> actions = schedule();
    std::vector<std::pair<size_t, Entry>> adds;
    size_t next = 0;
    const size_t n = p_.entries.size();
    for (size_t i = 0; i <= n; ++i) {
      while (next < actions.size() && actions[next].pos == i) act(actions[next++], i, adds);
      if (i == n) break;
      visit(p_.entries[i], i, adds);
    }
    // A block made earlier than its post-backward saw (gradients the probes accumulated into) is listed late.
    std::stable_sort(adds.begin(), adds.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    insert_before(p_.entries, adds);
  }

 private:
  struct State {
    bool unsharded = false;
    std::vector<int64_t> uns;         // per parameter of the unit: its unsharded block
    std::vector<int64_t> post_fwd;    // reshard_after_forward n: the kept 1/n clones
    int64_t pending = kNone;          // a prefetched all-gather output, not yet copied out
    int64_t sharded_grads = kNone;    // the reduce-scatter output the sharded gradients view
  };

  int64_t padded_unsharded(const FsdpParam& q) const {
    const int64_t rows = std::max<int64_t>(1, q.rows);
    return ceil_div(rows, l_.dp) * l_.dp * ceil_div(q.bytes, rows);
  }

  // Bytes of a block the optimizer makes for parameter `q`'s chunk on this rank.
  int64_t state_bytes(int64_t bytes, int32_t q) const {
    if (q == kScalarState) return bytes;
    if (q < 0 || q >= static_cast<int32_t>(l_.params.size())) return ceil_div(bytes, l_.dp);
    const int64_t rows = std::max<int64_t>(1, l_.params[static_cast<size_t>(q)].rows);
    return fsdp_local_rows(rows, l_.dp, rank_) * ceil_div(bytes, rows);
  }

  bool float_made(const Entry& e) const {
    return l_.param_scale != 1.0 && e.op >= 0 && e.op < static_cast<int32_t>(l_.float_op.size()) &&
           l_.float_op[static_cast<size_t>(e.op)] != 0;
  }

  int32_t unit_of(const Entry& e) const {
    if (e.op < 0 || e.op >= static_cast<int32_t>(l_.op_unit.size())) return kOutsideUnits;
    return l_.op_unit[static_cast<size_t>(e.op)];
  }

  void shard_initial() {
    for (size_t i = 0; i < p_.initial.size(); ++i) {
      switch (p_.initial_category[i]) {
        case Category::Parameter: p_.initial[i] = 0; break;
        case Category::OptimizerState:
        case Category::Gradient: p_.initial[i] = ceil_div(p_.initial[i], l_.dp); break;
        default: break;
      }
    }
    // On a CPU target, the device mesh's rank map lives in the same allocator: an int32 per rank
    // (torch 2.14.1 torch/distributed/device_mesh.py:1628, init_device_mesh: torch.arange(numel, dtype=torch.int)).
    if (l_.gloo) {
      p_.initial.push_back(4 * l_.dp);
      p_.initial_category.push_back(Category::Other);
    }
    // Every rank's shard storage is padded to the first chunk's size.
    for (size_t u = 0; u < params_of_.size(); ++u) {
      if (padded_[u] == 0) continue;
      p_.initial.push_back(padded_[u] / l_.dp);
      p_.initial_category.push_back(Category::Parameter);
    }
  }

  std::vector<Action> schedule() {
    std::map<int32_t, IterationSpans> spans;
    for (size_t i = 0; i < p_.entries.size(); ++i) {
      const Entry& e = p_.entries[i];
      IterationSpans& s = spans[e.iteration];
      if (s.forward.empty()) s.forward.resize(params_of_.size()), s.backward.resize(params_of_.size());
      if (e.phase == Phase::Backward) s.backward_end = static_cast<int64_t>(i);
      const int32_t u = unit_of(e);
      if (u < 0 || u >= l_.units) continue;
      if (e.phase == Phase::Forward) s.forward[static_cast<size_t>(u)].add(static_cast<int64_t>(i)), s.model_forward.add(static_cast<int64_t>(i));
      if (e.phase == Phase::Backward) s.backward[static_cast<size_t>(u)].add(static_cast<int64_t>(i)), s.model_backward.add(static_cast<int64_t>(i));
    }
    std::vector<Action> a;
    for (const auto& [k, s] : spans) {
      if (s.model_forward.first < 0) continue;
      auto pos = [](int64_t i) { return static_cast<size_t>(i); };
      a.push_back({pos(s.model_forward.first), Kind::RootPre, l_.root, k, Phase::Forward});
      a.push_back({pos(s.model_forward.last + 1), Kind::ForwardEnd, kOutsideUnits, k, Phase::Forward});
      for (int32_t u = 0; u < l_.units; ++u) {
        const Span& f = s.forward[static_cast<size_t>(u)];
        if (u == l_.root || f.first < 0) continue;
        a.push_back({pos(f.first), Kind::Pre, u, k, Phase::Forward});
        a.push_back({pos(f.last + 1), Kind::PostForward, u, k, Phase::Forward});
      }
      if (s.model_backward.first < 0) continue;
      a.push_back({pos(s.model_backward.first), Kind::RootPre, l_.root, k, Phase::Backward});
      for (int32_t u = 0; u < l_.units; ++u) {
        const Span& b = s.backward[static_cast<size_t>(u)];
        if (u == l_.root || b.first < 0) continue;
        a.push_back({pos(b.first), Kind::Pre, u, k, Phase::Backward});
        // A unit whose inputs need no gradient (the first to run takes the model's inputs) has no post-backward
        // hook: the root's final callback runs it.
        if (s.forward[static_cast<size_t>(u)].first != s.model_forward.first) {
          a.push_back({pos(b.last + 1), Kind::PostBackward, u, k, Phase::Backward});
        }
      }
      a.push_back({pos(s.backward_end + 1), Kind::BackwardEnd, kOutsideUnits, k, Phase::Backward});
      // Post-forward order, for the backward prefetch.
      std::vector<std::pair<int64_t, int32_t>> order;
      for (int32_t u = 0; u < l_.units; ++u) {
        const Span& f = s.forward[static_cast<size_t>(u)];
        if (u != l_.root && f.first >= 0) order.emplace_back(f.last, u);
      }
      std::sort(order.begin(), order.end());
      auto& po = post_forward_order_[k];
      for (const auto& [last, u] : order) po.push_back(u);
      if (has_params(l_.root)) po.push_back(l_.root);  // a root without parameters has no group, no hooks
      std::vector<int32_t>& first = first_units_[k];
      for (int32_t u = 0; u < l_.units; ++u) {
        if (u != l_.root && s.forward[static_cast<size_t>(u)].first == s.model_forward.first) first.push_back(u);
      }
    }
    std::stable_sort(a.begin(), a.end(), [](const Action& x, const Action& y) {
      return x.pos != y.pos ? x.pos < y.pos : static_cast<int>(x.kind) < static_cast<int>(y.kind);
    });
    return a;
  }

  Entry block(bool alloc, int64_t ref, int64_t bytes, Category c, const Action& a) const {
    return Entry::made(alloc, ref, bytes, c, a.phase, kNone, a.iteration);
  }

  int64_t alloc(std::vector<std::pair<size_t, Entry>>& adds, size_t at, int64_t bytes, Category c, const Action& a) {
    const int64_t ref = next_ref_++;
    adds.emplace_back(at, block(true, ref, bytes, c, a));
    return ref;
  }

  void release(std::vector<std::pair<size_t, Entry>>& adds, size_t at, int64_t ref, const Action& a) {
    if (ref != kNone) adds.emplace_back(at, block(false, ref, 0, Category::Other, a));
  }

  // gloo's worker threads hold a collective's tensors (an all-gather's output, a reduce-scatter's clone) until the
  // one that ran it lets go of the work, which it does after the collective with no order to FSDP's own release of
  // them (ProcessGroupGloo's runLoop resets its work in progress when it runs again). The worst ordering the forecast
  // takes: such a tensor, once FSDP drops it, is freed when the held_works-th collective after its own is issued.
  void drop(std::vector<std::pair<size_t, Entry>>& adds, size_t at, int64_t ref, const Action& a) {
    if (ref == kNone) return;
    for (auto& [held, dropped] : in_work_) {  // only gloo's collectives are issue()d
      if (held == ref) {
        dropped = true;
        return;
      }
    }
    release(adds, at, ref, a);
  }

  void issue(std::vector<std::pair<size_t, Entry>>& adds, size_t at, const Action& a, int64_t held) {
    in_work_.emplace_back(held, false);
    if (static_cast<int64_t>(in_work_.size()) <= held_works_) return;
    if (in_work_.front().second) release(adds, at, in_work_.front().first, a);
    in_work_.erase(in_work_.begin());
  }

  bool has_params(int32_t u) const { return u >= 0 && padded_[static_cast<size_t>(u)] > 0; }

  int64_t in_param(int64_t bytes) const { return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) * l_.param_scale)); }
  int64_t in_reduce(int64_t bytes) const { return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) * l_.reduce_scale)); }

  // foreach_all_gather: the flat output of the unit's padded size (its input is a view of it).
  int64_t gather(int32_t u, size_t at, const Action& a, std::vector<std::pair<size_t, Entry>>& adds) {
    // One rank: no collective, the copy-out reads the shards (FSDPParamGroup.wait_for_unshard's world_size 1 path).
    const int64_t bytes = l_.dp > 1 ? in_param(padded_[static_cast<size_t>(u)]) : 0;
    // Mixed precision: the shards cast into one flat input first (_get_param_all_gather_inputs), freed when the
    // all-gather has been issued.
    const int64_t cast = l_.param_scale != 1.0 && l_.dp > 1 ? alloc(adds, at, bytes / l_.dp, Category::Other, a) : kNone;
    const int64_t out = alloc(adds, at, bytes, Category::Parameter, a);
    if (l_.gloo && l_.dp > 1) {
      release(adds, at, alloc(adds, at, bytes, Category::Other, a), a);  // gloo's staging copy
      issue(adds, at, a, out);
    }
    release(adds, at, cast, a);
    return out;
  }

  // wait_for_unshard's copy-out: one padded block per parameter; a 1/n shard kept after forward goes after it.
  void copy_out(int32_t u, size_t at, const Action& a, std::vector<std::pair<size_t, Entry>>& adds) {
    State& st = state_[static_cast<size_t>(u)];
    for (size_t q : params_of_[static_cast<size_t>(u)]) {
      st.uns.push_back(alloc(adds, at, in_param(padded_unsharded(l_.params[q])), Category::Parameter, a));
    }
    for (int64_t r : st.post_fwd) release(adds, at, r, a);
    st.post_fwd.clear();
    st.unsharded = true;
  }

  void unshard(int32_t u, size_t at, const Action& a, std::vector<std::pair<size_t, Entry>>& adds) {
    State& st = state_[static_cast<size_t>(u)];
    if (st.unsharded) return;
    const int64_t out = st.pending != kNone ? st.pending : gather(u, at, a, adds);
    st.pending = kNone;
    if (a.phase == Phase::Forward) {
      drop(adds, at, held_gather_, a);  // the previous unit's output, kept for overlap until now
      copy_out(u, at, a, adds);
      held_gather_ = out;
    } else {
      copy_out(u, at, a, adds);
      drop(adds, at, out, a);
    }
  }

  void reshard(int32_t u, size_t at, const Action& a, std::vector<std::pair<size_t, Entry>>& adds, int64_t keep) {
    State& st = state_[static_cast<size_t>(u)];
    if (!st.unsharded) return;
    const std::vector<size_t>& qs = params_of_[static_cast<size_t>(u)];
    for (size_t j = 0; j < st.uns.size(); ++j) {
      // to_sharded_post_forward: the clone of this rank's 1/keep of the unsharded block, then the block freed.
      if (keep >= 2) st.post_fwd.push_back(alloc(adds, at, in_param(padded_unsharded(l_.params[qs[j]])) / keep, Category::Parameter, a));
      release(adds, at, st.uns[j], a);
    }
    st.uns.clear();
    st.unsharded = false;
  }

  void post_backward(int32_t u, size_t at, const Action& a, std::vector<std::pair<size_t, Entry>>& adds) {
    State& st = state_[static_cast<size_t>(u)];
    reshard(u, at, a, adds, 0);
    if (!has_params(u)) return;
    std::vector<int64_t>& grads = grads_[static_cast<size_t>(u)];
    const int64_t missing = first_grad_bytes_[static_cast<size_t>(u)];
    if (grads.empty() && a.iteration > 1 && missing > 0) {
      // The probes accumulated into gradients they kept (no zero_grad); FSDP2's autograd makes the unsharded ones
      // anew every backward, from the unit's pre-backward on.
      grads.push_back(alloc(adds, pre_backward_at_[static_cast<size_t>(u)], missing, Category::Gradient, a));
    }
    release(adds, at, held_scatter_input_, a);
    held_scatter_input_ = alloc(adds, at, in_reduce(padded_[static_cast<size_t>(u)]), Category::Gradient, a);
    // foreach_reduce's loop over the gradients leaves its variable on the last one (the unit's last parameter's),
    // which lives until the reduce-scatter is done; the others go after the copy-in.
    int64_t last = kNone;
    const std::vector<size_t>& qs = params_of_[static_cast<size_t>(u)];
    for (int64_t g : grads) {
      live_grads_.erase(g);
      freed_grads_[g] = u;
      if (last == kNone && l_.dp > 1 && !qs.empty() && grad_bytes_[g] == in_param(l_.params[qs.back()].bytes)) {
        last = g;
        continue;
      }
      release(adds, at, g, a);
    }
    grads.clear();
    int64_t out = alloc(adds, at, in_reduce(padded_[static_cast<size_t>(u)]) / l_.dp, Category::Gradient, a);
    if (l_.gloo && l_.dp > 1) {
      // gloo reduce-scatters a clone of the input (an all-reduce of it), dividing by a scalar (8 bytes, then a
      // 4-byte float copy of it) for the average.
      const int64_t clone = alloc(adds, at, in_reduce(padded_[static_cast<size_t>(u)]), Category::Other, a);
      issue(adds, at, a, clone);
      const int64_t scalar = alloc(adds, at, 8, Category::Other, a);
      release(adds, at, alloc(adds, at, 4, Category::Other, a), a);
      release(adds, at, scalar, a);
      drop(adds, at, clone, a);
    }
    release(adds, at, last, a);
    if (l_.reduce_scale != 1.0) {
      // Reduced in another dtype than the parameters': cast back into a new block (_to_dtype_if_needed).
      const int64_t own = alloc(adds, at, padded_[static_cast<size_t>(u)] / l_.dp, Category::Gradient, a);
      release(adds, at, out, a);
      out = own;
    }
    if (st.sharded_grads != kNone) {
      release(adds, at, out, a);  // accumulated into the kept sharded gradients
    } else {
      st.sharded_grads = out;
    }
  }

  void act(const Action& a, size_t at, std::vector<std::pair<size_t, Entry>>& adds) {
    switch (a.kind) {
      case Kind::RootPre:
        if (a.phase == Phase::Forward) {
          if (has_params(a.unit)) unshard(a.unit, at, a, adds);
        } else if (has_params(a.unit)) {
          unshard(a.unit, at, a, adds);  // resharded after forward when asked to be
          prefetch_before(a.unit, a, at, adds);
        }
        break;
      case Kind::Pre:
        if (!has_params(a.unit)) break;
        unshard(a.unit, at, a, adds);
        if (a.phase == Phase::Backward) {
          pre_backward_at_[static_cast<size_t>(a.unit)] = at;
          prefetch_before(a.unit, a, at, adds);
        }
        break;
      case Kind::PostForward: {
        const int64_t r = l_.reshard_after_forward;
        if (r == 1) reshard(a.unit, at, a, adds, 0);
        else if (r >= 2) reshard(a.unit, at, a, adds, r);
        break;
      }
      case Kind::ForwardEnd: {
        // The root's post-forward: its own reshard, then the last output dropped (_fsdp_state.py _post_forward).
        const int64_t r = l_.root_reshard_after_forward;
        if (l_.root >= 0 && has_params(l_.root) && r != 0) reshard(l_.root, at, a, adds, r == 1 ? 0 : r);
        drop(adds, at, held_gather_, a);
        held_gather_ = kNone;
        break;
      }
      case Kind::PostBackward: post_backward(a.unit, at, a, adds); break;
      case Kind::BackwardEnd:
        if (l_.root >= 0) post_backward(l_.root, at, a, adds);
        for (int32_t u : first_units_[a.iteration]) post_backward(u, at, a, adds);
        release(adds, at, held_scatter_input_, a);
        held_scatter_input_ = kNone;
        break;
    }
  }

  // _backward_prefetch: the unit before `u` in post-forward order, gathered now and copied out at its pre-backward.
  void prefetch_before(int32_t u, const Action& a, size_t at, std::vector<std::pair<size_t, Entry>>& adds) {
    const std::vector<int32_t>& po = post_forward_order_[a.iteration];
    const auto it = std::find(po.begin(), po.end(), u);
    if (it == po.end() || it == po.begin()) return;
    const int32_t t = *(it - 1);
    State& st = state_[static_cast<size_t>(t)];
    if (!has_params(t) || st.unsharded || st.pending != kNone) return;
    st.pending = gather(t, at, a, adds);
  }

  void visit(Entry& e, size_t at, std::vector<std::pair<size_t, Entry>>& adds) {
    if (e.alloc) {
      if (e.phase == Phase::Optimizer && e.op >= 0) {
        const int32_t q = e.op < static_cast<int32_t>(l_.state_param.size()) ? l_.state_param[static_cast<size_t>(e.op)]
                                                                             : kUnknownParam;
        e.bytes = state_bytes(e.bytes, q);
      } else if (e.category == Category::Gradient && e.phase == Phase::Backward) {
        if (float_made(e)) e.bytes = in_param(e.bytes);
        const int32_t u = unit_of(e);
        if (u >= 0 && u < l_.units && has_params(u)) {
          grads_[static_cast<size_t>(u)].push_back(e.ref);
          live_grads_[e.ref] = u;
          grad_bytes_[e.ref] = e.bytes;
          if (e.iteration == 1) first_grad_bytes_[static_cast<size_t>(u)] += e.bytes;
        }
      } else if (e.phase != Phase::Optimizer && e.category != Category::Parameter && e.category != Category::Input &&
                 e.category != Category::OptimizerState && float_made(e)) {
        e.bytes = in_param(e.bytes);  // computed in param_dtype
      }
      return;
    }
    if (const auto live = live_grads_.find(e.ref); live != live_grads_.end()) {
      std::vector<int64_t>& g = grads_[static_cast<size_t>(live->second)];
      g.erase(std::find(g.begin(), g.end(), e.ref));
      live_grads_.erase(live);
      return;
    }
    // A gradient the rewrite freed at its post-backward, freed now by the step (zero_grad): the sharded gradients
    // of its unit go instead.
    const auto f = freed_grads_.find(e.ref);
    if (f == freed_grads_.end()) return;
    const int32_t unit = f->second;
    freed_grads_.erase(f);
    State& st = state_[static_cast<size_t>(unit)];
    if (st.sharded_grads == kNone) return;
    const Action a{at + 1, Kind::PostBackward, unit, e.iteration, e.phase};
    release(adds, at + 1, st.sharded_grads, a);
    st.sharded_grads = kNone;
  }

  Planned& p_;
  const FsdpLayout& l_;
  const int64_t rank_;
  const int64_t held_works_;
  std::vector<std::vector<size_t>> params_of_;  // per unit: its parameters
  std::vector<int64_t> padded_;                 // per unit: its parameters' padded unsharded bytes
  std::vector<State> state_;
  std::vector<std::vector<int64_t>> grads_;     // per unit: autograd's unsharded gradients alive
  std::vector<int64_t> first_grad_bytes_;       // per unit: the bytes of iteration 1's gradients
  std::unordered_map<int64_t, int32_t> freed_grads_;  // gradient ref -> unit, freed by the rewrite
  std::unordered_map<int64_t, int32_t> live_grads_;   // gradient ref -> unit, for grads_
  std::unordered_map<int64_t, int64_t> grad_bytes_;   // gradient ref -> its bytes
  std::vector<size_t> pre_backward_at_;         // per unit: where its latest pre-backward ran
  std::map<int32_t, std::vector<int32_t>> post_forward_order_, first_units_;  // per iteration
  int64_t held_gather_ = kNone;          // forward: the last all-gather output, kept until the next copy-out
  int64_t held_scatter_input_ = kNone;   // backward: the last reduce-scatter input
  // gloo: the tensors the latest collectives' works hold (drop()), oldest first, and whether FSDP let go of them.
  std::vector<std::pair<int64_t, bool>> in_work_;
  int64_t next_ref_ = kFsdpRef;
};

}  // namespace

int64_t fsdp_local_rows(int64_t rows, int64_t dp, int64_t rank) {
  const int64_t c = ceil_div(std::max<int64_t>(1, rows), dp);
  return std::clamp<int64_t>(std::max<int64_t>(1, rows) - rank * c, 0, c);
}

void apply_fsdp(Planned& p, const FsdpLayout& layout, int64_t rank, int64_t held_works) {
  Rewrite(p, layout, rank, held_works).run();
}

}  // namespace gpucast::detail
