#include "gpucast/step_time.h"

#include <algorithm>
#include <array>
#include <limits>
#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <numeric>
#include <tuple>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "gpucast/layer_model.h"
#include "gpucast/timed_layers.h"
#include "least_squares.h"
#include "gpucast/note_json.h"
#include "step_schedule.h"

namespace gpucast {
namespace {

using nlohmann::json;
constexpr const char* kOutside = kOutsideModules;

double duration(const OpRecord& op) {
  return op.device_ns >= 0 ? static_cast<double>(op.device_ns) : static_cast<double>(op.end_ns - op.start_ns);
}

// t(b) = a + c b over the probes, a, c >= 0; evaluated at b.
double fit_at(const std::vector<std::pair<double, double>>& pts, double b) {
  if (pts.empty()) return 0;
  if (pts.size() == 1) return pts[0].first > 0 ? pts[0].second * b / pts[0].first : pts[0].second;
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (auto [x, y] : pts) {
    n += 1, sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  const double den = n * sxx - sx * sx;
  double c = den != 0 ? (n * sxy - sx * sy) / den : 0;
  double a = (sy - c * sx) / n;
  if (c < 0) {  // no growth with the batch: a constant
    c = 0;
    a = sy / n;
  } else if (a < 0) {  // through the origin
    a = 0;
    c = sxx > 0 ? sxy / sxx : 0;
  }
  return a + c * b;
}

// Least squares over the columns `use` of rows x (each row: 1, b L, b L^2, scaled) for y; false where singular.
bool solve_subset(const std::vector<std::array<double, 3>>& x, const std::vector<double>& y, const std::vector<int>& use,
                  std::array<double, 3>* coef) {
  std::vector<std::vector<double>> rows;
  for (const auto& row : x) {
    std::vector<double> r;
    for (int c : use) r.push_back(row[static_cast<size_t>(c)]);
    rows.push_back(std::move(r));
  }
  const detail::LeastSquaresFit fit = detail::least_squares(rows, y);
  if (!fit.full_rank) return false;
  *coef = {0, 0, 0};
  for (size_t i = 0; i < use.size(); ++i) (*coef)[static_cast<size_t>(use[i])] = fit.coef[i];
  return true;
}

int64_t element_bytes(const std::string& dtype) {
  if (dtype == "float64" || dtype == "int64" || dtype == "complex64") return 8;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "int16") return 2;
  if (dtype == "int8" || dtype == "uint8" || dtype == "bool" || dtype.rfind("float8", 0) == 0) return 1;
  return 4;
}

int64_t value_bytes(const std::vector<Value>& values) {
  int64_t total = 0;
  for (const Value& v : values) {
    for (const TensorMeta& m : v.tensors) {
      if (m.dtype.empty()) continue;
      int64_t n = 1;
      for (int64_t d : m.shape) n *= d;
      total += n * element_bytes(m.dtype);
    }
  }
  return total;
}

// What tensor parallelism splits: matmuls (attention included) and embeddings; convolutions are kept whole.
const char* op_kind(const std::string& name) {
  static const char* const kMatmul[] = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                                        "aten::linear", "aten::einsum", "aten::scaled_dot_product_attention"};
  for (const char* m : kMatmul) {
    if (name == m) return "matmul";
  }
  if (name == "aten::embedding" || name == "aten::embedding_bag") return "embedding";
  if (name.find("conv") != std::string::npos) return "conv";
  return "other";
}

int kind_rank(const std::string& k) { return k == "matmul" ? 3 : k == "embedding" ? 2 : k == "conv" ? 1 : 0; }

}  // namespace

