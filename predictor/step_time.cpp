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
#include "gpucast/layer_model.h"
#include "gpucast/timed_layers.h"

namespace gpucast {
namespace {

using nlohmann::json;
constexpr const char* kOutside = kOutsideModules;
// A forecast's timeline draws each layer's passes up to this many compute spans, each pass whole beyond.
constexpr size_t kMaxLayerSpans = 20000;

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
  const size_t k = use.size();
  double m[3][4] = {};
  for (size_t r = 0; r < x.size(); ++r) {
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = 0; j < k; ++j) m[i][j] += x[r][use[i]] * x[r][use[j]];
      m[i][k] += x[r][use[i]] * y[r];
    }
  }
  for (size_t c = 0; c < k; ++c) {  // Gaussian elimination with partial pivoting
    size_t piv = c;
    for (size_t r = c + 1; r < k; ++r) {
      if (std::abs(m[r][c]) > std::abs(m[piv][c])) piv = r;
    }
    if (std::abs(m[piv][c]) < 1e-12) return false;
    for (size_t j = 0; j <= k; ++j) std::swap(m[c][j], m[piv][j]);
    for (size_t r = 0; r < k; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (size_t j = c; j <= k; ++j) m[r][j] -= f * m[c][j];
    }
  }
  *coef = {0, 0, 0};
  for (size_t i = 0; i < k; ++i) (*coef)[use[i]] = m[i][k] / m[i][i];
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

IterationTiming median_timing(const std::vector<IterationTiming>& runs) {
  if (runs.empty()) GPUCAST_USER_ERROR("median timing: no runs");
  const IterationTiming& first = runs.front();
  for (size_t r = 1; r < runs.size(); ++r) {
    const auto& ls = runs[r].layers;
    for (size_t i = 0; i < std::max(ls.size(), first.layers.size()); ++i) {
      const std::string a = i < first.layers.size() ? "'" + first.layers[i].layer + "'" : "none";
      const std::string b = i < ls.size() ? "'" + ls[i].layer + "'" : "none";
      if (a != b) {
        GPUCAST_USER_ERROR("median timing: run {} is not the same step as run 0: its layer {} is {}, run 0's {} "
                           "({} against {} layers)", r, i, b, a, ls.size(), first.layers.size());
      }
    }
  }
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

namespace {

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

}  // namespace

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
  for (size_t i : choose_timed_indices(t, fraction, design, seed, time_budget)) out.push_back(t.layers[i].layer);
  return out;
}

bool layer_runs_backward(const IterationTiming& it, const LayerTiming& l) {
  return l.backward_ops_all > 0 ||
         std::none_of(it.layers.begin(), it.layers.end(), [](const LayerTiming& x) { return x.backward_ops_all > 0; });
}

// The device time of a timing's layers and optimizer step (its kernels', with device clocks).
static double kernel_ns(const IterationTiming& p) {
  double ns = p.optimizer_ns;
  for (const LayerTiming& l : p.layers) ns += l.forward_ns + l.backward_ns;
  return ns;
}

// The tracer's own cost out of a probe: where the untraced wall time is known, (wall - untraced) / ops per
// recorded op, taken out of each unit by its op count. With device clocks the layers' and the optimizer's times
// are their kernels', which the tracer does not slow: what the untraced step spends beyond them is the host's
// (launches, Python, synchronization), its "other".
static IterationTiming without_tracer_cost(IterationTiming p) {
  if (!(p.untraced_wall_ns > 0) || p.ops_total <= 0 || p.wall_ns <= p.untraced_wall_ns) return p;
  if (p.clock == "device") {
    p.other_ns = std::max(0.0, p.untraced_wall_ns - kernel_ns(p));
    p.wall_ns = p.untraced_wall_ns;
    return p;
  }
  const double c = (p.wall_ns - p.untraced_wall_ns) / static_cast<double>(p.ops_total);
  auto less = [&](double& t, int64_t ops) { t = std::max(0.0, t - c * static_cast<double>(ops)); };
  for (LayerTiming& l : p.layers) {
    less(l.forward_ns, l.forward_ops_all);
    less(l.backward_ns, l.backward_ops_all);
  }
  less(p.optimizer_ns, p.optimizer_ops);
  less(p.other_ns, p.other_ops);
  p.wall_ns = p.untraced_wall_ns;
  return p;
}

