#include "gpucast/layer_model.h"
#include "gpucast/timed_layers.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <map>
#include <numeric>
#include <tuple>
#include <unordered_map>

#include <fmt/format.h>

#include "gpucast/error.h"

namespace gpucast {
namespace {

using Shape = std::vector<int64_t>;
constexpr const char* kOutside = kOutsideModules;
constexpr size_t kMatmul = 0, kConv = 1, kAttention = 2, kElementwise = kLayerCostKinds.size() - 1;
// 1e-9: a chosen ridge, small against the features' scale.
constexpr double kRidge = 1e-9;

std::string_view base_name(std::string_view name) {
  const size_t colons = name.rfind("::");
  return colons == std::string_view::npos ? name : name.substr(colons + 2);
}

bool one_of(std::string_view s, std::initializer_list<std::string_view> xs) {
  return std::find(xs.begin(), xs.end(), s) != xs.end();
}

size_t kind_index(std::string_view kind) {
  const auto it = std::find(kLayerCostKinds.begin(), kLayerCostKinds.end(), kind);
  return it == kLayerCostKinds.end() ? kElementwise : static_cast<size_t>(it - kLayerCostKinds.begin());
}

bool heavy(size_t kind) { return kind == kMatmul || kind == kConv || kind == kAttention; }

// Ops that return a view (or a reshape of one): no FLOPs, no data moved.
bool is_view(std::string_view b) {
  return one_of(b, {"view", "_unsafe_view", "view_as", "reshape", "_reshape_alias", "flatten", "unflatten", "t",
                    "transpose", "permute", "expand", "expand_as", "slice", "select", "narrow", "unsqueeze",
                    "squeeze", "detach", "alias", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
                    "lift_fresh", "numpy_T", "mT", "movedim", "swapaxes", "diagonal", "unfold"});
}

// An op that hands back one of its inputs (dropout with p = 0, contiguous() of a contiguous tensor, an identity):
// every output shares an input's storage and the op is not in-place (in-place ops, "add_", write what they
// return).
bool passes_through(const OpRecord& op, std::string_view b) {
  if (b.empty() || b.back() == '_' || op.outputs.empty()) return false;
  bool any = false;
  for (const Value& out : op.outputs) {
    for (const TensorMeta& m : out.tensors) {
      if (m.storage == 0) return false;
      bool found = false;
      for (const Value& in : op.inputs) {
        for (const TensorMeta& x : in.tensors) found = found || x.storage == m.storage;
      }
      if (!found) return false;
      any = true;
    }
  }
  return any;
}

}  // namespace

bool is_im2col_conv(std::string_view name) { return name == "aten::thnn_conv2d" || name == "aten::slow_conv3d"; }

namespace {

bool is_softmax(std::string_view b) {
  return one_of(b, {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"});
}

double dtype_size(std::string_view dtype) {
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float64" || dtype == "int64" || dtype == "complex64") return 8;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "int16") return 2;
  if (dtype == "int8" || dtype == "uint8" || dtype == "bool" || dtype.starts_with("float8")) return 1;
  if (dtype == "complex128") return 16;
  return 4;
}

double dim(int64_t x) { return static_cast<double>(x); }

// Elements of a shape, 0 when a dimension is negative.
double numel(const Shape& s) {
  double n = 1;
  for (int64_t d : s) {
    if (d < 0) return 0;
    n *= dim(d);
  }
  return n;
}

// The shape of argument i when it is a tensor with no negative dimension; null otherwise.
const Shape* shape_of(const std::vector<Value>& values, size_t i) {
  if (i >= values.size() || values[i].kind != Value::Kind::Tensor || values[i].tensors.empty()) return nullptr;
  const Shape& s = values[i].tensors[0].shape;
  return std::any_of(s.begin(), s.end(), [](int64_t d) { return d < 0; }) ? nullptr : &s;
}

// Elements of the first output value that holds tensors (all of a list).
double output_elements(const OpRecord& op) {
  for (const Value& v : op.outputs) {
    if (v.tensors.empty()) continue;
    double n = 0;
    for (const TensorMeta& m : v.tensors) n += m.dtype.empty() ? 0 : numel(m.shape);
    return n;
  }
  return 0;
}

// a [..., M, K] x b [..., K, N] with broadcast batch dimensions (a vector is a row on the left, a column on the
// right): 2 * batch * M * N * K; 0 when the shapes do not fit.
double matmul_flops(const Shape* a, const Shape* b) {
  if (!a || !b || a->empty() || b->empty()) return 0;
  Shape x = *a, y = *b;
  if (x.size() == 1) x.insert(x.begin(), 1);
  if (y.size() == 1) y.push_back(1);
  const int64_t m = x[x.size() - 2], k = x.back(), n = y.back();
  if (y[y.size() - 2] != k) return 0;
  const size_t bx = x.size() - 2, by = y.size() - 2;
  double batch = 1;
  for (size_t i = 0; i < std::max(bx, by); ++i) {
    const int64_t p = i < bx ? x[bx - 1 - i] : 1, q = i < by ? y[by - 1 - i] : 1;
    if (p != q && p != 1 && q != 1) return 0;
    batch *= dim(p == 1 ? q : p);
  }
  return 2 * batch * dim(m) * dim(n) * dim(k);
}

// Batched products: both operands [B, ., .].
double bmm_flops(const Shape* a, const Shape* b) {
  if (!a || !b || a->size() != 3 || b->size() != 3 || (*a)[0] != (*b)[0]) return 0;
  return matmul_flops(a, b);
}

// Plain products: both operands 2-D.
double mm_flops(const Shape* a, const Shape* b) {
  if (!a || !b || a->size() != 2 || b->size() != 2) return 0;
  return matmul_flops(a, b);
}

// input [..., K], weight [N, K] (or [K]).
double linear_flops(const Shape* x, const Shape* w) {
  if (!x || !w || x->empty() || w->empty() || w->size() > 2 || w->back() != x->back()) return 0;
  const double m = numel(*x) / std::max(1.0, dim(x->back()));
  const double n = w->size() == 2 ? dim((*w)[0]) : 1;
  return x->back() == 0 ? 0 : 2 * m * n * dim(x->back());
}

// The weight [C_out, C_in / groups, kernel...] (transposed: [C_in, C_out / groups, kernel...]) and the larger side
// (the output; transposed: the input), batched or not.
double conv_flops(const OpRecord& op, std::string_view b) {
  const Shape* w = shape_of(op.inputs, 1);
  if (!w || w->size() < 3) return 0;
  const bool transposed = b.find("transpose") != std::string_view::npos ||
                          (one_of(b, {"convolution", "_convolution", "convolution_overrideable"}) &&
                           op.inputs.size() > 6 && op.inputs[6].kind == Value::Kind::Scalar &&
                           op.inputs[6].scalar != 0);
  const Shape* big = transposed ? shape_of(op.inputs, 0) : shape_of(op.outputs, 0);
  const size_t spatial = w->size() - 2;
  if (!big || (big->size() != w->size() && big->size() != w->size() - 1)) return 0;
  if ((*big)[big->size() - spatial - 1] != (*w)[0]) return 0;  // channels
  double kernel = 1;
  for (size_t i = 2; i < w->size(); ++i) kernel *= dim((*w)[i]);
  return 2 * numel(*big) * dim((*w)[1]) * kernel;
}

// q [..., L, E], k [..., S, E], v [..., S, Ev]: QK^T and PV.
double attention_flops(const OpRecord& op) {
  const Shape *q = shape_of(op.inputs, 0), *k = shape_of(op.inputs, 1), *v = shape_of(op.inputs, 2);
  if (!q || !k || q->size() < 2 || k->size() < 2 || k->back() != q->back()) return 0;
  const int64_t l = (*q)[q->size() - 2], e = q->back(), s = (*k)[k->size() - 2];
  const int64_t ev = v && v->size() >= 2 && (*v)[v->size() - 2] == s ? v->back() : e;
  double batch = 1;
  for (size_t i = 0; i + 2 < q->size(); ++i) batch *= dim((*q)[i]);
  return 2 * batch * dim(l) * dim(s) * dim(e + ev);
}

bool is_recurrent(std::string_view b) { return one_of(b, {"lstm", "gru", "rnn_tanh", "rnn_relu"}); }

// lstm / gru / rnn(input or packed data, ..., [params], ...): every 2-D weight (input-hidden and hidden-hidden of
// every layer and direction, [gates * hidden, in]) multiplies one vector per time step and sequence: 2 * rows *
// (sum of the weights' elements), rows = the input's elements over its last dimension. Hidden states (3-D) and
// biases (1-D) are not weights.
double recurrent_flops(const OpRecord& op) {
  const Shape* x = shape_of(op.inputs, 0);
  if (!x || x->empty() || x->back() <= 0) return 0;
  const double rows = numel(*x) / dim(x->back());
  double weights = 0;
  for (const Value& v : op.inputs) {
    if (v.kind != Value::Kind::TensorList) continue;
    for (const TensorMeta& m : v.tensors) {
      if (m.shape.size() == 2) weights += numel(m.shape);
    }
  }
  return 2 * rows * weights;
}

// einsum(equation, [operands]): the equation is not recorded; 2 sqrt(|a| |b| |out|) is exact for a [M, K] x [K, N].
double einsum_flops(const OpRecord& op) {
  const double out = output_elements(op);
  for (const Value& v : op.inputs) {
    if (v.kind != Value::Kind::TensorList) continue;
    if (v.tensors.size() != 2) return out;
    return 2 * std::sqrt(numel(v.tensors[0].shape) * numel(v.tensors[1].shape) * out);
  }
  return out;
}

using Children = std::unordered_map<int64_t, std::vector<int64_t>>;

// The matmul, conv and attention ops under `id` (the outermost of each nesting that has FLOPs): their FLOPs in
// all, and the kind of the largest.
void heavy_descendants(const Trace& t, const Children& children, int64_t id, int depth, double* sum, double* largest,
                       size_t* kind) {
  const auto it = children.find(id);
  if (it == children.end() || depth > 64) return;
  for (int64_t c : it->second) {
    const OpRecord& op = t.ops[c];
    const size_t k = kind_index(op_cost_kind(op.name));
    const double f = heavy(k) ? op_flops(op) : 0;
    if (f > 0) {
      *sum += f;
      if (f > *largest) *largest = f, *kind = k;
    } else {
      heavy_descendants(t, children, c, depth + 1, sum, largest, kind);
    }
  }
}

// ---- Fitting ------------------------------------------------------------------------------------------------

// One measurement of one pass, divided by the measured time (so that residuals are relative errors).
struct Point {
  double ops = 0, flops = 0, bytes = 0;  // per second of the measurement; FLOPs and bytes doubled for backward
};

// The search's settings below are chosen, not tuned on a recorded measurement.
constexpr double kGridLo = -4, kGridHi = 2, kGridStep = 0.25;  // log10 of the rates over the prior's
constexpr double kBoundLo = -8, kBoundHi = 4;
constexpr int kMaxSteps = 1000;  // pattern-search moves from one start
constexpr double kMaxExtrapolation = 4;  // predict() trusts a fit up to this many times the work it saw
constexpr double kPull = 1e-6;  // per point and squared decade: breaks ties (a bound no point reaches) to the prior

class Objective {
 public:
  Objective(const std::vector<Point>& pts, const DeviceRates& prior) : pts_(pts), prior_(prior), c_(pts.size()) {
    for (const Point& p : pts) saa_ += p.ops * p.ops;
  }

  // Loss at F = prior * 10^x, B = prior * 10^z, the overhead solved (>= 0); the tie-breaking pull included.
  double operator()(double x, double z, DeviceRates* out = nullptr) {
    const DeviceRates r = rates(x, z, 0);
    const double inv_f = 1 / r.flops_per_s, inv_b = 1 / r.bytes_per_s;
    double sac = 0;
    for (size_t i = 0; i < pts_.size(); ++i) {
      c_[i] = std::max(pts_[i].flops * inv_f, pts_[i].bytes * inv_b) - 1;
      sac += pts_[i].ops * c_[i];
    }
    const double o = saa_ > 0 ? std::max(0.0, -sac / saa_) : prior_.op_overhead_s;
    double loss = 0;
    for (size_t i = 0; i < pts_.size(); ++i) {
      const double e = pts_[i].ops * o + c_[i];
      loss += e * e;
    }
    if (out) *out = rates(x, z, o);
    return loss + kPull * static_cast<double>(pts_.size()) * (x * x + z * z);
  }

 private:
  DeviceRates rates(double x, double z, double o) const {
    return {prior_.flops_per_s * std::pow(10.0, x), prior_.bytes_per_s * std::pow(10.0, z), o};
  }
  const std::vector<Point>& pts_;
  DeviceRates prior_;
  std::vector<double> c_;
  double saa_ = 0;
};

// Least squares on relative errors: the log grid, then a pattern search (8 directions; the step halved after a
// failure, doubled after a success) from its two best points.
DeviceRates fit_roofline(const std::vector<Point>& pts, const DeviceRates& prior) {
  Objective f(pts, prior);
  std::vector<std::tuple<double, double, double>> grid;  // loss, x, z
  for (double x = kGridLo; x <= kGridHi + 1e-9; x += kGridStep) {
    for (double z = kGridLo; z <= kGridHi + 1e-9; z += kGridStep) grid.emplace_back(f(x, z), x, z);
  }
  std::partial_sort(grid.begin(), grid.begin() + 2, grid.end());
  double best = std::numeric_limits<double>::infinity(), bx = 0, bz = 0;
  for (size_t s = 0; s < 2; ++s) {
    auto [loss, x, z] = grid[s];
    double step = kGridStep / 2;
    for (int iter = 0; iter < kMaxSteps && step > 1e-5; ++iter) {
      double nl = loss, nx = x, nz = z;
      for (int dx = -1; dx <= 1; ++dx) {
        for (int dz = -1; dz <= 1; ++dz) {
          const double cx = std::clamp(x + dx * step, kBoundLo, kBoundHi);
          const double cz = std::clamp(z + dz * step, kBoundLo, kBoundHi);
          if ((dx == 0 && dz == 0) || (cx == x && cz == z)) continue;
          const double l = f(cx, cz);
          if (l < nl) nl = l, nx = cx, nz = cz;
        }
      }
      if (nl < loss) {  // a success widens the step again, so that a long valley is followed quickly
        loss = nl, x = nx, z = nz;
        step = std::min(2 * step, kGridStep);
      } else {
        step /= 2;
      }
    }
    if (loss < best) best = loss, bx = x, bz = z;
  }
  DeviceRates out;
  f(bx, bz, &out);
  return out;
}

DeviceRates scaled(const DeviceRates& r, double s) {
  return {r.flops_per_s / s, r.bytes_per_s / s, r.op_overhead_s * s};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A pass's measurements: (layer, seconds) with a usable time and a layer with some cost.
using Measured = std::vector<std::pair<const LayerCost*, double>>;

PassFit fit_pass(const Measured& m, const DeviceRates& prior, Phase pass, const char* many, const char* one) {
  PassFit p;
  p.rates = prior;
  p.samples = m.size();
  const double k = pass == Phase::Backward ? 2 : 1;
  for (auto [c, y] : m) p.max_work_s = std::max(p.max_work_s, roofline_ns(*c, DeviceRates{prior.flops_per_s,
                                                                                          prior.bytes_per_s, 0}, pass) / 1e9);
  auto rms = [&](const DeviceRates& r) {
    double s = 0;
    for (auto [c, y] : m) s += std::pow(roofline_ns(*c, r, pass) / 1e9 / y - 1, 2);
    return m.empty() ? 0 : std::sqrt(s / static_cast<double>(m.size()));
  };
  if (m.size() >= 2) {
    std::vector<Point> pts;
    for (auto [c, y] : m) {
      pts.push_back({static_cast<double>(std::max<int64_t>(0, c->ops)) / y, k * std::max(0.0, c->flops) / y,
                     k * std::max(0.0, c->bytes) / y});
    }
    p.rates = fit_roofline(pts, prior);
    p.source = many;
  } else if (!m.empty()) {
    std::vector<double> ratios;
    for (auto [c, y] : m) {
      const double t = roofline_ns(*c, prior, pass) / 1e9;
      if (t > 0) ratios.push_back(y / t);
    }
    if (ratios.empty()) return PassFit{prior, "prior", 0, 0};
    p.rates = scaled(prior, median(ratios));
    p.source = one;
  }
  p.rms_rel_error = rms(p.rates);
  return p;
}

int source_rank(std::string_view s) { return s == "kind" ? 3 : s == "pooled" ? 2 : s == "scaled_prior" ? 1 : 0; }

std::string rates_text(const PassFit& p) {
  const DeviceRates& r = p.rates;
  return fmt::format("{} ({} layers): {:.4g} Tflop/s, {:.4g} TB/s, {:.4g} us/op, rms error {:.3g} %", p.source,
                     p.samples, r.flops_per_s / 1e12, r.bytes_per_s / 1e12, r.op_overhead_s * 1e6,
                     100 * p.rms_rel_error);
}

// ---- Designs ------------------------------------------------------------------------------------------------

// splitmix64: the same draws on every platform (std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    // Constants of Vigna's splitmix64 (xorshift.di.unimi.it/splitmix64.c); 0x1.0p-53: a double's 53-bit mantissa.
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) {  // uniform in [0, n)
    return static_cast<size_t>(static_cast<double>(next() >> 11) * 0x1.0p-53 * static_cast<double>(n));
  }

 private:
  uint64_t s_;
};

using Rows = std::vector<std::vector<double>>;

size_t check_rows(const Rows& rows, const char* what) {
  const size_t p = rows.empty() ? 0 : rows[0].size();
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].size() != p) {
      GPUCAST_USER_ERROR("{}: row {} has {} values, but row 0 has {}: every row needs the same length", what, i,
                         rows[i].size(), p);
    }
    for (size_t j = 0; j < p; ++j) {
      if (!std::isfinite(rows[i][j])) {
        GPUCAST_USER_ERROR("{}: row {} value {} should be a finite number, got {}", what, i, j, rows[i][j]);
      }
    }
  }
  return p;
}