double fit_size(const std::vector<SizedValue>& pts, double batch, double seq) {
  if (pts.empty()) return 0;
  std::vector<double> lengths;
  for (const SizedValue& p : pts) {
    if (p.seq > 0 && std::find(lengths.begin(), lengths.end(), p.seq) == lengths.end()) lengths.push_back(p.seq);
  }
  const bool sized = seq > 0 && std::all_of(pts.begin(), pts.end(), [](const SizedValue& p) { return p.seq > 0; });
  if (sized && pts.size() == 1) return pts[0].value * batch * seq / (pts[0].batch * pts[0].seq);
  if (!sized || lengths.size() < 2) {
    std::vector<std::pair<double, double>> by_batch;
    for (const SizedValue& p : pts) by_batch.emplace_back(p.batch, p.value);
    return fit_at(by_batch, batch);
  }
  // Columns 1, b L, b L^2, each scaled to at most 1 over the points (the normal equations stay well conditioned).
  double s1 = 0, s2 = 0;
  for (const SizedValue& p : pts) s1 = std::max(s1, p.batch * p.seq), s2 = std::max(s2, p.batch * p.seq * p.seq);
  std::vector<std::array<double, 3>> x;
  std::vector<double> y;
  for (const SizedValue& p : pts) {
    x.push_back({1.0, p.batch * p.seq / s1, p.batch * p.seq * p.seq / s2});
    y.push_back(p.value);
  }
  const std::array<double, 3> at{1.0, batch * seq / s1, batch * seq * seq / s2};
  double best_sse = std::numeric_limits<double>::infinity(), best = 0;
  for (int mask = 1; mask < 8; ++mask) {
    std::vector<int> use;
    for (int c = 0; c < 3; ++c) {
      if (mask & (1 << c)) use.push_back(c);
    }
    if (use.size() > pts.size()) continue;
    std::array<double, 3> coef{};
    if (!solve_subset(x, y, use, &coef)) continue;
    if (std::any_of(coef.begin(), coef.end(), [](double c) { return c < 0; })) continue;
    double sse = 0;
    for (size_t r = 0; r < x.size(); ++r) {
      const double e = coef[0] * x[r][0] + coef[1] * x[r][1] + coef[2] * x[r][2] - y[r];
      sse += e * e;
    }
    if (sse < best_sse * (1 - 1e-12)) best_sse = sse, best = coef[0] * at[0] + coef[1] * at[1] + coef[2] * at[2];
  }
  return best;
}

namespace {
// Ops that only make a view, read metadata or allocate: a GPU runs nothing for them.
bool launches_nothing(const std::string& name) {
  static const std::unordered_set<std::string> kNames = {
      "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
      "aten::expand", "aten::expand_as", "aten::as_strided", "aten::unsqueeze", "aten::squeeze", "aten::select",
      "aten::slice", "aten::alias", "aten::detach", "aten::detach_", "aten::split", "aten::split_with_sizes",
      "aten::chunk", "aten::unbind", "aten::narrow", "aten::flatten", "aten::unflatten", "aten::view_as",
      "aten::numpy_T", "aten::contiguous", "aten::to", "aten::lift_fresh", "aten::result_type", "aten::empty",
      "aten::empty_like", "aten::empty_strided", "aten::resize_", "aten::set_", "aten::size", "aten::stride",
      "aten::dim", "aten::is_contiguous", "aten::requires_grad_", "aten::_reshape_alias", "aten::_has_compatible_shallow_copy_type",
      "aten::broadcast_tensors", "aten::movedim", "aten::swapaxes", "aten::diagonal", "aten::unfold",
      "aten::resolve_conj", "aten::resolve_neg", "aten::conj", "aten::_neg_view", "aten::_conj"};
  return kNames.count(name) != 0;
}
}  // namespace