StepTimeForecast forecast_step_time(const std::vector<IterationTiming>& traced, const StepTimeOptions& o) {
  std::vector<IterationTiming> probes;
  for (const IterationTiming& p : traced) probes.push_back(without_tracer_cost(p));
  if (probes.empty()) GPUCAST_USER_ERROR("step time: no probe iterations to forecast from");
  const ParallelConfig& P = o.parallel;
  for (auto [key, v] : {std::pair<const char*, int64_t>{"dp", P.dp}, {"tp", P.tp}, {"pp", P.pp},
                        {"micro_batches", P.micro_batches}}) {
    if (v < 1) GPUCAST_USER_ERROR("parallel: '{}' should be an integer of at least 1, got {}", key, v);
  }
  if (P.dp_mode != "ddp" && P.dp_mode != "zero1" && P.dp_mode != "zero2" && P.dp_mode != "fsdp") {
    GPUCAST_USER_ERROR("parallel: 'dp_mode' should be one of ddp|zero1|zero2|fsdp, got '{}'", P.dp_mode);
  }
  if (o.batch_size < P.dp * P.micro_batches) {
    GPUCAST_USER_ERROR("step time: batch_size {} is smaller than dp x micro_batches = {}: every rank needs a sample "
                       "in every micro-batch", o.batch_size, P.dp * P.micro_batches);
  }
  if (!(o.time_scale > 0) || o.time_scale > 10) {
    GPUCAST_USER_ERROR("step time: time_scale should be in (0, 10], got {}", o.time_scale);
  }
  StepTimeForecast f;
  f.batch_size = o.batch_size;
  f.dp = P.dp, f.tp = P.tp, f.pp = P.pp, f.micro_batches = P.micro_batches, f.dp_mode = P.dp_mode;
  f.per_rank_batch = o.batch_size / (P.dp * P.micro_batches);
  if (f.per_rank_batch * P.dp * P.micro_batches != o.batch_size) {
    f.notes.push_back(fmt::format("batch_size {} is not a multiple of dp x micro_batches = {}: each rank's "
                                  "micro-batch taken as {}", o.batch_size, P.dp * P.micro_batches, f.per_rank_batch));
  }
  f.clock = probes.back().clock;
  const double b = static_cast<double>(f.per_rank_batch);
  const double m = static_cast<double>(P.micro_batches);
  // By sequence length too: every probe recorded with one.
  const double seq = static_cast<double>(o.seq_len);
  if (o.seq_len < 0) GPUCAST_USER_ERROR("step time: seq_len should be at least 0, got {}", o.seq_len);
  if (o.seq_len > 0) {
    for (const IterationTiming& p : probes) {
      if (p.seq <= 0) {
        GPUCAST_USER_ERROR("step time: seq_len {} asks for scaling by sequence length, but the probe at batch {} has "
                           "no sequence length recorded (forecast(..., seq_len=) records it)",
                           o.seq_len, p.batch);
      }
    }
  }
  auto tokens = [&](const IterationTiming& p) {
    return static_cast<double>(p.batch) * (o.seq_len > 0 ? static_cast<double>(p.seq) : 1.0);
  };
  auto sized = [&](const IterationTiming& p, double value) {
    return SizedValue{static_cast<double>(p.batch), o.seq_len > 0 ? static_cast<double>(p.seq) : 0.0, value};
  };
  // Layers in the forward order of the largest probe (most samples, or tokens); their points over all probes.
  const IterationTiming& ref = *std::max_element(probes.begin(), probes.end(),
                                                 [&](const auto& x, const auto& y) { return tokens(x) < tokens(y); });
  if (P.pp > 1 && P.pp > static_cast<int64_t>(ref.layers.size())) {
    GPUCAST_USER_ERROR("parallel: 'pp' {} is more than the {} layers the probes found: every stage needs a layer", P.pp,
                       ref.layers.size());
  }
  // A layer's time is fitted on the probes that ran the same kernels as the largest one (the same number of
  // recorded ops in its forward and its backward): below some batch size PyTorch picks other kernels (CPU
  // convolutions: im2col below 16 on one thread), whose times say nothing about the target's.
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> ref_ops;
  for (const LayerTiming& l : ref.layers) ref_ops[l.layer] = {l.forward_ops_all, l.backward_ops_all};
  auto same_kernels = [&](const LayerTiming& l) {
    auto it = ref_ops.find(l.layer);
    return it == ref_ops.end() || it->second == std::pair<int64_t, int64_t>{l.forward_ops_all, l.backward_ops_all};
  };
  std::vector<SizedValue> opt, other;
  std::unordered_map<std::string, std::pair<std::vector<SizedValue>, std::vector<SizedValue>>> pts, fixed_pts;
  const double k = o.time_scale;
  std::map<std::string, int64_t> switched;  // layer -> probes left out
  for (const IterationTiming& p : probes) {
    opt.push_back(sized(p, k * p.optimizer_ns));
    other.push_back(sized(p, k * p.other_ns));
    for (const LayerTiming& l : p.layers) {
      if (!same_kernels(l)) {
        ++switched[l.layer];
        continue;
      }
      pts[l.layer].first.push_back(sized(p, k * l.forward_ns));
      pts[l.layer].second.push_back(sized(p, k * l.backward_ns));
      fixed_pts[l.layer].first.push_back(sized(p, k * l.forward_fixed_ns));
      fixed_pts[l.layer].second.push_back(sized(p, k * l.backward_fixed_ns));
    }
  }
  if (!switched.empty()) {
    f.notes.push_back(fmt::format("{} layer(s) ran other kernels in smaller probes than the largest (batch {}; e.g. "
                                  "'{}'): fitted only on the probes that ran the largest probe's kernels",
                                  switched.size(), ref.batch, switched.begin()->first));
  }
  // The optimizer step's work does not grow with the batch, but on a CPU its time does, up to a point: after a
  // larger forward and backward less of the parameters, gradients and optimizer state is left in the caches
  // (AdamW's step for the zoo's CNN took twice as long after a backward at batch 32 as at batch 2 on one host,
  // the LSTM's 1.45 times). Its time is the probe's nearest the target in size (in tokens where the forecast
  // scales by sequence length; the larger of two as near).
  const double target_tokens = std::max(b * (o.seq_len > 0 ? seq : 1.0), 1.0);
  size_t nearest = 0;
  auto distance = [&](size_t i) { return std::abs(std::log(std::max(tokens(probes[i]), 1.0) / target_tokens)); };
  for (size_t i = 1; i < probes.size(); ++i) {
    const double d = distance(i), best = distance(nearest);
    if (d < best - 1e-9 || (d <= best + 1e-9 && tokens(probes[i]) > tokens(probes[nearest]))) nearest = i;
  }
  double optimizer_ns = opt[nearest].value;

  // Sparse timing: only the chosen layers' times are used; the others come from per-kind roofline models fitted
  // on them (layer_model.h), over all probes. Each probe's wall time is known: the untimed layers and "other"
  // share what the timed layers and the optimizer leave of it.
  std::unordered_map<std::string, LayerForecast> modelled;  // untimed layers at the target batch
  // Chosen when the probes were traced (their timed flags), or here by the design.
  std::vector<size_t> chosen;
  std::string chooser;
  const int64_t chosen_before = std::count_if(ref.layers.begin(), ref.layers.end(), [](const LayerTiming& l) { return l.timed; });
  if (o.every_layer && chosen_before < static_cast<int64_t>(ref.layers.size()) && ref.clock == "device") {
    GPUCAST_USER_ERROR("step time: every_layer asks for the times of every layer, but the probes were timed on the "
                       "device for {} of their {} layers only; forecast again with time_fraction=1 to time them all",
                       chosen_before, ref.layers.size());
  }
  if (!o.every_layer && chosen_before < static_cast<int64_t>(ref.layers.size())) {
    for (size_t i = 0; i < ref.layers.size(); ++i) {
      if (ref.layers[i].timed) chosen.push_back(i);
    }
    chooser = "chosen before the probes were timed";
    if (chosen.empty()) GPUCAST_USER_ERROR("step time: the probes were traced with none of their layers timed");
  } else if (o.time_fraction < 1.0 || o.time_budget < 1.0) {
    chosen = choose_timed_indices(ref, o.time_fraction, o.design, o.design_seed, o.time_budget);
    chooser = o.design + " design";
  }
  if (!chooser.empty()) {
    const size_t n = ref.layers.size();
    std::unordered_map<std::string, bool> timed;
    for (const LayerTiming& l : ref.layers) timed[l.layer] = false;
    for (size_t i : chosen) timed[ref.layers[i].layer] = true;
    std::vector<LayerCost> costs;
    std::vector<LayerSample> samples;
    for (const IterationTiming& p : probes) {
      for (const LayerTiming& l : p.layers) {
        if (!timed[l.layer] || !same_kernels(l)) continue;
        costs.push_back(layer_cost(l));
        samples.push_back({costs.size() - 1, l.forward_ns, l.backward_ns});  // scaled by k below, once
      }
    }
    LayerTimeModel model;
    model.fit(costs, samples, o.prior);
    // Each untimed layer is priced at every probe's batch against its work at the largest probe, so that the
    // model's guard against extrapolation prices one layer the same way at every batch size.
    std::unordered_map<std::string, LayerCost> reach;
    for (const LayerTiming& l : ref.layers) reach.emplace(l.layer, layer_cost(l));
    // A layer without a backward pass in the probe (its parameters frozen, no input needing a gradient) costs
    // nothing there, whatever its kind's backward model says.
    auto price = [&](const IterationTiming& p, const LayerTiming& l) {
      const auto r = reach.find(l.layer);
      LayerPrediction pr = model.predict(layer_cost(l), r == reach.end() ? nullptr : &r->second);
      if (!layer_runs_backward(p, l)) pr.backward_ns = 0;
      return pr;
    };
    f.timed_layers = static_cast<int64_t>(chosen.size());
    // Each probe's rest: its wall time less the optimizer and the timed layers, all measured; the untimed layers
    // and "other" share it (over the probes that ran the largest probe's kernels throughout where there are two:
    // the model predicts those). Fitted over the batch like a layer, the rest anchors the step at the target; the
    // modelled layers take their part of it and "other" what is left. (Fitting "other" alone as each probe's
    // rest less the modelled layers clamped it: where the model prices the untimed layers above their time at
    // small probes and below it at large ones, those remainders fall through zero, and a fit held to a >= 0
    // intercept lost the difference at the target: the zoo LSTM at 32, one of four layers timed, 8 % low.)
    other.clear();
    int64_t uniform = 0;
    for (const IterationTiming& p : probes) {
      uniform += std::all_of(p.layers.begin(), p.layers.end(), same_kernels) ? 1 : 0;
    }
    for (const IterationTiming& p : probes) {
      if (uniform >= 2 && !std::all_of(p.layers.begin(), p.layers.end(), same_kernels)) continue;
      double layers = 0;
      for (const LayerTiming& l : p.layers) {
        if (timed[l.layer]) layers += l.forward_ns + l.backward_ns;
      }
      other.push_back(sized(p, std::max(0.0, k * (p.wall_ns - p.optimizer_ns - layers))));
    }
    // Untimed layers at the target batch: the model prices each at the probes' batch sizes, where it was fitted,
    // and those times are fitted over the batch like measured ones.
    std::unordered_map<std::string, std::pair<std::vector<SizedValue>, std::vector<SizedValue>>> model_pts;
    std::unordered_map<std::string, std::string> model_source;
    for (const IterationTiming& p : probes) {
      for (const LayerTiming& l : p.layers) {
        if (timed[l.layer]) continue;
        const LayerPrediction pr = price(p, l);
        model_pts[l.layer].first.push_back(sized(p, pr.forward_ns));
        model_pts[l.layer].second.push_back(sized(p, pr.backward_ns));
        model_source[l.layer] = pr.source;
      }
    }
    for (const LayerTiming& l : ref.layers) {
      if (timed[l.layer]) continue;
      auto& [fw, bw] = model_pts[l.layer];
      LayerForecast lf{l.layer, fit_size(fw, b, seq) * k / 1e6, fit_size(bw, b, seq) * k / 1e6, l.grad_bytes};
      lf.source = model_source[l.layer];
      modelled[l.layer] = lf;
    }
    f.notes.push_back(fmt::format("timed {} of {} layers ({}); the rest from per-kind roofline models: {}",
                                  chosen.size(), n, chooser, model.describe()));
  }
  f.other_ms = fit_size(other, b, seq) / 1e6;
  if (!chooser.empty()) {
    // Sparse timing: `other` held each probe's rest. The rest at the target less the modelled layers; where they
    // come to more than the rest, "other" is 0 and, with CPU clocks (the layers' times make up the wall), they are
    // scaled down to it. Device clocks: a probe's wall is the host's where the host bounds it (small probes),
    // while the kernels grow with the batch.
    double untimed_ms = 0;
    for (const auto& [name, lf] : modelled) untimed_ms += lf.forward_ms + lf.backward_ms;
    const double rest_ms = f.other_ms;
    f.other_ms = std::max(0.0, rest_ms - untimed_ms);
    if (untimed_ms > rest_ms && untimed_ms > 0 && ref.clock == "cpu") {
      const double s = rest_ms / untimed_ms;
      for (auto& [name, lf] : modelled) lf.forward_ms *= s, lf.backward_ms *= s;
      f.notes.push_back(fmt::format("the untimed layers' models come to {:.3f} ms at the target, more than the "
                                    "{:.3f} ms the probes' walls leave beside the timed layers and the optimizer "
                                    "(fitted over the batch): scaled down to it",
                                    untimed_ms, rest_ms));
    }
  }

  // Ranks sharing one host's memory and cores run slower together than the probe ran alone: each layer by its
  // memory-bound share (bytes against FLOPs at the host's balance), the optimizer as memory-bound, the rest of
  // the step as compute-bound. With contention measured by working set, a layer's memory-bound share at its
  // bytes at the target batch, the optimizer's at its bytes.
  const Topology& T = o.topology;
  const bool by_size = !T.memory_contention_samples.empty();
  const bool contended =
      P.dp * P.tp * P.pp > 1 && (T.memory_contention != 1.0 || T.compute_contention != 1.0 || by_size);
  // Activations (and a layer's bytes) at the target micro-batch over the reference probe's.
  const double act_scale = tokens(ref) > 0 ? b * (o.seq_len > 0 ? seq : 1.0) / tokens(ref) : 1.0;
  auto memory_share = [&](double flops, double bytes) {
    const double mem = bytes, cmp = flops / T.balance;
    return mem + cmp > 0 ? mem / (mem + cmp) : 0.5;
  };
  auto contention = [&](double flops, double bytes) {
    if (!contended) return 1.0;
    const double share = memory_share(flops, bytes);
    return share * T.memory_contention_for(bytes * act_scale) + (1.0 - share) * T.compute_contention;
  };
  if (contended) {
    f.other_ms *= T.compute_contention;
    optimizer_ns *= ref.optimizer_bytes > 0 ? T.memory_contention_for(ref.optimizer_bytes) : T.memory_contention;
    if (by_size) {
      const auto& s = T.memory_contention_samples;
      f.notes.push_back(fmt::format(
          "ranks share the host: memory-bound work x{:.3f} for working sets of {:.3g} MiB up to x{:.3f} from "
          "{:.3g} MiB, compute-bound x{:.3f} when all run at once (measured by gpucast.calibrate())",
          s.front().factor, s.front().bytes / (1 << 20), s.back().factor, s.back().bytes / (1 << 20),
          T.compute_contention));
    } else {
      f.notes.push_back(fmt::format("ranks share the host: memory-bound work x{:.3f}, compute-bound x{:.3f} when all "
                                    "run at once (measured by gpucast.calibrate())",
                                    T.memory_contention, T.compute_contention));
    }
  }
  if (!T.overlap && P.dp * P.tp * P.pp > 1) {
    f.notes.push_back("collectives do not overlap the compute (the ranks' threads fill every core of the host): "
                      "their time adds to the step");
  }
  const bool ddp_overhead = (T.ddp_overhead_us > 0 || !T.ddp_overhead_samples.empty()) && P.dp > 1 &&
                            P.dp_mode != "fsdp";
  const bool drifts = (T.drift_compute > 0 || T.drift_memory > 0) && P.dp > 1 && P.dp_mode != "fsdp";
  if (drifts) {
    f.notes.push_back(fmt::format("the last rank falls behind the average one by {:.2f} % of the compute-bound and "
                                  "{:.2f} % of the memory-bound time since the ranks last met (ranks sharing cores "
                                  "drift apart; measured by gpucast.calibrate()): the step's first data-parallel "
                                  "collective starts that much later",
                                  100.0 * T.drift_compute, 100.0 * T.drift_memory));
  } else if (T.sync_wait_us > 0 && P.dp > 1 && P.dp_mode != "fsdp") {
    f.notes.push_back(fmt::format("the last rank reaches the first data-parallel reduction {:.3f} ms after the "
                                  "average one (ranks sharing cores drift apart; measured by gpucast.calibrate()): "
                                  "it starts that much later",
                                  T.sync_wait_us / 1e3));
  }

  // Links of the groups (tp innermost, then dp, then pp).
  auto link = [&](const char* what, int64_t ranks, int64_t stride) -> const Link* {
    const Link* l = o.topology.link_for(ranks, stride);
    if (!l) {
      f.notes.push_back(fmt::format("no {} link for {} ranks (gpucast.calibrate() or link=...): its communication "
                                    "is not counted", what, ranks));
    }
    return l;
  };
  const Link* tp_link = P.tp > 1 ? link("tensor-parallel", P.tp, 1) : nullptr;
  const Link* dp_link = P.dp > 1 ? link("data-parallel", P.dp, P.tp) : nullptr;
  const Link* pp_link = P.pp > 1 ? link("pipeline", P.pp, P.tp * P.dp) : nullptr;
  auto add_comm = [&](const char* kind, double bytes, double start_ms, double us, int64_t stage = 0) {
    f.comm.push_back({kind, static_cast<int64_t>(bytes), start_ms, start_ms + us / 1e3, stage});
    f.comm_ms += us / 1e3;
    return start_ms + us / 1e3;
  };

  // Per layer at the micro-batch; tensor parallelism splits matmuls and embeddings and adds its all-reduces.
  int64_t total_grad = 0, split_grad = 0, matmul_with_params = 0;
  bool inside_pair = false;
  std::vector<std::pair<int64_t, size_t>> bwd_order;
  std::vector<double> tp_fw_ms(ref.layers.size(), 0.0), tp_bw_ms(ref.layers.size(), 0.0);
  std::vector<double> tp_bytes(ref.layers.size(), 0.0);  // what a layer's tensor-parallel all-reduce moves
  std::vector<double> drift_of(ref.layers.size(), 0.0);  // each layer's drift per ms (Topology::drift_*)
  for (const LayerTiming& l : ref.layers) {
    const double mshare = memory_share(l.flops, l.bytes);
    drift_of[f.per_layer.size()] = mshare * T.drift_memory + (1.0 - mshare) * T.drift_compute;
    auto& [fw, bw] = pts[l.layer];
    LayerForecast lf{l.layer, fit_size(fw, b, seq) / 1e6, fit_size(bw, b, seq) / 1e6, l.grad_bytes};
    if (auto it = modelled.find(l.layer); it != modelled.end()) {
      lf.forward_ms = it->second.forward_ms;
      lf.backward_ms = it->second.backward_ms;
      lf.source = it->second.source;
    }
    const double slowdown = contention(l.flops, l.bytes);
    lf.forward_ms *= slowdown;
    lf.backward_ms *= slowdown;
    total_grad += l.grad_bytes;
    const size_t i = f.per_layer.size();
    // Megatron's pairs: a column-parallel matmul (with parameters) shards the activations until the next one,
    // row-parallel, gathers them with an all-reduce; every layer in between runs on the shards.
    const bool paired = l.kind == "matmul" && l.grad_bytes > 0;
    const bool row = paired && matmul_with_params % 2 == 1;
    const bool split = P.tp > 1 && (l.kind == "embedding" || paired || inside_pair || l.kind == "matmul");
    if (paired) inside_pair = !row, ++matmul_with_params;
    if (split) {
      // What every rank still does whole (its kernels' launches), then the divided rest.
      auto& [ffw, fbw] = fixed_pts[l.layer];
      const double fixed_fw = std::min(lf.forward_ms, fit_size(ffw, b, seq) / 1e6 * slowdown);
      const double fixed_bw = std::min(lf.backward_ms, fit_size(fbw, b, seq) / 1e6 * slowdown);
      lf.forward_ms = fixed_fw + (lf.forward_ms - fixed_fw) / static_cast<double>(P.tp);
      lf.backward_ms = fixed_bw + (lf.backward_ms - fixed_bw) / static_cast<double>(P.tp);
      lf.grad_bytes /= P.tp;
      split_grad += l.grad_bytes;
      const double bytes = static_cast<double>(l.out_bytes) * act_scale;
      const double us = tp_link ? allreduce_us(bytes, P.tp, *tp_link, T.algorithm) : 0.0;
      tp_bytes[i] = bytes;
      if (l.kind == "embedding") {
        tp_fw_ms[i] = us / 1e3;
      } else if (row) {
        tp_fw_ms[i] = us / 1e3;
        tp_bw_ms[i] = us / 1e3;
      }
      lf.tp_comm_ms = tp_fw_ms[i] + tp_bw_ms[i];
      f.tp_comm_ms += m * lf.tp_comm_ms;
    }
    bwd_order.emplace_back(l.backward_order, i);
    f.per_layer.push_back(std::move(lf));
  }
  f.comm_ms += f.tp_comm_ms;
  // Optimizer: this rank's share of the parameters.
  double share = total_grad > 0 ? (static_cast<double>(total_grad - split_grad) +
                                   static_cast<double>(split_grad) / static_cast<double>(P.tp)) /
                                      static_cast<double>(total_grad)
                                : 1.0 / static_cast<double>(P.tp);

  // Pipeline stages.
  std::vector<double> cost;
  for (size_t i = 0; i < f.per_layer.size(); ++i) {
    cost.push_back(f.per_layer[i].forward_ms + f.per_layer[i].backward_ms + tp_fw_ms[i] + tp_bw_ms[i]);
  }
  const std::vector<int64_t> stage = P.pp > 1 ? balanced_stages(cost, P.pp) : std::vector<int64_t>(cost.size(), 0);
  std::vector<double> stage_fw(P.pp, 0.0), stage_bw(P.pp, 0.0);
  std::vector<int64_t> stage_grad(P.pp, 0), send_bytes(P.pp, 0);
  for (size_t i = 0; i < f.per_layer.size(); ++i) {
    LayerForecast& l = f.per_layer[i];
    l.stage = stage[i];
    stage_fw[l.stage] += l.forward_ms + tp_fw_ms[i];
    stage_bw[l.stage] += l.backward_ms + tp_bw_ms[i];
    stage_grad[l.stage] += l.grad_bytes;
    send_bytes[l.stage] = static_cast<int64_t>(static_cast<double>(ref.layers[i].out_bytes) * act_scale);
  }
  for (const LayerForecast& l : f.per_layer) f.forward_ms += m * l.forward_ms, f.backward_ms += m * l.backward_ms;
  const int64_t rank_grad = *std::max_element(stage_grad.begin(), stage_grad.end());
  int64_t all_rank_grad = 0;
  for (int64_t g : stage_grad) all_rank_grad += g;
  if (P.pp > 1 && all_rank_grad > 0) share *= static_cast<double>(rank_grad) / static_cast<double>(all_rank_grad);
  if (P.pp > 1 && all_rank_grad == 0) share /= static_cast<double>(P.pp);
  const bool sharded = P.dp_mode != "ddp";
  f.optimizer_ms = optimizer_ns / 1e6 * share / (sharded ? static_cast<double>(P.dp) : 1.0);
  const bool priced_host = ref.clock == "gpu-table" &&
                           std::all_of(probes.begin(), probes.end(), [](const IterationTiming& p) { return p.host_ns > 0; });
  // The host issues the kernels while the device runs the ones before: a probe's step is its host time where
  // that is longer than its kernels (small batches, many small ops), else its kernels' time. The host's time
  // does not grow with the batch; the kernels' do. With device clocks it shows where the probes' walls grow less
  // than half as fast as their batch (one probe: where its kernels take less than half of its wall): their walls
  // (untraced) are the host's time. Priced, it is the table's cost per launching op. At the target, what the host
  // spends beyond the kernels is that time less the target's kernel time per micro-batch, if positive. Where the
  // probes do not show it, "other" stays the fit over the batch.
  std::vector<double> host;
  bool untraced = true;
  if (priced_host) {
    for (const IterationTiming& p : probes) host.push_back(k * p.host_ns / 1e6);
  } else if (ref.clock == "device") {
    auto lo = std::min_element(probes.begin(), probes.end(), [&](const auto& x, const auto& y) { return tokens(x) < tokens(y); });
    auto hi = std::max_element(probes.begin(), probes.end(), [&](const auto& x, const auto& y) { return tokens(x) < tokens(y); });
    bool host_bound = false;
    if (tokens(*hi) > tokens(*lo) && lo->wall_ns > 0) {
      host_bound = (hi->wall_ns / lo->wall_ns - 1) < 0.5 * (tokens(*hi) / tokens(*lo) - 1);
    } else {
      host_bound = kernel_ns(ref) < 0.5 * ref.wall_ns;
    }
    if (host_bound) {
      for (const IterationTiming& p : probes) {
        host.push_back(k * p.wall_ns / 1e6);
        untraced = untraced && p.untraced_wall_ns > 0;
      }
    }
  }
  if (!host.empty()) {
    std::sort(host.begin(), host.end());
    const double host_ms = host[host.size() / 2];
    f.host_ms = host_ms;
    const double kernels_ms = (f.forward_ms + f.backward_ms) / m + f.optimizer_ms;
    const double before = f.other_ms;
    f.other_ms = std::max(0.0, host_ms - kernels_ms);
    f.notes.push_back(fmt::format(
        "{}: the kernels take {:.3f} ms per micro-batch at the target, the probes' host {:.3f} ms per "
        "step ({}): the step is {}-bound; the rest of the step {:.3f} ms (fitted over the batch: {:.3f} ms)",
        priced_host ? "priced kernels" : "device clocks", kernels_ms, host_ms,
        priced_host ? "priced per op from the rates table" : untraced ? "untraced" : "traced: the tracer's cost included",
        host_ms > kernels_ms ? "host" : "device",
        f.other_ms, before));
  }
  f.other_ms *= m;
  if (ddp_overhead) {  // once per step (the reduction's aftermath), by the gradient bytes this rank reduces
    const double us = T.ddp_overhead_for(static_cast<double>(rank_grad));
    f.other_ms += us / 1e3;
    f.notes.push_back(fmt::format("DDP costs {:.3f} ms per step outside backward beyond the plain module (its "
                                  "wrapper, and the collectives' threads on the shared cores; measured by "
                                  "gpucast.calibrate(){})",
                                  us / 1e3,
                                  T.ddp_overhead_samples.empty()
                                      ? std::string()
                                      : fmt::format(", for {:.3g} MiB of gradients per rank",
                                                    static_cast<double>(rank_grad) / (1 << 20))));
  }
  // FSDP's units over the layers, by their parameters (the probes hold them whole).
  std::vector<double> params;
  FsdpUnits U;
  if (P.dp > 1 && P.dp_mode == "fsdp") {
    std::vector<std::string> names;
    for (const LayerForecast& l : f.per_layer) names.push_back(l.layer), params.push_back(static_cast<double>(l.grad_bytes));
    U = fsdp_units(names, params, P.fsdp_units);
  }
  const double fsdp_unit = T.fsdp_overhead_unit_us, fsdp_layer = T.fsdp_overhead_layer_us, fsdp_mib = T.fsdp_overhead_mib_us;
  if (P.dp > 1 && P.dp_mode == "fsdp" && (fsdp_unit > 0 || fsdp_layer > 0 || fsdp_mib > 0)) {
    // FSDP's own work beside its collectives, every micro-batch: by its units, their layers with parameters and
    // the parameters' MiB.
    int64_t units = 0, layers = 0;
    double mib = 0;
    for (double b : U.bytes) units += b > 0, mib += b / (1 << 20);
    for (double b : params) layers += b > 0;
    const double us = static_cast<double>(m) * (units * fsdp_unit + layers * fsdp_layer + mib * fsdp_mib);
    f.other_ms += us / 1e3;
    f.notes.push_back(fmt::format("FSDP's own work beside its collectives (its hooks, copies into and out of the "
                                  "gathered buffers, the optimizer over sharded tensors; measured by "
                                  "gpucast.calibrate()): {:.3f} ms per step for {} unit(s), {} layer(s) with "
                                  "parameters and {:.3g} MiB of them{}",
                                  us / 1e3, units, layers, mib, m > 1 ? fmt::format(", {} micro-batches", m) : ""));
  }
  f.compute_ms = f.forward_ms + f.backward_ms + f.optimizer_ms + f.other_ms;
  // The ranks' drift per ms of this step's compute: its layers by their memory-bound shares, the optimizer as
  // memory-bound, the rest as compute-bound.
  double drift_rate = 0;
  if (drifts) {
    double lagged = f.optimizer_ms * T.drift_memory + f.other_ms * T.drift_compute;
    double spent = f.optimizer_ms + f.other_ms;
    for (size_t i = 0; i < f.per_layer.size(); ++i) {
      const double ms = m * (f.per_layer[i].forward_ms + f.per_layer[i].backward_ms);
      lagged += ms * drift_of[i];
      spent += ms;
    }
    drift_rate = spent > 0 ? lagged / spent : 0.0;
  }

  // Data-parallel gradient reduction of `bytes` (all-reduce, or reduce-scatter when sharded).
  // idle_ms: the compute since the group's previous collective (< 0: unknown), which slows a collective on a host
  // whose ranks share the cores (Link::late_samples).
  auto reduce_us = [&](double bytes, double idle_ms = -1.0) {
    return sharded ? reduce_scatter_us(bytes, P.dp, *dp_link)
                   : allreduce_us(bytes, P.dp, *dp_link, T.algorithm, idle_ms < 0 ? -1.0 : idle_ms * 1e3);
  };
  const char* reduce_kind = sharded ? "dp_reduce_scatter" : "dp_allreduce";
  double t_end = 0;  // end of the step's compute and the communication on its critical path

  // DDP's broadcast of the module's buffers from rank 0, before the step's first forward (once per step: the
  // micro-batches under no_sync skip it); it blocks that forward. Under pipeline parallelism, a stage's share.
  double bcast_ms = 0;
  if (P.dp > 1 && dp_link && P.dp_mode != "fsdp" && P.broadcast_buffers && P.buffer_bytes > 0) {
    const double bytes = static_cast<double>(P.buffer_bytes) / static_cast<double>(P.pp);
    // It waits for the last rank, which fell behind over the optimizer step since the previous step's reduction.
    bcast_ms = add_comm("dp_broadcast_buffers", bytes, drifts ? f.optimizer_ms * T.drift_memory : 0.0,
                        broadcast_us(bytes, P.dp, *dp_link));
    f.exposed_comm_ms += bcast_ms;
  }

  // The step laid out on its streams: compute spans (per layer, or per pass where the layers times the
  // micro-batches would pass kMaxLayerSpans) beside the communication in f.comm.
  const int64_t mbs = P.micro_batches;
  const bool layer_spans = f.per_layer.size() * static_cast<size_t>(mbs) * 2 <= kMaxLayerSpans;
  auto span = [&](std::string name, const char* kind, int64_t mb, int64_t stage, double start, double ms) {
    f.compute.push_back({std::move(name), kind, mb, stage, start, start + ms});
    return start + ms;
  };
  // One micro-batch's forward (or backward) pass over `layers` from `t`, each layer followed by its
  // tensor-parallel all-reduce; done(i, end) after each. Returns the pass's end.
  auto run_pass = [&](const std::vector<size_t>& layers, bool backward, int64_t mb, int64_t stage, double t,
                      const std::function<void(size_t, double)>& done) {
    const double start = t;
    for (size_t i : layers) {
      const double ms = backward ? f.per_layer[i].backward_ms : f.per_layer[i].forward_ms;
      const double tp = backward ? tp_bw_ms[i] : tp_fw_ms[i];
      if (layer_spans) {
        t = span(f.per_layer[i].layer + (backward ? " backward" : " forward"), backward ? "backward" : "forward", mb,
                 stage, t, ms);
        if (tp > 0) f.comm.push_back({"tp_allreduce", static_cast<int64_t>(tp_bytes[i]), t, t + tp, stage});
        t += tp;
      } else {
        t += ms + tp;
      }
      if (done) done(i, t);
    }
    if (!layer_spans && !layers.empty()) {
      span(fmt::format("{} (micro-batch {})", backward ? "backward" : "forward", mb), backward ? "backward" : "forward",
           mb, stage, start, t - start);
    }
    return t;
  };
  const char* other_name = "other (loss, zero_grad, Python)";
  std::sort(bwd_order.begin(), bwd_order.end());
  std::vector<size_t> forward_layers(f.per_layer.size()), backward_layers;
  std::iota(forward_layers.begin(), forward_layers.end(), size_t{0});
  for (auto [order, i] : bwd_order) backward_layers.push_back(i);

  if (P.pp > 1) {
    // 1F1B on every stage: stage s runs min(pp - s - 1, m) forwards, then one forward and one backward in turn,
    // then the remaining backwards. A forward waits for the previous stage's output (its send), a backward for
    // the next stage's gradient; each send takes the link's time for the stage's output at the micro-batch.
    std::vector<std::vector<size_t>> stage_forward(P.pp), stage_backward(P.pp);
    for (size_t i : forward_layers) stage_forward[f.per_layer[i].stage].push_back(i);
    for (size_t i : backward_layers) stage_backward[f.per_layer[i].stage].push_back(i);
    std::vector<double> hop_ms(P.pp, 0.0);
    for (int64_t s = 0; s + 1 < P.pp; ++s) {
      if (pp_link) hop_ms[s] = send_us(static_cast<double>(send_bytes[s]), *pp_link) / 1e3;
    }
    // The step's rest (Python between the ops, zero_grad, a host's launches beyond the kernels) is each rank's for
    // its own modules: a stage's share by the recorded ops of its layers (without op counts, by its compute), run
    // after each of its passes, a forward's and a backward's by their ops.
    std::vector<double> stage_ops(P.pp, 0.0), stage_fw_ops(P.pp, 0.0);
    for (size_t i = 0; i < f.per_layer.size(); ++i) {
      const LayerTiming& l = ref.layers[i];
      stage_ops[f.per_layer[i].stage] += static_cast<double>(l.forward_ops_all + l.backward_ops_all);
      stage_fw_ops[f.per_layer[i].stage] += static_cast<double>(l.forward_ops_all);
    }
    const double all_ops = std::accumulate(stage_ops.begin(), stage_ops.end(), 0.0);
    double all_compute = 0;
    for (int64_t s = 0; s < P.pp; ++s) all_compute += stage_fw[s] + stage_bw[s];
    std::vector<double> rest_fw(P.pp, 0.0), rest_bw(P.pp, 0.0);  // per pass
    for (int64_t s = 0; s < P.pp; ++s) {
      const double share = all_ops > 0         ? stage_ops[s] / all_ops
                           : all_compute > 0 ? (stage_fw[s] + stage_bw[s]) / all_compute
                                             : 1.0 / static_cast<double>(P.pp);
      const double fw_part = stage_ops[s] > 0 ? stage_fw_ops[s] / stage_ops[s] : 0.5;
      rest_fw[s] = f.other_ms * share * fw_part / static_cast<double>(mbs);
      rest_bw[s] = f.other_ms * share * (1.0 - fw_part) / static_cast<double>(mbs);
    }
    const double start = bcast_ms;
    std::vector<double> free(P.pp, start);
    std::vector<std::vector<double>> fwd_done(P.pp, std::vector<double>(mbs, -1.0)), bwd_done = fwd_done;
    std::vector<std::vector<std::pair<bool, int64_t>>> order(P.pp);
    for (int64_t s = 0; s < P.pp; ++s) {
      const int64_t warm = std::min<int64_t>(P.pp - s - 1, mbs);
      int64_t fw = 0, bw = 0;
      for (; fw < warm; ++fw) order[s].emplace_back(false, fw);
      while (bw < mbs) {
        if (fw < mbs) order[s].emplace_back(false, fw++);
        order[s].emplace_back(true, bw++);
      }
    }
    std::vector<size_t> next(P.pp, 0);
    for (bool progress = true; progress;) {
      progress = false;
      for (int64_t s = 0; s < P.pp; ++s) {
        while (next[s] < order[s].size()) {
          const auto [backward, j] = order[s][next[s]];
          double ready = start;
          if (!backward && s > 0) {
            if (fwd_done[s - 1][j] < 0) break;
            ready = fwd_done[s - 1][j] + hop_ms[s - 1];
          } else if (backward) {
            const double after = s + 1 < P.pp ? bwd_done[s + 1][j] : fwd_done[s][j];
            if (after < 0) break;
            ready = after + (s + 1 < P.pp ? hop_ms[s] : 0.0);
          }
          const double begin = std::max(free[s], ready);
          double end = run_pass(backward ? stage_backward[s] : stage_forward[s], backward, j, s, begin, {});
          if (const double rest = backward ? rest_bw[s] : rest_fw[s]; rest > 0) {
            end = span(other_name, "other", j, s, end, rest);
          }
          (backward ? bwd_done : fwd_done)[s][j] = end;
          free[s] = end;
          // The output forward to the next stage, the gradient back to the previous one.
          if (pp_link && !backward && s + 1 < P.pp) {
            add_comm("pp_send", static_cast<double>(send_bytes[s]), end, hop_ms[s] * 1e3, s);
          }
          if (pp_link && backward && s > 0) {
            add_comm("pp_send", static_cast<double>(send_bytes[s - 1]), end, hop_ms[s - 1] * 1e3, s);
          }
          ++next[s];
          progress = true;
        }
      }
    }
    for (int64_t s = 0; s < P.pp; ++s) {  // 1F1B's order always completes; a stage left waiting is a bug here
      if (next[s] != order[s].size()) {
        GPUCAST_THROW(std::logic_error, "step time: the 1F1B schedule stopped at stage {} of {}", s, P.pp);
      }
    }
    // The slowest stage's rank: its compute, its tensor-parallel all-reduces and its sends.
    int64_t slow = 0;
    auto stage_work = [&](int64_t s) { return stage_fw[s] + stage_bw[s] + rest_fw[s] + rest_bw[s]; };
    for (int64_t s = 1; s < P.pp; ++s) {
      if (stage_work(s) > stage_work(slow)) slow = s;
    }
    double slow_tp = 0;
    for (size_t i : forward_layers) {
      if (f.per_layer[i].stage == slow) slow_tp += tp_fw_ms[i] + tp_bw_ms[i];
    }
    f.tp_comm_ms = m * slow_tp;
    for (int64_t s = 0; s < P.pp; ++s) {
      const double sends = m * ((s + 1 < P.pp ? hop_ms[s] : 0.0) + (s > 0 ? hop_ms[s - 1] : 0.0));
      f.pp_comm_ms = std::max(f.pp_comm_ms, sends);
    }
    t_end = *std::max_element(free.begin(), free.end());
    f.exposed_comm_ms += f.tp_comm_ms;
    if (dp_link && rank_grad > 0) {
      const double us = reduce_us(static_cast<double>(rank_grad));
      t_end = add_comm(reduce_kind, static_cast<double>(rank_grad), t_end, us);
      f.exposed_comm_ms += us / 1e3;
    }
    for (int64_t s = 0; s < P.pp; ++s) span("optimizer step", "optimizer", mbs - 1, s, t_end, f.optimizer_ms);
    t_end += f.optimizer_ms;
    if (dp_link && sharded && rank_grad > 0) {
      const double us = all_gather_us(static_cast<double>(rank_grad), P.dp, *dp_link);
      t_end = add_comm("dp_all_gather", static_cast<double>(rank_grad), t_end, us);
      f.exposed_comm_ms += us / 1e3;
    }
    f.step_ms = t_end;
    f.compute_ms = m * (stage_fw[slow] + stage_bw[slow] - slow_tp + rest_fw[slow] + rest_bw[slow]) + f.optimizer_ms;
    // What the slowest stage's rank waits for beside its own work: the fill and drain, and the sends.
    f.bubble_ms = std::max(0.0, f.step_ms - f.compute_ms - f.exposed_comm_ms);
    return f;
  }

  // One stage: m - 1 micro-batches without reduction (gradient accumulation), then the last one.
  const double other_mb = f.other_ms / m;
  f.exposed_comm_ms += f.tp_comm_ms;
  if (P.dp > 1 && dp_link && P.dp_mode == "fsdp") {
    // Units (ParallelConfig::fsdp_units): each given module path with the layers inside it (the innermost unit
    // holds a layer), the rest the root unit; without units every layer with parameters is one. A unit's bytes
    // are its layers' parameters (the probes hold them whole: its gather moves their full size). Each pass gathers
    // the next unit when the current one starts computing (prefetch), on one communication stream in issue order;
    // the root unit is gathered first in forward and kept for backward (not resharded after forward); a unit's
    // gradients are reduce-scattered once its last layer's backward is done, the root's once backward is. Every
    // micro-batch gathers again (gradient accumulation under no_sync keeps the gradients, not the parameters), the
    // last one reduce-scatters.
    double comm_free = 0, compute = 0;
    auto pass = [&](const std::vector<size_t>& layers, bool backward, int64_t mb, bool reduce) {
      std::vector<int64_t> order;  // the units this pass gathers, in issue order
      std::vector<char> listed(U.bytes.size(), 0);
      std::vector<int64_t> left(U.bytes.size(), 0);  // the unit's layers still to run in this pass
      auto list = [&](int64_t u) {
        if (u < 0 || listed[static_cast<size_t>(u)] || U.bytes[static_cast<size_t>(u)] <= 0) return;
        if (backward && u == U.root) return;
        listed[static_cast<size_t>(u)] = 1;
        order.push_back(u);
      };
      if (!backward) list(U.root);
      for (size_t i : layers) {
        list(U.unit_of[i]);
        if (U.unit_of[i] >= 0) ++left[static_cast<size_t>(U.unit_of[i])];
      }
      std::vector<double> gathered(U.bytes.size(), -1.0);  // when the unit's gather ends (-1: not issued)
      size_t next = 0;
      auto gather = [&](double not_before) {
        const int64_t u = order[next++];
        const double bytes = U.bytes[static_cast<size_t>(u)];
        comm_free = add_comm("fsdp_all_gather", bytes, std::max(comm_free, not_before),
                             all_gather_us(bytes, P.dp, *dp_link));
        gathered[static_cast<size_t>(u)] = comm_free;
      };
      if (!order.empty()) gather(compute);
      auto scatter = [&](int64_t u) {
        const double bytes = U.bytes[static_cast<size_t>(u)];
        if (bytes <= 0) return;
        comm_free = add_comm("fsdp_reduce_scatter", bytes, std::max(comm_free, compute),
                             reduce_scatter_us(bytes, P.dp, *dp_link));
      };
      std::vector<char> started(U.bytes.size(), 0);
      for (size_t i : layers) {
        const int64_t u = U.unit_of[i];
        double ready = compute;
        if (u >= 0 && listed[static_cast<size_t>(u)]) {
          const bool first = !started[static_cast<size_t>(u)];
          started[static_cast<size_t>(u)] = 1;
          while (gathered[static_cast<size_t>(u)] < 0) gather(compute);  // the units listed before it, then its own
          ready = std::max(compute, gathered[static_cast<size_t>(u)]);
          if (first && next < order.size()) gather(ready);  // prefetch the next unit as this one starts
        }
        compute = run_pass({i}, backward, mb, 0, ready, {});
        if (backward && reduce && u >= 0 && u != U.root && --left[static_cast<size_t>(u)] == 0) scatter(u);
      }
      if (backward && reduce && U.root >= 0) scatter(U.root);  // the root's gradients once backward is done
    };
    for (int64_t mb = 0; mb < mbs; ++mb) {
      compute = span(other_name, "other", mb, 0, compute, other_mb);
      pass(forward_layers, false, mb, false);
      pass(backward_layers, true, mb, mb + 1 == mbs);
    }
    const double compute_only = f.other_ms + f.forward_ms + f.backward_ms + f.tp_comm_ms;  // every micro-batch
    t_end = std::max(compute, comm_free);
    if (!T.overlap) {  // the collectives take the cores from the compute: their time adds
      double fsdp_comm = 0;
      for (const CommForecast& c : f.comm) {
        if (c.kind.rfind("fsdp_", 0) == 0) fsdp_comm += c.end_ms - c.start_ms;
      }
      t_end = compute_only + fsdp_comm;
    }
    f.exposed_comm_ms += t_end - compute_only;
    span("optimizer step", "optimizer", mbs - 1, 0, t_end, f.optimizer_ms);
    f.step_ms = t_end + f.optimizer_ms;
    return f;
  }
  // DDP and ZeRO-1/2: buckets in backward order, reduced while backward goes on.
  double t = bcast_ms;
  for (int64_t mb = 0; mb + 1 < mbs; ++mb) {
    t = span(other_name, "other", mb, 0, t, other_mb);
    t = run_pass(forward_layers, false, mb, 0, t, {});
    t = run_pass(backward_layers, true, mb, 0, t, {});
  }
  t = span(other_name, "other", mbs - 1, 0, t, other_mb);
  const double backward_start = run_pass(forward_layers, false, mbs - 1, 0, t, {});
  double prev_end = 0;
  BucketForecast cur;
  auto flush = [&](double ready) {
    if (cur.bytes == 0) return;
    cur.ready_ms = ready;
    f.buckets.push_back(cur);
    cur = BucketForecast{};
  };
  const bool reduce = P.dp > 1 && dp_link;
  const double backward_end = run_pass(backward_layers, true, mbs - 1, 0, backward_start, [&](size_t i, double end) {
    const LayerForecast& l = f.per_layer[i];
    if (!reduce || l.grad_bytes == 0) return;
    cur.bytes += l.grad_bytes;
    const int64_t cap = f.buckets.empty() && !P.bucket_cap_given ? o.first_bucket_bytes : P.bucket_bytes;
    if (cur.bytes >= cap) flush(end);
  });
  if (reduce) {
    flush(backward_end);
    for (size_t k = 0; k < f.buckets.size(); ++k) {
      BucketForecast& b = f.buckets[k];
      // The compute since the group's previous collective: the previous bucket's readiness; for the first, the
      // buffers' broadcast at the forward's start, else the previous step's last bucket (its optimizer step).
      b.idle_ms = std::max(0.0, k > 0 ? b.ready_ms - f.buckets[k - 1].ready_ms
                                      : b.ready_ms + (bcast_ms > 0 ? -bcast_ms : f.optimizer_ms));
      // Without overlap (the ranks' threads fill every core) the reductions run after backward, one by one. The
      // first waits for the last rank (ranks sharing cores drift apart over the compute since they last met); it
      // aligns them for the rest.
      const double lag = k > 0 ? 0.0 : drifts ? drift_rate * b.idle_ms : T.sync_wait_us / 1e3;
      b.start_ms = std::max((T.overlap ? b.ready_ms : backward_end) + lag, prev_end);
      b.end_ms = add_comm(reduce_kind, static_cast<double>(b.bytes), b.start_ms,
                          reduce_us(static_cast<double>(b.bytes), b.idle_ms));
      prev_end = b.end_ms;
    }
  }
  const double exposed = std::max(0.0, prev_end - backward_end);
  f.exposed_comm_ms += exposed;
  t_end = span("optimizer step", "optimizer", mbs - 1, 0, backward_end + exposed, f.optimizer_ms);
  if (P.dp > 1 && dp_link && sharded && all_rank_grad > 0) {
    const double us = all_gather_us(static_cast<double>(all_rank_grad), P.dp, *dp_link);
    t_end = add_comm("dp_all_gather", static_cast<double>(all_rank_grad), t_end, us);
    f.exposed_comm_ms += us / 1e3;
  }
  f.step_ms = t_end;
  return f;
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
              {"buckets", buckets}, {"comm", comm}, {"compute", compute}, {"clock", f.clock}, {"notes", f.notes}}
      .dump();
}