// The information matrix ridge I + sum of x x^T over `design`, Cholesky-factored in place (lower triangle).
class Information {
 public:
  Information(const Rows& rows, size_t p) : rows_(rows), p_(p), l_(p * p), inv_(p * p) {}

  // False when not positive definite (not with the ridge, unless values overflow).
  bool factor(const std::vector<size_t>& design) {
    std::fill(l_.begin(), l_.end(), 0.0);
    for (size_t i = 0; i < p_; ++i) l_[i * p_ + i] = kRidge;
    for (size_t r : design) {
      const std::vector<double>& x = rows_[r];
      for (size_t i = 0; i < p_; ++i) {
        for (size_t j = 0; j <= i; ++j) l_[i * p_ + j] += x[i] * x[j];
      }
    }
    for (size_t j = 0; j < p_; ++j) {
      double d = l_[j * p_ + j];
      for (size_t k = 0; k < j; ++k) d -= l_[j * p_ + k] * l_[j * p_ + k];
      if (!(d > 0)) return false;
      l_[j * p_ + j] = std::sqrt(d);
      for (size_t i = j + 1; i < p_; ++i) {
        double s = l_[i * p_ + j];
        for (size_t k = 0; k < j; ++k) s -= l_[i * p_ + k] * l_[j * p_ + k];
        l_[i * p_ + j] = s / l_[j * p_ + j];
      }
    }
    // The inverse, column by column: L L^T v = e_c.
    std::vector<double> v(p_);
    for (size_t c = 0; c < p_; ++c) {
      for (size_t i = 0; i < p_; ++i) {
        double s = i == c ? 1 : 0;
        for (size_t k = 0; k < i; ++k) s -= l_[i * p_ + k] * v[k];
        v[i] = s / l_[i * p_ + i];
      }
      for (size_t i = p_; i-- > 0;) {
        double s = v[i];
        for (size_t k = i + 1; k < p_; ++k) s -= l_[k * p_ + i] * v[k];
        v[i] = s / l_[i * p_ + i];
      }
      for (size_t i = 0; i < p_; ++i) inv_[i * p_ + c] = v[i];
    }
    return true;
  }