IterationTiming iteration_timing(const Trace& t, int64_t batch) {
  IterationTiming it;
  it.batch = batch;
  const std::vector<uint64_t> ends = iteration_ends(t);
  const uint64_t lo = ends.size() >= 2 ? ends[ends.size() - 2] : 0;
  const uint64_t hi = ends.empty() ? ~uint64_t{0} : ends.back();
  int64_t first_ns = -1, last_ns = -1;
  std::map<std::string, size_t> index;
  auto layer = [&](const std::string& name) -> LayerTiming& {
    auto [pos, added] = index.emplace(name, it.layers.size());
    if (added) {
      it.layers.push_back({});
      it.layers.back().layer = name;
      it.layers.back().backward_order = -1;
    }
    return it.layers[pos->second];
  };
  int64_t backward_rank = 0;
  std::unordered_map<uint64_t, int64_t> producer;  // storage -> layer that last wrote it in forward
  std::map<std::pair<int64_t, int64_t>, int64_t> edge_bytes;
  // Which unit each recorded op's cost lands in: a layer's forward (2 li) or backward (2 li + 1), the optimizer
  // (-2) or the rest (-3): the unit of the op itself or of its enclosing op.
  std::vector<int64_t> owner(t.ops.size(), -3);
  // Launching ops: the outermost aten ops that do work (not views, metadata or bare allocations): aten::linear
  // counts once, not the aten::addmm inside it nor the CPU's own helpers inside that (a GPU runs one kernel or
  // two for it); inside a view op (aten::contiguous running a copy) the ops below it count. A trace that counted
  // nested ops without recording them cannot tell.
  std::vector<uint8_t> launches(t.ops.size(), 0), under_launch(t.ops.size(), 0);
  bool nested_unrecorded = false;
  std::vector<size_t> outermost_first(t.ops.size());
  std::iota(outermost_first.begin(), outermost_first.end(), size_t{0});
  std::stable_sort(outermost_first.begin(), outermost_first.end(),
                   [&](size_t a, size_t b) { return t.ops[a].depth < t.ops[b].depth; });
  for (size_t i : outermost_first) {  // an op after the ops around it
    const OpRecord& op = t.ops[i];
    nested_unrecorded = nested_unrecorded || op.nested > 0;
    if (op.parent >= 0 && static_cast<size_t>(op.parent) < t.ops.size()) {
      const size_t p = static_cast<size_t>(op.parent);
      under_launch[i] = under_launch[p] || launches[p];
    }
    launches[i] = !under_launch[i] && op.name.rfind("aten::", 0) == 0 && !launches_nothing(op.name);
  }
  // Device clocks: some op of the iteration carries a device time. An op without one (left untimed by a sparse
  // trace) then adds no time where it joins a layer.
  bool device = false;
  for (const OpRecord& op : t.ops) {
    if (op.start_seq > lo && op.end_seq <= hi && op.complete && !is_iteration_end_marker(op)) {
      device = device || op.device_ns >= 0;
    }
  }
  int64_t launching = 0;
  // An op counts with the ops inside it that a trace without nested ops counted instead of recording.
  auto count = [&](const OpRecord& op, int64_t unit) {
    owner[static_cast<size_t>(op.id)] = unit;
    if (unit != -2 && launches[static_cast<size_t>(op.id)]) ++launching;
    const int64_t n = 1 + op.nested;
    it.ops_total += n;
    if (unit == -2) {
      it.optimizer_ops += n;
    } else if (unit == -3) {
      it.other_ops += n;
    } else {
      LayerTiming& l = it.layers[static_cast<size_t>(unit / 2)];
      (unit % 2 ? l.backward_ops_all : l.forward_ops_all) += n;
    }
  };
  for (const OpRecord& op : t.ops) {
    if (op.start_seq <= lo || op.end_seq > hi || !op.complete || is_iteration_end_marker(op)) continue;
    const int64_t inherited = op.parent >= 0 && static_cast<size_t>(op.parent) < owner.size()
                                  ? owner[static_cast<size_t>(op.parent)]
                                  : -3;
    if (first_ns < 0 || op.start_ns < first_ns) first_ns = op.start_ns;
    last_ns = std::max(last_ns, op.end_ns);
    if (is_im2col_conv(op.name)) ++it.im2col_conv_ops;
    const bool top = op.parent < 0;
    if (is_optimizer_step(op)) {
      it.optimizer_ns += duration(op);
      count(op, -2);
    } else if (op.phase == Phase::Forward && op.scope == Scope::Function && top) {
      LayerTiming& l = layer(op.module.empty() ? kOutside : op.module);
      const int64_t li = static_cast<int64_t>(index[l.layer]);
      for (const Value& v : op.inputs) {
        for (const TensorMeta& m : v.tensors) {
          auto it2 = producer.find(m.storage);
          if (m.storage == 0 || it2 == producer.end() || it2->second == li) continue;
          edge_bytes[{it2->second, li}] += value_bytes({Value{Value::Kind::Tensor, {m}, 0.0}});
        }
      }
      for (const Value& v : op.outputs) {
        for (const TensorMeta& m : v.tensors) {
          if (m.storage != 0) producer[m.storage] = li;
        }
      }
      l.forward_ns += duration(op);
      const std::string kind = op_kind(op.name);
      if (kind_rank(kind) > kind_rank(l.kind)) l.kind = kind;
      l.out_bytes = value_bytes(op.outputs);
      count(op, 2 * li);
    } else if (op.phase == Phase::Backward && op.scope == Scope::BackwardFunction &&
               (top || t.ops[op.parent].scope != Scope::BackwardFunction)) {
      const std::string name = op.fwd_op >= 0 && !t.ops[op.fwd_op].module.empty() ? t.ops[op.fwd_op].module : kOutside;
      LayerTiming& l = layer(name);
      l.backward_ns += duration(op);
      if (l.backward_order < 0) l.backward_order = backward_rank++;
      count(op, 2 * static_cast<int64_t>(index[name]) + 1);
    } else if (const int64_t node = inherited == -3 ? engine_work_node(t, op) : -1; node >= 0) {
      // The engine's own work for the node before it, in the same record: that node's layer.
      const OpRecord& fwd = t.ops[static_cast<size_t>(t.ops[static_cast<size_t>(node)].fwd_op)];
      const std::string name = fwd.module.empty() ? kOutside : fwd.module;
      LayerTiming& l = layer(name);
      if (!device || op.device_ns >= 0) l.backward_ns += duration(op);
      count(op, 2 * static_cast<int64_t>(index[name]) + 1);
    } else {
      count(op, inherited);
      if (inherited == -2 && op.parent >= 0 && t.ops[op.parent].depth == 0) it.optimizer_bytes += op_bytes(op);
    }
  }
  for (const Allocation& a : t.allocations) {
    if (a.category != Category::Gradient || a.alloc_op < 0) continue;
    const OpRecord& op = t.ops[a.alloc_op];
    if (op.start_seq <= lo || op.end_seq > hi) continue;
    const int64_t node = gradient_node(t, op);
    const int64_t fwd = node >= 0 ? t.ops[node].fwd_op : -1;
    layer(fwd >= 0 && !t.ops[fwd].module.empty() ? t.ops[fwd].module : kOutside).grad_bytes += a.block_bytes;
  }
  for (LayerTiming& l : it.layers) {
    if (l.backward_order < 0) l.backward_order = backward_rank++;
  }
  it.launch_ops = nested_unrecorded ? -1 : launching;
  for (const auto& [e, bytes] : edge_bytes) it.edges.push_back({e.first, e.second, bytes});
  const std::vector<LayerCost> costs = layer_costs(t);
  for (const LayerCost& c : costs) {
    auto pos = index.find(c.layer);
    if (pos == index.end()) continue;
    LayerTiming& l = it.layers[pos->second];
    l.cost_kind = c.kind;
    l.flops = c.flops;
    l.bytes = c.bytes;
    l.ops = c.ops;
    l.parts = c.parts;
    l.recompute = c.recompute;
  }
  const TimedLayers chosen(t.timed_layers);
  for (LayerTiming& l : it.layers) l.timed = chosen.layer_timed(l.layer);
  it.wall_ns = first_ns >= 0 ? static_cast<double>(last_ns - first_ns) : 0;
  double layers = 0;
  for (const LayerTiming& l : it.layers) layers += l.forward_ns + l.backward_ns;
  it.other_ns = std::max(0.0, it.wall_ns - layers - it.optimizer_ns);
  it.clock = device ? "device" : "cpu";
  return it;
}