std::string iteration_timing_to_json(const IterationTiming& t) {
  json layers = json::array();
  for (const auto& l : t.layers) {
    json parts = json::array();
    for (const CostPart& p : l.parts) parts.push_back({p.kind, p.half, p.flops, p.bytes, p.kernels});
    layers.push_back({{"layer", l.layer}, {"forward_ns", l.forward_ns}, {"backward_ns", l.backward_ns},
                      {"grad_bytes", l.grad_bytes}, {"backward_order", l.backward_order}, {"kind", l.kind},
                      {"out_bytes", l.out_bytes}, {"cost_kind", l.cost_kind}, {"flops", l.flops}, {"bytes", l.bytes},
                      {"ops", l.ops}, {"forward_ops_all", l.forward_ops_all},
                      {"backward_ops_all", l.backward_ops_all}, {"parts", parts}, {"timed", l.timed}});
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

IterationTiming iteration_timing_from_json(const std::string& text) {
  IterationTiming t;
  try {
    const json j = json::parse(text);
    t.batch = j.at("batch").get<int64_t>();
    t.wall_ns = j.at("wall_ns").get<double>();
    t.optimizer_ns = j.at("optimizer_ns").get<double>();
    t.other_ns = j.at("other_ns").get<double>();
    t.clock = j.at("clock").get<std::string>();
    t.ops_total = j.value("ops_total", int64_t{0});
    t.optimizer_ops = j.value("optimizer_ops", int64_t{0});
    t.other_ops = j.value("other_ops", int64_t{0});
    t.untraced_wall_ns = j.value("untraced_wall_ns", -1.0);
    t.im2col_conv_ops = j.value("im2col_conv_ops", int64_t{0});
    t.optimizer_bytes = j.value("optimizer_bytes", 0.0);
    t.seq = j.value("seq", int64_t{0});
    t.launch_ops = j.value("launch_ops", int64_t{-1});
    for (const json& l : j.at("layers")) {
      LayerTiming lt{l.at("layer").get<std::string>(), l.at("forward_ns").get<double>(),
                     l.at("backward_ns").get<double>(), l.at("grad_bytes").get<int64_t>(),
                     l.at("backward_order").get<int64_t>()};
      lt.kind = l.value("kind", std::string("other"));
      lt.out_bytes = l.value("out_bytes", int64_t{0});
      lt.cost_kind = l.value("cost_kind", std::string("elementwise"));
      lt.flops = l.value("flops", 0.0);
      lt.bytes = l.value("bytes", 0.0);
      lt.ops = l.value("ops", int64_t{0});
      lt.forward_ops_all = l.value("forward_ops_all", int64_t{0});
      lt.backward_ops_all = l.value("backward_ops_all", int64_t{0});
      lt.timed = l.value("timed", true);
      if (l.contains("parts")) {
        for (const json& p : l.at("parts")) {
          lt.parts.push_back({p.at(0).get<std::string>(), p.at(1).get<bool>(), p.at(2).get<double>(),
                              p.at(3).get<double>(), p.at(4).get<int64_t>()});
        }
      }
      t.layers.push_back(std::move(lt));
    }
    if (j.contains("edges")) {
      for (const json& e : j.at("edges")) {
        LayerEdge le{e.at(0).get<int64_t>(), e.at(1).get<int64_t>(), e.at(2).get<int64_t>()};
        const auto n = static_cast<int64_t>(t.layers.size());
        if (le.src < 0 || le.src >= n || le.dst < 0 || le.dst >= n) {
          GPUCAST_USER_ERROR("iteration timing: edge {} -> {} names a layer that is not there ({} layers)", le.src,
                             le.dst, n);
        }
        t.edges.push_back(le);
      }
    }
  } catch (const json::exception& e) {
    GPUCAST_USER_ERROR("iteration timing: not a gpucast iteration timing ({})", e.what());
  }
  return t;
}

}  // namespace gpucast