  double log_det() const {
    double s = 0;
    for (size_t i = 0; i < p_; ++i) s += 2 * std::log(l_[i * p_ + i]);
    return s;
  }
  // u = M^-1 x_r
  void solve(size_t r, std::vector<double>* u) const {
    u->assign(p_, 0.0);
    for (size_t i = 0; i < p_; ++i) {
      for (size_t j = 0; j < p_; ++j) (*u)[i] += inv_[i * p_ + j] * rows_[r][j];
    }
  }
  double dot(size_t r, const std::vector<double>& u) const {
    double s = 0;
    for (size_t i = 0; i < p_; ++i) s += rows_[r][i] * u[i];
    return s;
  }
  // x_r^T M^-1 x_r: the determinant grows by 1 + this when row r is added.
  double variance(size_t r, std::vector<double>* u) const {
    solve(r, u);
    return dot(r, *u);
  }

 private:
  const Rows& rows_;
  size_t p_;
  std::vector<double> l_, inv_;
};

double log_det_of(const Rows& rows, size_t p, const std::vector<size_t>& design) {
  Information info(rows, p);
  return info.factor(design) ? info.log_det() : -std::numeric_limits<double>::infinity();
}

// Fedorov exchange over rows already checked, `fixed` kept in every design.
std::vector<size_t> fedorov(const Rows& rows, size_t p, size_t k, uint64_t seed, const std::vector<size_t>& fixed) {
  const size_t n = rows.size();
  std::vector<char> chosen(n, 0), pinned(n, 0);
  std::vector<size_t> design;
  for (size_t r : fixed) {
    if (!chosen[r] && design.size() < k) design.push_back(r), chosen[r] = pinned[r] = 1;
  }
  Information info(rows, p);
  std::vector<double> u, d(n);
  auto refresh = [&] {
    info.factor(design);
    for (size_t j = 0; j < n; ++j) d[j] = info.variance(j, &u);
  };
  if (seed == 0) {  // greedy: the row the current design knows least about
    while (design.size() < k) {
      refresh();
      size_t best = n;
      for (size_t j = 0; j < n; ++j) {
        if (!chosen[j] && (best == n || d[j] > d[best])) best = j;
      }
      design.push_back(best), chosen[best] = 1;
    }
  } else {
    std::vector<size_t> rest;
    for (size_t j = 0; j < n; ++j) {
      if (!chosen[j]) rest.push_back(j);
    }
    Rng rng(seed);
    for (size_t i = 0; design.size() < k; ++i) {
      std::swap(rest[i], rest[i + rng.below(rest.size() - i)]);
      design.push_back(rest[i]), chosen[rest[i]] = 1;
    }
  }
  refresh();
  double log_det = info.log_det();
  // 100: a chosen bound on the exchange passes (each pass that improves raises det; few are needed).
  constexpr int kMaxPasses = 100;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    bool improved = false;
    for (size_t pos = 0; pos < design.size(); ++pos) {
      const size_t i = design[pos];
      if (pinned[i]) continue;
      std::vector<double> ui;
      const double di = info.variance(i, &ui);
      // det(M - x_i x_i^T + x_j x_j^T) / det(M) - 1
      double best_gain = 0;
      size_t best = n;
      for (size_t j = 0; j < n; ++j) {
        if (chosen[j]) continue;
        const double dij = info.dot(j, ui);
        const double gain = (1 + d[j]) * (1 - di) + dij * dij - 1;
        if (gain > best_gain) best_gain = gain, best = j;
      }
      if (best == n || best_gain <= 1e-9) continue;
      design[pos] = best;
      const double next = log_det_of(rows, p, design);
      if (!(next > log_det + 1e-9)) {  // rounding promised more than the swap gives
        design[pos] = i;
        continue;
      }
      chosen[i] = 0, chosen[best] = 1;
      log_det = next;
      improved = true;
      refresh();
    }
    if (!improved) break;
  }
  std::sort(design.begin(), design.end());
  return design;
}

}  // namespace