IterationTiming with_structure(IterationTiming timing, const IterationTiming& structure) {
  std::map<std::string, int64_t> here;
  for (size_t i = 0; i < timing.layers.size(); ++i) here.emplace(timing.layers[i].layer, static_cast<int64_t>(i));
  std::vector<int64_t> to_here(structure.layers.size(), -1);
  for (size_t i = 0; i < structure.layers.size(); ++i) {
    const LayerTiming& s = structure.layers[i];
    auto pos = here.find(s.layer);
    if (pos == here.end()) continue;
    to_here[i] = pos->second;
    LayerTiming& l = timing.layers[static_cast<size_t>(pos->second)];
    l.cost_kind = s.cost_kind;
    l.flops = s.flops;
    l.bytes = s.bytes;
    l.ops = s.ops;
    l.out_bytes = s.out_bytes;
    l.grad_bytes = s.grad_bytes;
    l.parts = s.parts;
    l.recompute = s.recompute;
  }
  timing.optimizer_bytes = structure.optimizer_bytes;
  // The kernel choice shows in ops nested in the convolution, which a timing trace may count without recording.
  timing.im2col_conv_ops = structure.im2col_conv_ops;
  timing.launch_ops = structure.launch_ops;
  timing.edges.clear();
  for (const LayerEdge& e : structure.edges) {
    if (e.src < 0 || e.dst < 0 || static_cast<size_t>(e.src) >= to_here.size() ||
        static_cast<size_t>(e.dst) >= to_here.size()) {
      continue;
    }
    const int64_t src = to_here[static_cast<size_t>(e.src)], dst = to_here[static_cast<size_t>(e.dst)];
    if (src >= 0 && dst >= 0) timing.edges.push_back({src, dst, e.bytes});
  }
  std::sort(timing.edges.begin(), timing.edges.end(),
            [](const LayerEdge& a, const LayerEdge& b) { return std::tie(a.src, a.dst) < std::tie(b.src, b.dst); });
  return timing;
}

namespace {

bool same_layers(const IterationTiming& a, const IterationTiming& b) {
  return a.layers.size() == b.layers.size() &&
         std::equal(a.layers.begin(), a.layers.end(), b.layers.begin(),
                    [](const LayerTiming& x, const LayerTiming& y) { return x.layer == y.layer; });
}

}  // namespace