// ---- Cost features ------------------------------------------------------------------------------------------

std::string_view op_cost_kind(std::string_view name) {
  const std::string_view b = base_name(name);
  if (one_of(b, {"mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "mv",
                 "addmv", "dot", "vdot"}) || is_recurrent(b)) {
    return kLayerCostKinds[kMatmul];
  }
  if (b.find("scaled_dot_product") != std::string_view::npos) return kLayerCostKinds[kAttention];
  if (b.find("convolution") != std::string_view::npos || b.starts_with("conv1d") || b.starts_with("conv2d") ||
      b.starts_with("conv3d") || b.starts_with("conv_transpose") || b.starts_with("conv_tbc") ||
      b.starts_with("slow_conv") || b.starts_with("_slow_conv") || b.starts_with("thnn_conv")) {
    return kLayerCostKinds[kConv];
  }
  if (one_of(b, {"layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                 "_native_batch_norm_legit_no_training", "_batch_norm_impl_index", "_batch_norm_with_update",
                 "_batch_norm_no_update", "cudnn_batch_norm", "instance_norm", "group_norm", "native_group_norm",
                 "rms_norm", "_fused_rms_norm"})) {
    return kLayerCostKinds[3];
  }
  if (one_of(b, {"embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"})) {
    return kLayerCostKinds[4];
  }
  if (b.find("pool") != std::string_view::npos) return kLayerCostKinds[5];
  return kLayerCostKinds[kElementwise];
}