IterationTiming median_timing(const std::vector<IterationTiming>& all) {
  if (all.empty()) GPUCAST_USER_ERROR("median timing: no runs");
  // The runs that ran the layers most of them ran (the first such group on a tie): a step whose layers change from
  // run to run (a routed layer's experts that received no token are not run) is timed over its most common form.
  size_t best = 0, best_count = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    const auto count = static_cast<size_t>(
        std::count_if(all.begin(), all.end(), [&](const IterationTiming& t) { return same_layers(t, all[r]); }));
    if (count > best_count) {
      best = r;
      best_count = count;
    }
  }
  std::vector<IterationTiming> runs;
  for (const IterationTiming& t : all) {
    if (same_layers(t, all[best])) runs.push_back(t);
  }
  const IterationTiming& first = runs.front();
  auto median = [&](auto field) {
    std::vector<double> v;
    v.reserve(runs.size());
    for (const IterationTiming& t : runs) v.push_back(field(t));
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  };
  IterationTiming out = first;
  out.wall_ns = median([](const IterationTiming& t) { return t.wall_ns; });
  out.optimizer_ns = median([](const IterationTiming& t) { return t.optimizer_ns; });
  out.other_ns = median([](const IterationTiming& t) { return t.other_ns; });
  // The untraced wall where every run has one (timing rounds combined); none where any run lacks it.
  if (std::all_of(runs.begin(), runs.end(), [](const IterationTiming& t) { return t.untraced_wall_ns > 0; })) {
    out.untraced_wall_ns = median([](const IterationTiming& t) { return t.untraced_wall_ns; });
  } else {
    out.untraced_wall_ns = -1;
  }
  for (size_t i = 0; i < out.layers.size(); ++i) {
    out.layers[i].forward_ns = median([i](const IterationTiming& t) { return t.layers[i].forward_ns; });
    out.layers[i].backward_ns = median([i](const IterationTiming& t) { return t.layers[i].backward_ns; });
  }
  return out;
}

namespace detail {

// Contiguous split of `cost` into `parts` stages minimizing the slowest stage (binary search on the bound).
std::vector<int64_t> balanced_stages(const std::vector<double>& cost, int64_t parts) {
  double lo = 0, hi = 0;
  for (double c : cost) lo = std::max(lo, c), hi += c;
  auto fill = [&](double bound, std::vector<int64_t>* out) {
    int64_t stage = 0;
    double sum = 0;
    for (size_t i = 0; i < cost.size(); ++i) {
      // Leave at least one layer for each later stage.
      const bool must_cut = static_cast<int64_t>(cost.size() - i) <= parts - 1 - stage;
      if (i > 0 && (sum + cost[i] > bound || must_cut) && stage + 1 < parts) {
        ++stage;
        sum = 0;
      }
      sum += cost[i];
      if (out) out->push_back(stage);
      if (sum > bound * (1 + 1e-12) + 1e-300) return false;
    }
    return true;
  };
  for (int iter = 0; iter < 100 && hi - lo > 1e-9 * hi; ++iter) {
    const double mid = (lo + hi) / 2;
    (fill(mid, nullptr) ? hi : lo) = mid;
  }
  std::vector<int64_t> stage;
  fill(hi, &stage);
  return stage;
}

// What the layer models (layer_model.h) and the design see of a layer.
LayerCost layer_cost(const LayerTiming& l) { return LayerCost{l.layer, l.cost_kind, l.flops, l.bytes, l.ops, {}}; }

std::vector<size_t> choose_timed_indices(const IterationTiming& t, double fraction, const std::string& design,
                                         uint64_t seed, double budget) {
  if (!(fraction > 0 && fraction <= 1)) GPUCAST_USER_ERROR("step time: time_fraction should be in (0, 1], got {}", fraction);
  if (!(budget > 0 && budget <= 1)) GPUCAST_USER_ERROR("step time: time_budget should be in (0, 1], got {}", budget);
  if (design != "d-optimal" && design != "random") {
    GPUCAST_USER_ERROR("step time: design should be d-optimal or random, got '{}'", design);
  }
  std::vector<LayerCost> costs;
  for (const LayerTiming& l : t.layers) costs.push_back(layer_cost(l));
  const size_t n = costs.size();
  if (n == 0) return {};
  auto choose = [&](size_t k) {
    return design == "random" ? random_design(n, k, seed)
                              : choose_layers_to_time(costs, static_cast<double>(k) / static_cast<double>(n), seed);
  };
  const size_t want = std::min(n, std::max<size_t>(1, static_cast<size_t>(std::ceil(fraction * static_cast<double>(n) - 1e-9))));
  std::vector<size_t> chosen = choose(want);
  auto time_of = [&](size_t i) { return t.layers[i].forward_ns + t.layers[i].backward_ns; };
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += time_of(i);
  auto share = [&](const std::vector<size_t>& c) {
    double x = 0;
    for (size_t i : c) x += time_of(i);
    return x / total;
  };
  if (budget >= 1 || !(total > 0) || share(chosen) <= budget) return chosen;
  // The most layers whose design stays within the budget (a design's share grows with its size, by and large:
  // bisection over the size), else the layer that takes least time alone.
  size_t lo = 0, hi = want;  // share(choose(hi)) > budget; lo: the largest size known to fit (0: none yet)
  std::vector<size_t> best;
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    std::vector<size_t> c = choose(mid);
    if (share(c) <= budget) {
      lo = mid;
      best = std::move(c);
    } else {
      hi = mid;
    }
  }
  if (lo == 0) {
    std::vector<size_t> one = choose(1);
    if (share(one) <= budget) return one;
    size_t cheapest = 0;
    for (size_t i = 1; i < n; ++i) {
      if (time_of(i) < time_of(cheapest)) cheapest = i;
    }
    return {cheapest};
  }
  return best;
}

}  // namespace detail

FsdpUnits fsdp_units(const std::vector<std::string>& layers, const std::vector<double>& bytes,
                     const std::vector<std::string>& paths) {
  FsdpUnits u;
  u.unit_of.assign(layers.size(), -1);
  if (paths.empty()) {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (bytes[i] <= 0) continue;
      u.unit_of[i] = static_cast<int64_t>(u.bytes.size());
      u.bytes.push_back(bytes[i]);
    }
    return u;
  }
  // A path without a dot is the root module itself (layer paths begin with its class name): the root unit, which
  // holds the layers outside every other unit anyway; it must begin the layers' paths.
  u.root = static_cast<int64_t>(paths.size());
  u.bytes.assign(paths.size() + 1, 0.0);
  std::vector<char> holds(paths.size(), 0);
  for (size_t k = 0; k < paths.size(); ++k) holds[k] = paths[k].find('.') == std::string::npos ? 2 : 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string& name = layers[i];
    int64_t best = u.root;
    size_t best_len = 0;
    for (size_t k = 0; k < paths.size(); ++k) {
      const std::string& p = paths[k];
      const bool inside =
          name == p || (name.size() > p.size() && name.compare(0, p.size(), p) == 0 && name[p.size()] == '.');
      if (!inside) continue;
      if (holds[k] >= 2) {
        holds[k] = 3;  // the root, named: it holds the layer unless a deeper unit does
      } else if (p.size() > best_len) {
        best = static_cast<int64_t>(k), best_len = p.size();
      }
    }
    u.unit_of[i] = best;
    u.bytes[static_cast<size_t>(best)] += bytes[i];
    if (best != u.root) holds[static_cast<size_t>(best)] = 1;
  }
  for (size_t k = 0; k < paths.size(); ++k) {
    if (holds[k] == 1 || holds[k] == 3) continue;
    std::string some;
    for (size_t i = 0; i < layers.size() && i < 3; ++i) some += fmt::format("{}'{}'", i ? ", " : "", layers[i]);
    GPUCAST_USER_ERROR("parallel: option 'fsdp_units' names '{}', which holds no layer of the traced step (module "
                       "paths as the trace names them, such as {}{})", paths[k], some, layers.size() > 3 ? ", ..." : "");
  }
  return u;
}

std::vector<std::string> choose_timed_layers(const IterationTiming& t, double fraction, const std::string& design,
                                             uint64_t seed, double time_budget) {
  std::vector<std::string> out;
  for (size_t i : detail::choose_timed_indices(t, fraction, design, seed, time_budget)) out.push_back(t.layers[i].layer);
  return out;
}

bool layer_runs_backward(const IterationTiming& it, const LayerTiming& l) {
  return l.backward_ops_all > 0 ||
         std::none_of(it.layers.begin(), it.layers.end(), [](const LayerTiming& x) { return x.backward_ops_all > 0; });
}

StepTimeForecast forecast_step_time(const std::vector<IterationTiming>& traced, const StepTimeOptions& o) {
  detail::StepFits fits = detail::fit_probes(traced, o);
  detail::StepSchedule s = detail::lay_out_layers(fits, o);
  if (s.P.pp > 1) {
    detail::schedule_pipeline(s);
  } else {
    s.f.exposed_comm_ms += s.f.tp_comm_ms;  // one stage: its tensor-parallel all-reduces are on the critical path
    if (s.P.dp > 1 && s.dp_link && s.P.dp_mode == "fsdp") {
      detail::schedule_fsdp(s);
    } else {
      detail::schedule_ddp_zero(s);
    }
  }
  s.f.uncorrected_step_ms = s.f.step_ms;
  return std::move(s.f);
}