double op_flops(const OpRecord& op) {
  const std::string_view b = base_name(op.name);
  if (is_view(b) || passes_through(op, b)) return 0;
  const std::vector<Value>& in = op.inputs;
  double f = 0;
  switch (kind_index(op_cost_kind(b))) {
    case kMatmul:
      if (b == "mm") f = mm_flops(shape_of(in, 0), shape_of(in, 1));
      else if (b == "addmm" || b == "_addmm_activation") f = mm_flops(shape_of(in, 1), shape_of(in, 2));
      else if (b == "bmm") f = bmm_flops(shape_of(in, 0), shape_of(in, 1));
      else if (b == "baddbmm" || b == "addbmm") f = bmm_flops(shape_of(in, 1), shape_of(in, 2));
      else if (b == "linear") f = linear_flops(shape_of(in, 0), shape_of(in, 1));
      else if (b == "addmv") f = matmul_flops(shape_of(in, 1), shape_of(in, 2));
      else if (b == "einsum") f = einsum_flops(op);
      else if (is_recurrent(b)) f = recurrent_flops(op);
      else f = matmul_flops(shape_of(in, 0), shape_of(in, 1));  // matmul, mv, dot, vdot
      break;
    case kConv:
      f = conv_flops(op, b);
      break;
    case kAttention:
      f = attention_flops(op);
      break;
    case 3:  // norm
      // 5 FLOPs per element (mean, variance, normalise, scale and shift): a chosen count, the rates are fitted to it.
      f = 5 * output_elements(op);
      break;
    default:
      // 5 per element for softmax (max, subtract, exp, sum, divide), 1 otherwise: chosen counts, rates fitted to them.
      f = (is_softmax(b) ? 5 : 1) * output_elements(op);
  }
  return std::isfinite(f) ? f : 0;
}

double op_bytes(const OpRecord& op) {
  if (is_view(base_name(op.name)) || passes_through(op, base_name(op.name))) return 0;
  double total = 0;
  for (const std::vector<Value>* values : {&op.inputs, &op.outputs}) {
    for (const Value& v : *values) {
      for (const TensorMeta& m : v.tensors) total += m.dtype.empty() ? 0 : numel(m.shape) * dtype_size(m.dtype);
    }
  }
  return total;
}

namespace {
// The op computes in 16-bit floating point: its first floating-point input is float16 or bfloat16.
bool is_half(const OpRecord& op) {
  for (const Value& v : op.inputs) {
    for (const TensorMeta& m : v.tensors) {
      if (m.dtype == "float16" || m.dtype == "bfloat16") return true;
      if (m.dtype == "float32" || m.dtype == "float64") return false;
    }
  }
  return false;
}
}  // namespace

// Mirrors iteration_timing() (step_time.cpp): the same window, the same layers in the same order.
namespace {
// Adds an op's cost to the part of its kind and precision.
void add_part(std::vector<CostPart>& parts, size_t kind, bool half, double flops, double bytes) {
  auto part = std::find_if(parts.begin(), parts.end(), [&](const CostPart& p) {
    return p.kind == kLayerCostKinds[kind] && p.half == half;
  });
  if (part == parts.end()) part = parts.insert(parts.end(), CostPart{std::string(kLayerCostKinds[kind]), half});
  part->flops += flops;
  part->bytes += bytes;
  part->kernels += bytes > 0 ? 1 : 0;
}
}  // namespace

std::vector<LayerCost> layer_costs(const Trace& t) {
  const int64_t n = static_cast<int64_t>(t.ops.size());
  auto valid = [&](int64_t i) { return i >= 0 && i < n; };
  const std::vector<uint64_t> ends = iteration_ends(t);
  const uint64_t lo = ends.size() >= 2 ? ends[ends.size() - 2] : 0;
  const uint64_t hi = ends.empty() ? ~uint64_t{0} : ends.back();
  auto in_window = [&](const OpRecord& op) { return op.start_seq > lo && op.end_seq <= hi && op.complete; };

  Children children;
  for (int64_t i = 0; i < n; ++i) {
    if (valid(t.ops[i].parent) && t.ops[i].parent != i && in_window(t.ops[i])) children[t.ops[i].parent].push_back(i);
  }
  std::vector<LayerCost> out;
  std::vector<std::array<double, kLayerCostKinds.size()>> kind_flops;  // per layer: the largest op of each kind
  std::map<std::string, size_t> index;
  auto layer = [&](const std::string& name) -> size_t {
    auto [pos, added] = index.emplace(name, out.size());
    if (added) {
      out.push_back({});
      out.back().layer = name;
      kind_flops.push_back({});
    }
    return pos->second;
  };
  auto module_of_forward = [&](int64_t fwd) {
    return valid(fwd) && !t.ops[fwd].module.empty() ? t.ops[fwd].module : std::string(kOutside);
  };
  // An op's cost kind and FLOPs: its own, or (a composite with no formula) its heavy descendants'.
  auto op_cost = [&](int64_t i) {
    const OpRecord& op = t.ops[i];
    size_t kind = kind_index(op_cost_kind(op.name));
    double flops = op_flops(op);
    if (!heavy(kind) || flops == 0 || base_name(op.name) == "einsum") {
      double sum = 0, largest = 0;
      size_t inner = kind;
      heavy_descendants(t, children, i, 0, &sum, &largest, &inner);
      if (sum > 0) flops = sum, kind = inner;
    }
    return std::pair<size_t, double>{kind, flops};
  };
  // A forward op run again in backward: it records an autograd sequence number (it builds a graph, where backward's
  // own ops do not) and the op around it does not.
  auto records_graph = [&](const OpRecord& op) {
    return op.phase == Phase::Backward && op.scope == Scope::Function && op.seq_nr >= 0;
  };
  auto recomputed = [&](const OpRecord& op) {
    return records_graph(op) && op.name.rfind("aten::", 0) == 0 && !(valid(op.parent) && records_graph(t.ops[op.parent]));
  };
  for (int64_t i = 0; i < n; ++i) {
    const OpRecord& op = t.ops[i];
    if (!in_window(op) || is_optimizer_step(op)) continue;
    const bool top = op.parent < 0;
    if (op.phase == Phase::Forward && op.scope == Scope::Function && top) {
      const size_t l = layer(op.module.empty() ? kOutside : op.module);
      auto [kind, flops] = op_cost(i);
      const double bytes = op_bytes(op);
      out[l].ops += 1;
      out[l].flops += flops;
      out[l].bytes += bytes;
      kind_flops[l][kind] = std::max(kind_flops[l][kind], flops);
      add_part(out[l].parts, kind, is_half(op), flops, bytes);
    } else if (recomputed(op)) {
      const size_t l = layer(op.module.empty() ? module_of_forward(valid(op.bwd_node) ? t.ops[op.bwd_node].fwd_op : -1)
                                               : op.module);
      auto [kind, flops] = op_cost(i);
      add_part(out[l].recompute, kind, is_half(op), flops, op_bytes(op));
    } else if (op.phase == Phase::Backward && op.scope == Scope::BackwardFunction &&
               (top || (valid(op.parent) && t.ops[op.parent].scope != Scope::BackwardFunction))) {
      layer(module_of_forward(op.fwd_op));
    }
  }
  for (const Allocation& a : t.allocations) {
    if (a.category != Category::Gradient || !valid(a.alloc_op)) continue;
    const OpRecord& op = t.ops[a.alloc_op];
    if (op.start_seq <= lo || op.end_seq > hi) continue;
    const int64_t node = gradient_node(t, op);
    layer(module_of_forward(valid(node) ? t.ops[node].fwd_op : -1));
  }
  for (size_t l = 0; l < out.size(); ++l) {
    const auto& f = kind_flops[l];
    const double top = *std::max_element(f.begin(), f.end());
    const auto at_top = std::count(f.begin(), f.end(), top);
    const size_t k = top > 0 && at_top == 1 ? static_cast<size_t>(std::max_element(f.begin(), f.end()) - f.begin())
                                            : kElementwise;
    out[l].kind = std::string(kLayerCostKinds[k]);
  }
  return out;
}

// ---- Time model ---------------------------------------------------------------------------------------------