std::string step_time_to_json(const StepTimeForecast& f) {
  json layers = json::array(), buckets = json::array(), comm = json::array();
  for (const auto& l : f.per_layer) {
    layers.push_back({{"layer", l.layer}, {"forward_ms", l.forward_ms}, {"backward_ms", l.backward_ms},
                      {"grad_bytes", l.grad_bytes}, {"tp_comm_ms", l.tp_comm_ms}, {"stage", l.stage},
                      {"source", l.source}});
  }
  for (const auto& b : f.buckets) {
    buckets.push_back({{"bytes", b.bytes}, {"ready_ms", b.ready_ms}, {"start_ms", b.start_ms}, {"end_ms", b.end_ms},
                       {"idle_ms", b.idle_ms}});
  }
  for (const auto& c : f.comm) {
    comm.push_back({{"kind", c.kind}, {"bytes", c.bytes}, {"start_ms", c.start_ms}, {"end_ms", c.end_ms},
                    {"stage", c.stage}});
  }
  json compute = json::array();
  for (const auto& c : f.compute) {
    compute.push_back({{"name", c.name}, {"kind", c.kind}, {"micro_batch", c.micro_batch}, {"stage", c.stage},
                       {"start_ms", c.start_ms}, {"end_ms", c.end_ms}});
  }
  return json{{"batch_size", f.batch_size}, {"per_rank_batch", f.per_rank_batch}, {"dp", f.dp}, {"tp", f.tp},
              {"pp", f.pp}, {"micro_batches", f.micro_batches}, {"dp_mode", f.dp_mode},
              {"step_ms", f.step_ms}, {"compute_ms", f.compute_ms}, {"forward_ms", f.forward_ms},
              {"backward_ms", f.backward_ms}, {"optimizer_ms", f.optimizer_ms}, {"other_ms", f.other_ms},
              {"host_ms", f.host_ms},
              {"comm_ms", f.comm_ms}, {"exposed_comm_ms", f.exposed_comm_ms}, {"tp_comm_ms", f.tp_comm_ms},
              {"pp_comm_ms", f.pp_comm_ms}, {"bubble_ms", f.bubble_ms}, {"timed_layers", f.timed_layers},
              {"per_layer", layers},
              {"buckets", buckets}, {"comm", comm}, {"compute", compute}, {"clock", f.clock}, {"notes", f.notes},
              {"alpha", f.alpha}, {"beta", f.beta}, {"correction", f.correction},
              {"uncorrected_step_ms", f.uncorrected_step_ms}}
      .dump();
}

std::string iteration_timing_to_json(const IterationTiming& t) {
  json layers = json::array();
  auto parts_json = [](const std::vector<CostPart>& parts) {
    json out = json::array();
    for (const CostPart& p : parts) out.push_back({p.kind, p.half, p.flops, p.bytes, p.kernels});
    return out;
  };
  for (const auto& l : t.layers) {
    json layer{{"layer", l.layer}, {"forward_ns", l.forward_ns}, {"backward_ns", l.backward_ns},
               {"grad_bytes", l.grad_bytes}, {"backward_order", l.backward_order}, {"kind", l.kind},
               {"out_bytes", l.out_bytes}, {"cost_kind", l.cost_kind}, {"flops", l.flops}, {"bytes", l.bytes},
               {"ops", l.ops}, {"forward_ops_all", l.forward_ops_all},
               {"backward_ops_all", l.backward_ops_all}, {"parts", parts_json(l.parts)}, {"timed", l.timed}};
    if (!l.recompute.empty()) layer["recompute"] = parts_json(l.recompute);  // written only where there is some
    layers.push_back(std::move(layer));
  }
  json edges = json::array();
  for (const auto& e : t.edges) edges.push_back({e.src, e.dst, e.bytes});
  return json{{"batch", t.batch}, {"wall_ns", t.wall_ns}, {"optimizer_ns", t.optimizer_ns}, {"other_ns", t.other_ns},
              {"clock", t.clock}, {"layers", layers}, {"edges", edges}, {"ops_total", t.ops_total},
              {"optimizer_ops", t.optimizer_ops}, {"other_ops", t.other_ops}, {"untraced_wall_ns", t.untraced_wall_ns},
              {"im2col_conv_ops", t.im2col_conv_ops}, {"optimizer_bytes", t.optimizer_bytes}, {"seq", t.seq},
              {"launch_ops", t.launch_ops}}
      .dump();
}