double roofline_ns(const LayerCost& c, const DeviceRates& r, Phase pass) {
  const double k = pass == Phase::Backward ? 2 : 1;
  const double compute = c.flops > 0 ? k * c.flops / r.flops_per_s : 0;
  const double memory = c.bytes > 0 ? k * c.bytes / r.bytes_per_s : 0;
  return 1e9 * (static_cast<double>(std::max<int64_t>(0, c.ops)) * r.op_overhead_s + std::max(compute, memory));
}

void LayerTimeModel::fit(const std::vector<LayerCost>& costs, const std::vector<LayerSample>& samples,
                         const DeviceRates& prior) {
  if (!(prior.flops_per_s > 0) || !std::isfinite(prior.flops_per_s)) {
    GPUCAST_USER_ERROR("layer time model: the prior's flops_per_s should be a positive number, got {}",
                       prior.flops_per_s);
  }
  if (!(prior.bytes_per_s > 0) || !std::isfinite(prior.bytes_per_s)) {
    GPUCAST_USER_ERROR("layer time model: the prior's bytes_per_s should be a positive number, got {}",
                       prior.bytes_per_s);
  }
  if (!(prior.op_overhead_s >= 0) || !std::isfinite(prior.op_overhead_s)) {
    GPUCAST_USER_ERROR("layer time model: the prior's op_overhead_s should be a number of at least 0, got {}",
                       prior.op_overhead_s);
  }
  // Per kind and pass: (layer, seconds).
  std::array<Measured, kLayerCostKinds.size()> fw, bw;
  Measured all_fw, all_bw;
  Measured heavy_fw, heavy_bw;  // matmul, conv and attention layers
  for (size_t s = 0; s < samples.size(); ++s) {
    const LayerSample& x = samples[s];
    if (x.index >= costs.size()) {
      GPUCAST_USER_ERROR("layer time model: sample {} has index {}, but there are {} layers", s, x.index,
                         costs.size());
    }
    const LayerCost& c = costs[x.index];
    if (c.ops <= 0 && !(c.flops > 0) && !(c.bytes > 0)) continue;  // nothing to price
    const size_t k = kind_index(c.kind);
    if (std::isfinite(x.forward_ns) && x.forward_ns > 0) {
      fw[k].emplace_back(&c, x.forward_ns / 1e9);
      all_fw.emplace_back(&c, x.forward_ns / 1e9);
      if (heavy(k)) heavy_fw.emplace_back(&c, x.forward_ns / 1e9);
    }
    if (std::isfinite(x.backward_ns) && x.backward_ns > 0) {
      bw[k].emplace_back(&c, x.backward_ns / 1e9);
      all_bw.emplace_back(&c, x.backward_ns / 1e9);
      if (heavy(k)) heavy_bw.emplace_back(&c, x.backward_ns / 1e9);
    }
  }
  prior_ = prior;
  fallback_ = {"fallback", fit_pass(all_fw, prior, Phase::Forward, "pooled", "scaled_prior"),
               fit_pass(all_bw, prior, Phase::Backward, "pooled", "scaled_prior")};
  // A FLOP-heavy kind without measurements falls back on the other heavy kinds only: rates fitted on
  // memory-bound layers (norms, pools, elementwise: few FLOPs, their time explained by a tiny FLOP rate) would
  // price a convolution's FLOPs orders of magnitude too slow.
  const KindFit heavy_fallback{"fallback", fit_pass(heavy_fw, prior, Phase::Forward, "pooled", "scaled_prior"),
                               fit_pass(heavy_bw, prior, Phase::Backward, "pooled", "scaled_prior")};
  for (size_t k = 0; k < kinds_.size(); ++k) {
    const KindFit& fb = heavy(k) ? heavy_fallback : fallback_;
    kinds_[k].kind = std::string(kLayerCostKinds[k]);
    kinds_[k].forward = fw[k].empty() ? fb.forward : fit_pass(fw[k], prior, Phase::Forward, "kind", "kind");
    kinds_[k].backward = bw[k].empty() ? fb.backward : fit_pass(bw[k], prior, Phase::Backward, "kind", "kind");
  }
  fitted_ = true;
}

const KindFit& LayerTimeModel::fit_for(std::string_view kind) const {
  if (!fitted_) GPUCAST_USER_ERROR("layer time model: fit() should be called before the model is used");
  const auto it = std::find(kLayerCostKinds.begin(), kLayerCostKinds.end(), kind);
  return it == kLayerCostKinds.end() ? fallback_ : kinds_[it - kLayerCostKinds.begin()];
}

LayerPrediction LayerTimeModel::predict(const LayerCost& c, const LayerCost* reach) const {
  const KindFit& k = fit_for(c.kind);
  std::string source =
      source_rank(k.forward.source) <= source_rank(k.backward.source) ? k.forward.source : k.backward.source;
  // A fit says nothing far beyond the work of the layers it saw: past kMaxExtrapolation times their largest
  // roofline work, the prior's rates price the work (the fitted per-op overhead kept).
  auto guarded = [&](const PassFit& f, Phase pass) {
    const DeviceRates work_only{prior_.flops_per_s, prior_.bytes_per_s, 0};
    const double work = roofline_ns(reach ? *reach : c, work_only, pass) / 1e9;
    if (f.source == "prior" || f.max_work_s <= 0 || work <= kMaxExtrapolation * f.max_work_s) {
      return roofline_ns(c, f.rates, pass);
    }
    source = "prior";
    return roofline_ns(c, DeviceRates{prior_.flops_per_s, prior_.bytes_per_s, f.rates.op_overhead_s}, pass);
  };
  const double fw = guarded(k.forward, Phase::Forward);
  const double bw = guarded(k.backward, Phase::Backward);
  return {fw, bw, source};
}