namespace {

// One layer of an iteration timing (iteration_timing_from_json).
LayerTiming layer_timing_from_json(const JsonFields& r, const json& l, size_t i) {
  const std::string w = fmt::format("layers[{}]", i);
  if (!l.is_object()) r.fail(w, "an object", l);
  LayerTiming lt;
  lt.layer = r.get<std::string>(l, "layer", w);
  lt.forward_ns = r.get<double>(l, "forward_ns", w);
  lt.backward_ns = r.get<double>(l, "backward_ns", w);
  lt.grad_bytes = r.get<int64_t>(l, "grad_bytes", w);
  lt.backward_order = r.get<int64_t>(l, "backward_order", w);
  lt.kind = r.get_or<std::string>(l, "kind", w, "other");
  lt.out_bytes = r.get_or<int64_t>(l, "out_bytes", w, 0);
  lt.cost_kind = r.get_or<std::string>(l, "cost_kind", w, "elementwise");
  lt.flops = r.get_or<double>(l, "flops", w, 0.0);
  lt.bytes = r.get_or<double>(l, "bytes", w, 0.0);
  lt.ops = r.get_or<int64_t>(l, "ops", w, 0);
  lt.forward_ops_all = r.get_or<int64_t>(l, "forward_ops_all", w, 0);
  lt.backward_ops_all = r.get_or<int64_t>(l, "backward_ops_all", w, 0);
  lt.timed = r.get_or<bool>(l, "timed", w, true);
  if (lt.grad_bytes < 0 || lt.out_bytes < 0 || lt.ops < 0 || lt.forward_ops_all < 0 || lt.backward_ops_all < 0) {
    r.fail(w, "counts and bytes of at least 0", l);
  }
  for (const char* key : {"parts", "recompute"}) {
    if (!l.contains(key)) continue;
    const json& parts = l[key];
    const std::string kw = fmt::format("{}.{}", w, key);
    if (!parts.is_array()) r.fail(kw, "a list of [kind, half, flops, bytes, kernels]", parts);
    std::vector<CostPart>& into = std::string_view(key) == "parts" ? lt.parts : lt.recompute;
    for (size_t k = 0; k < parts.size(); ++k) {
      const std::string pw = fmt::format("{}[{}]", kw, k);
      const json& p = parts[k];
      if (!p.is_array() || p.size() != 5) r.fail(pw, "[kind, half, flops, bytes, kernels]", p);
      into.push_back({r.as<std::string>(p[0], pw + "[0]"), r.as<bool>(p[1], pw + "[1]"),
                      r.as<double>(p[2], pw + "[2]"), r.as<double>(p[3], pw + "[3]"), r.as<int64_t>(p[4], pw + "[4]")});
    }
  }
  return lt;
}

}  // namespace

// A probe's timing as iteration_timing_to_json writes it (an op argument: checked like any outside input). Fields
// written since the first version are optional with their defaults; every field present is checked.
IterationTiming iteration_timing_from_json(const std::string& text) {
  const JsonFields r("iteration timing");
  const json j = parse_json_input(text, r.source());
  if (!j.is_object()) r.fail("", "an object (a gpucast iteration timing)", j);
  constexpr int64_t kMaxCount = int64_t{1} << 40;  // ops, batches, bytes per layer: far above any trace's
  // A top-level count in [lo, 2^40]; absent: `fallback`, unless required.
  auto count = [&](const char* key, int64_t lo, int64_t fallback, bool required = false) {
    if (!required && !j.contains(key)) return fallback;
    const int64_t v = r.get<int64_t>(j, key, "");
    if (v < lo || v > kMaxCount) r.fail(key, fmt::format("an integer from {} to 2^40", lo), j[key]);
    return v;
  };
  IterationTiming t;
  t.batch = count("batch", 1, 0, true);
  t.wall_ns = r.get<double>(j, "wall_ns", "");
  t.optimizer_ns = r.get<double>(j, "optimizer_ns", "");
  t.other_ns = r.get<double>(j, "other_ns", "");
  t.clock = r.get<std::string>(j, "clock", "");
  if (t.clock != "cpu" && t.clock != "device" && t.clock != "gpu-table") {
    r.fail("clock", "one of cpu|device|gpu-table", j["clock"]);
  }
  t.ops_total = count("ops_total", 0, 0);
  t.optimizer_ops = count("optimizer_ops", 0, 0);
  t.other_ops = count("other_ops", 0, 0);
  t.untraced_wall_ns = r.get_or<double>(j, "untraced_wall_ns", "", -1.0);
  t.im2col_conv_ops = count("im2col_conv_ops", 0, 0);
  t.optimizer_bytes = r.get_or<double>(j, "optimizer_bytes", "", 0.0);
  t.seq = count("seq", 0, 0);
  t.launch_ops = count("launch_ops", -1, -1);
  const json& layers = r.field(j, "layers", "");
  if (!layers.is_array()) r.fail("layers", "a list of layers", layers);
  t.layers.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) t.layers.push_back(layer_timing_from_json(r, layers[i], i));
  if (j.contains("edges")) {
    const json& edges = j["edges"];
    if (!edges.is_array()) r.fail("edges", "a list of [src, dst, bytes]", edges);
    const auto n = static_cast<int64_t>(t.layers.size());
    for (size_t i = 0; i < edges.size(); ++i) {
      const std::string w = fmt::format("edges[{}]", i);
      const auto e = r.as<std::vector<int64_t>>(edges[i], w);
      if (e.size() != 3 || e[2] < 0) r.fail(w, "[src, dst, bytes] (bytes at least 0)", edges[i]);
      if (e[0] < 0 || e[0] >= n || e[1] < 0 || e[1] >= n) {
        GPUCAST_USER_ERROR("iteration timing: edge {} -> {} names a layer that is not there ({} layers)", e[0], e[1], n);
      }
      t.edges.push_back(LayerEdge{e[0], e[1], e[2]});
    }
  }
  return t;
}

}  // namespace gpucast