std::string LayerTimeModel::describe() const {
  if (!fitted_) return "layer time model: not fitted";
  std::string s = fmt::format("layer time model: prior {:.4g} Tflop/s, {:.4g} TB/s, {:.4g} us/op\n",
                              prior_.flops_per_s / 1e12, prior_.bytes_per_s / 1e12, prior_.op_overhead_s * 1e6);
  for (const KindFit& k : kinds_) {
    s += fmt::format("  {:<11} forward {}; backward {}\n", k.kind, rates_text(k.forward), rates_text(k.backward));
  }
  s += fmt::format("  {:<11} forward {}; backward {}\n", "(others)", rates_text(fallback_.forward),
                   rates_text(fallback_.backward));
  return s;
}

// ---- Which layers to time -----------------------------------------------------------------------------------

std::vector<double> design_row(const LayerCost& c) {
  std::vector<double> row(kLayerCostKinds.size() + 3, 0.0);
  row[kind_index(c.kind)] = 1;
  row[kLayerCostKinds.size()] = std::log1p(std::max(0.0, c.flops));
  row[kLayerCostKinds.size() + 1] = std::log1p(std::max(0.0, c.bytes));
  row[kLayerCostKinds.size() + 2] = std::log1p(static_cast<double>(std::max<int64_t>(0, c.ops)));
  return row;
}

double design_log_det(const std::vector<std::vector<double>>& candidates, const std::vector<size_t>& rows) {
  const size_t p = check_rows(candidates, "design_log_det");
  for (size_t r : rows) {
    if (r >= candidates.size()) {
      GPUCAST_USER_ERROR("design_log_det: row index {} is out of range: there are {} rows", r, candidates.size());
    }
  }
  return log_det_of(candidates, p, rows);
}

std::vector<size_t> d_optimal_design(const std::vector<std::vector<double>>& candidates, size_t k, uint64_t seed) {
  const size_t p = check_rows(candidates, "d_optimal_design");
  if (k >= candidates.size()) {
    std::vector<size_t> all(candidates.size());
    std::iota(all.begin(), all.end(), size_t{0});
    return all;
  }
  if (k == 0) return {};
  return fedorov(candidates, p, k, seed, {});
}

std::vector<size_t> random_design(size_t n, size_t k, uint64_t seed) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), size_t{0});
  if (k >= n) return idx;
  Rng rng(seed);
  for (size_t i = 0; i < k; ++i) std::swap(idx[i], idx[i + rng.below(n - i)]);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<size_t> choose_layers_to_time(const std::vector<LayerCost>& costs, double fraction, uint64_t seed) {
  if (!(fraction > 0 && fraction <= 1)) GPUCAST_USER_ERROR("time_fraction should be in (0, 1], got {}", fraction);
  const size_t n = costs.size();
  if (n == 0) return {};
  // 1e-9 below: 0.1 * 30 is 3.0000000000000004 in floating point, and should ask for 3 layers.
  const double wanted = std::ceil(fraction * static_cast<double>(n) - 1e-9);
  const size_t k = std::min(n, std::max<size_t>(1, static_cast<size_t>(wanted)));
  std::vector<size_t> out;
  if (k == n) {
    out.resize(n);
    std::iota(out.begin(), out.end(), size_t{0});
    return out;
  }
  // Each kind's layers, and its costliest (most FLOPs, then bytes) first among them.
  std::map<size_t, std::vector<size_t>> by_kind;
  for (size_t i = 0; i < n; ++i) by_kind[kind_index(costs[i].kind)].push_back(i);
  auto costlier = [&](size_t a, size_t b) {
    return costs[a].flops > costs[b].flops || (costs[a].flops == costs[b].flops && costs[a].bytes > costs[b].bytes);
  };
  for (auto& [kind, members] : by_kind) std::stable_sort(members.begin(), members.end(), costlier);
  // The budget over the kinds: one layer each (fewer layers than kinds: the kinds with the most layers, then the
  // costliest), the rest by largest remainder of the kinds' shares of the layers.
  std::vector<std::vector<size_t>*> kinds;
  for (auto& [kind, members] : by_kind) kinds.push_back(&members);
  std::stable_sort(kinds.begin(), kinds.end(), [&](const auto* a, const auto* b) {
    if (a->size() != b->size()) return a->size() > b->size();
    return costlier(a->front(), b->front());
  });
  std::vector<size_t> alloc(kinds.size(), 0);
  size_t left = k;
  for (size_t j = 0; j < kinds.size() && left > 0; ++j) alloc[j] = 1, --left;
  while (left > 0) {
    size_t best = kinds.size();
    double best_gap = 0;
    for (size_t j = 0; j < kinds.size(); ++j) {
      const double size = static_cast<double>(kinds[j]->size());
      if (alloc[j] >= kinds[j]->size()) continue;
      const double gap = size / static_cast<double>(n) * static_cast<double>(k) - static_cast<double>(alloc[j]);
      if (best == kinds.size() || gap > best_gap) best = j, best_gap = gap;
    }
    ++alloc[best], --left;  // some kind has room: k < n
  }
  // Within each kind, a D-optimal design for that kind's model over design_row() (its kind column is the
  // intercept there, the other kinds' columns zero), its costliest layer kept.
  for (size_t j = 0; j < kinds.size(); ++j) {
    const std::vector<size_t>& members = *kinds[j];
    if (alloc[j] == 0) continue;
    if (alloc[j] >= members.size()) {
      out.insert(out.end(), members.begin(), members.end());
      continue;
    }
    Rows rows;
    for (size_t i : members) rows.push_back(design_row(costs[i]));
    for (size_t r : fedorov(rows, check_rows(rows, "choose_layers_to_time"), alloc[j], seed, {0})) {
      out.push_back(members[r]);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace gpucast
