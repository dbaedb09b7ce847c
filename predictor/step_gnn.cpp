// ScaleDL's step-time graph network: LibTorch nn, trained by `gpucast-train step-gnn`, loaded by the plugin.
#include "gpucast/step_gnn.h"

#include "gpucast/shipped_data.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "feature_stats.h"
#include "weights_cache.h"

namespace gpucast {
namespace {

using nlohmann::json;
namespace nn = torch::nn;

const std::vector<std::string> kKinds = {"matmul", "conv", "attention", "norm", "embedding", "pool", "elementwise",
                                         "other"};
const std::vector<std::string> kOptimizers = {"sgd", "adam", "adamw", "other"};
const std::vector<std::string> kStrategies = {"single", "ddp", "fsdp", "tp", "pp"};
constexpr int kNodeFeatures = 8 + 3;      // kind one-hot, log1p(flops), log1p(bytes), log1p(pred_us)
constexpr int kEdgeFeatures = 1;          // log1p(bytes)
constexpr int kGlobalFeatures = 2 + 4 + 1 + 5 + 4;
// Where log_peak_gflops and log_mem_gbps lie among the global features (log_mem_gbps follows).
constexpr int kRateFeature = 2 + 4 + 1 + 5;
// The device rates are measured in the process (a matmul and a copy): on one machine they move by about 10 %
// between processes (100 and 110 GFLOP/s in two recordings of the dataset). Standardised over recordings from one
// machine, that noise would span several standard deviations, and the network and its applicability would read a
// rate measured a little higher as another machine: their standard deviation is taken as at least ln(2)/2 (a
// factor of 2 in rate is two of them).
constexpr float kRateSdFloor = 0.34657359f;
// 1.5: a chosen bound, alpha and beta within e^-1.5 to e^1.5 (0.22x to 4.5x).
constexpr double kLogScale = 1.5;         // log alpha, log beta = kLogScale * tanh(output)
constexpr const char* kFix = "; retrain with gpucast-train step-gnn or reinstall gpucast to get the shipped weights";

int index_of(const std::vector<std::string>& xs, const std::string& x) {
  auto it = std::find(xs.begin(), xs.end(), x);
  return it == xs.end() ? -1 : static_cast<int>(it - xs.begin());
}

std::vector<std::string> node_feature_names() {
  std::vector<std::string> n;
  for (const auto& k : kKinds) n.push_back("kind_" + k);
  n.insert(n.end(), {"log1p_flops", "log1p_bytes", "log1p_pred_us"});
  return n;
}

std::vector<std::string> global_feature_names() {
  std::vector<std::string> n = {"log_batch", "log_threads"};
  for (const auto& o : kOptimizers) n.push_back("opt_" + o);
  n.emplace_back("log_world");
  for (const auto& s : kStrategies) n.push_back("strategy_" + s);
  n.insert(n.end(), {"log_peak_gflops", "log_mem_gbps", "log1p_sum_layers_ms", "log1p_comm_ms"});
  return n;
}

// ---- Parsing --------------------------------------------------------------------------------------------------

class Reader {
 public:
  explicit Reader(const std::string& where) : where_(where) {}

  const json* find(const json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }
  const json& need(const json& obj, const char* key, const std::string& path, const char* expected) const {
    const json* v = find(obj, key);
    if (v == nullptr) GPUCAST_USER_ERROR("{}: {}: missing (expected {})", where_, path, expected);
    return *v;
  }
  [[noreturn]] void bad(const std::string& path, const char* expected, const json& got) const {
    GPUCAST_USER_ERROR("{}: {}: expected {}, got {}", where_, path, expected, json_excerpt(got));
  }
  double number(const json& v, const std::string& path, const char* expected) const {
    if (!v.is_number()) bad(path, expected, v);
    return v.get<double>();
  }
  int64_t integer(const json& v, const std::string& path, const char* expected) const {
    if (v.is_number_integer()) return v.get<int64_t>();
    // 32.0 is 32: benchmark scripts write whatever their language writes.
    if (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>() && std::abs(v.get<double>()) < 9e15) {
      return static_cast<int64_t>(v.get<double>());
    }
    bad(path, expected, v);
  }
  std::string string(const json& v, const std::string& path, const char* expected) const {
    if (!v.is_string()) bad(path, expected, v);
    return v.get<std::string>();
  }
  // The field `key` of `obj`, required.
  double number_at(const json& obj, const char* key, const std::string& path, const char* expected) const {
    return number(need(obj, key, path, expected), path, expected);
  }
  int64_t integer_at(const json& obj, const char* key, const std::string& path, const char* expected) const {
    return integer(need(obj, key, path, expected), path, expected);
  }
  std::string string_at(const json& obj, const char* key, const std::string& path, const std::string& expected) const {
    return string(need(obj, key, path, expected.c_str()), path, expected.c_str());
  }

 private:
  const std::string& where_;
};

std::string quoted_list(const std::vector<std::string>& xs) { return fmt::format("\"{}\"", fmt::join(xs, "\", \"")); }

void check_name(const std::string& where, const std::string& path, const std::string& value,
                const std::vector<std::string>& known, const char* what) {
  if (index_of(known, value) < 0) {
    GPUCAST_USER_ERROR("{}: {}: \"{}\" is not a known {}; known {}s: {} (write \"other\" for any other)", where, path,
                       value, what, what, quoted_list(known));
  }
}

void check_number(const std::string& where, const std::string& path, double v, bool positive) {
  if (!std::isfinite(v) || (positive ? v <= 0 : v < 0)) {
    GPUCAST_USER_ERROR("{}: {}: expected a finite number {} 0, got {}", where, path, positive ? ">" : ">=", v);
  }
}

void check_count(const std::string& where, const std::string& path, int64_t v) {
  if (v < 1) GPUCAST_USER_ERROR("{}: {}: expected an integer >= 1, got {}", where, path, v);
  if (v > (int64_t{1} << 40)) GPUCAST_USER_ERROR("{}: {}: {} is not a plausible count (at most 2^40)", where, path, v);
}

}  // namespace

void validate_step_graph(const StepGraph& g, const std::string& where) {
  const int64_t n = static_cast<int64_t>(g.nodes.size());
  if (n == 0) GPUCAST_USER_ERROR("{}: nodes: empty; a step graph needs at least one layer", where);
  if (n > kMaxStepGraphNodes) {
    GPUCAST_USER_ERROR("{}: nodes: {} layers; the step-time network reads at most {}", where, n, kMaxStepGraphNodes);
  }
  if (static_cast<int64_t>(g.edges.size()) > kMaxStepGraphEdges) {
    GPUCAST_USER_ERROR("{}: edges: {} edges; the step-time network reads at most {}", where, g.edges.size(),
                       kMaxStepGraphEdges);
  }
  for (int64_t i = 0; i < n; ++i) {
    const StepNode& x = g.nodes[i];
    const std::string p = fmt::format("nodes[{}]", i);
    check_name(where, p + ".kind", x.kind, kKinds, "kind");
    check_number(where, p + ".flops", x.flops, false);
    check_number(where, p + ".bytes", x.bytes, false);
    check_number(where, p + ".pred_ms", x.pred_ms, false);
  }
  for (size_t i = 0; i < g.edges.size(); ++i) {
    const StepEdge& e = g.edges[i];
    for (const auto& [end, node] : {std::pair<const char*, int64_t>{"src", e.src}, {"dst", e.dst}}) {
      if (node < 0 || node >= n) {
        GPUCAST_USER_ERROR("{}: edges[{}]: {} {} is not a node ({} nodes)", where, i, end, node, n);
      }
    }
    if (e.src == e.dst) {
      GPUCAST_USER_ERROR("{}: edges[{}]: src and dst are both {}; a layer does not feed itself (self-loops are "
                         "implied)", where, i, e.src);
    }
    check_number(where, fmt::format("edges[{}] bytes", i), e.bytes, false);
  }
  const StepGlobals& gl = g.globals;
  check_count(where, "global.batch", gl.batch);
  check_count(where, "global.threads", gl.threads);
  check_count(where, "global.world", gl.world);
  check_name(where, "global.optimizer", gl.optimizer, kOptimizers, "optimizer");
  check_name(where, "global.strategy", gl.strategy, kStrategies, "strategy");
  check_number(where, "global.peak_gflops", gl.peak_gflops, true);
  check_number(where, "global.mem_gbps", gl.mem_gbps, true);
  check_number(where, "sum_layers_ms", g.sum_layers_ms, false);
  check_number(where, "comm_ms", g.comm_ms, false);
  if (g.sum_layers_ms + g.comm_ms <= 0) {
    GPUCAST_USER_ERROR("{}: sum_layers_ms and comm_ms are both 0; the forecast scales them, so one must be > 0", where);
  }
  if (g.measured_ms != -1) check_number(where, "measured_ms", g.measured_ms, true);
}

StepGraph step_graph_from_json(const std::string& text, const std::string& where) {
  const json j = parse_json_input(text, where);
  if (!j.is_object()) GPUCAST_USER_ERROR("{}: expected a JSON object (one step graph), got {}", where, j.type_name());
  const Reader r(where);
  StepGraph g;
  if (const json* v = r.find(j, "family"); v != nullptr && !v->is_null()) g.family = r.string(*v, "family", "a string");
  if (const json* v = r.find(j, "model"); v != nullptr && !v->is_null()) g.model = r.string(*v, "model", "a string");

  const json& gl = r.need(j, "global", "global", "an object");
  if (!gl.is_object()) r.bad("global", "an object", gl);
  g.globals.batch = r.integer_at(gl, "batch", "global.batch", "an integer >= 1");
  g.globals.threads = r.integer_at(gl, "threads", "global.threads", "an integer >= 1");
  g.globals.world = r.integer_at(gl, "world", "global.world", "an integer >= 1");
  g.globals.optimizer = r.string_at(gl, "optimizer", "global.optimizer", "one of " + quoted_list(kOptimizers));
  g.globals.strategy = r.string_at(gl, "strategy", "global.strategy", "one of " + quoted_list(kStrategies));
  g.globals.peak_gflops = r.number_at(gl, "peak_gflops", "global.peak_gflops", "a number > 0");
  g.globals.mem_gbps = r.number_at(gl, "mem_gbps", "global.mem_gbps", "a number > 0");

  const json& nodes = r.need(j, "nodes", "nodes", "an array of layers");
  if (!nodes.is_array()) r.bad("nodes", "an array of layers", nodes);
  g.nodes.reserve(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    const std::string p = fmt::format("nodes[{}]", i);
    const json& x = nodes[i];
    if (!x.is_object()) r.bad(p, "an object {\"kind\", \"flops\", \"bytes\", \"pred_ms\"}", x);
    StepNode node;
    node.kind = r.string_at(x, "kind", p + ".kind", "one of " + quoted_list(kKinds));
    node.flops = r.number_at(x, "flops", p + ".flops", "a number >= 0");
    node.bytes = r.number_at(x, "bytes", p + ".bytes", "a number >= 0");
    node.pred_ms = r.number_at(x, "pred_ms", p + ".pred_ms", "a number >= 0");
    g.nodes.push_back(std::move(node));
  }
  const json& edges = r.need(j, "edges", "edges", "an array of [src, dst, bytes]");
  if (!edges.is_array()) r.bad("edges", "an array of [src, dst, bytes]", edges);
  g.edges.reserve(edges.size());
  for (size_t i = 0; i < edges.size(); ++i) {
    const std::string p = fmt::format("edges[{}]", i);
    const json& e = edges[i];
    if (!e.is_array() || e.size() != 3) r.bad(p, "[src, dst, bytes]", e);
    g.edges.push_back({r.integer(e[0], p + " src", "a node index"), r.integer(e[1], p + " dst", "a node index"),
                       r.number(e[2], p + " bytes", "a number >= 0")});
  }
  g.sum_layers_ms = r.number_at(j, "sum_layers_ms", "sum_layers_ms", "a number >= 0");
  g.comm_ms = r.number_at(j, "comm_ms", "comm_ms", "a number >= 0");
  if (const json* v = r.find(j, "measured_ms"); v != nullptr && !v->is_null()) {
    g.measured_ms = r.number(*v, "measured_ms", "a number > 0 or null");
    if (g.measured_ms == -1) r.bad("measured_ms", "a number > 0 or null", *v);
  }
  validate_step_graph(g, where);
  return g;
}

// ---- The network ----------------------------------------------------------------------------------------------
namespace {

// Widths: chosen defaults (no recorded sweep), as StepGnnTrainOptions::d_model.
struct StepGnnConfig {
  int64_t d_model = 32;
  int64_t heads = 4;
  int64_t head_hidden = 64;
};

// One TransformerConv-style layer: for each edge src -> dst, query from h_dst, key and value from h_src plus a
// projection of the edge's features; softmax over each node's incoming edges (self-loops, which carry no edge
// term, come after the real edges in src/dst); residual + LayerNorm.
struct GraphAttentionImpl : nn::Module {
  GraphAttentionImpl(int64_t d, int64_t heads) : d(d), heads(heads) {
    query = register_module("query", nn::Linear(d, d));
    key_value = register_module("key_value", nn::Linear(d, 2 * d));  // one gather for both
    edge = register_module("edge", nn::Linear(kEdgeFeatures, d));
    out = register_module("out", nn::Linear(d, d));
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({d})));
  }

  // h: [N, d]; e: [E, kEdgeFeatures] for the real edges; src, dst: [E + N] int64.
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& e, const torch::Tensor& src,
                        const torch::Tensor& dst) {
    const int64_t n = h.size(0), dh = d / heads;
    const torch::Tensor edge_term = torch::cat({edge(e), torch::zeros({n, d}, h.options())}, 0).repeat({1, 2});
    const torch::Tensor q = query(h).index_select(0, dst).view({-1, heads, dh});
    const torch::Tensor kv = key_value(h).index_select(0, src) + edge_term;  // [E + N, 2d]: key, then value
    const torch::Tensor k = kv.narrow(1, 0, d).reshape({-1, heads, dh});
    const torch::Tensor v = kv.narrow(1, d, d).reshape({-1, heads, dh});
    const torch::Tensor s = (q * k).sum(-1) / std::sqrt(static_cast<double>(dh));  // [E + N, heads]
    // Softmax per destination; the shift is only for range, so it carries no gradient.
    const torch::Tensor dst_h = dst.unsqueeze(1).expand({-1, heads});
    const torch::Tensor shift = torch::full({n, heads}, -1e30, h.options())
                                    .scatter_reduce(0, dst_h, s.detach(), "amax", /*include_self=*/true);
    const torch::Tensor ex = (s - shift.index_select(0, dst)).exp();
    const torch::Tensor den = torch::zeros({n, heads}, h.options()).index_add(0, dst, ex);
    const torch::Tensor a = ex / den.index_select(0, dst);
    const torch::Tensor agg = torch::zeros({n, heads, dh}, h.options()).index_add(0, dst, a.unsqueeze(-1) * v);
    return norm(h + out(agg.view({n, d})));
  }

  int64_t d, heads;
  nn::Linear query{nullptr}, key_value{nullptr}, edge{nullptr}, out{nullptr};
  nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(GraphAttention);

// A batch of graphs as one disjoint graph.
struct GraphBatch {
  torch::Tensor x;           // [N, kNodeFeatures], standardised
  torch::Tensor e;           // [E, kEdgeFeatures], standardised, real edges only
  torch::Tensor src, dst;    // [E + N] int64: real edges, then one self-loop per node
  torch::Tensor node_graph;  // [N] int64
  torch::Tensor nodes;       // [B] float: nodes per graph
  torch::Tensor g;           // [B, kGlobalFeatures], standardised
  torch::Tensor sum_ms, comm_ms, log_measured;  // [B]
  int64_t graphs = 0;
};

struct NetImpl : nn::Module {
  explicit NetImpl(const StepGnnConfig& c) {
    const int64_t d = c.d_model;
    enc1 = register_module("enc1", nn::Linear(kNodeFeatures, d));
    enc2 = register_module("enc2", nn::Linear(d, d));
    conv1 = register_module("conv1", GraphAttention(d, c.heads));
    conv2 = register_module("conv2", GraphAttention(d, c.heads));
    glob1 = register_module("glob1", nn::Linear(kGlobalFeatures, d));
    glob2 = register_module("glob2", nn::Linear(d, d));
    head1 = register_module("head1", nn::Linear(3 * d, c.head_hidden));
    head2 = register_module("head2", nn::Linear(c.head_hidden, 2));
    // Start at alpha = beta = 1: the network learns a correction to the summed layer and communication times.
    torch::NoGradGuard ng;
    head2->weight.zero_();
    head2->bias.zero_();
  }

  // Returns [B, 2]: log alpha, log beta.
  torch::Tensor forward(const GraphBatch& b) {
    torch::Tensor h = enc2(torch::relu(enc1(b.x)));
    h = conv1(h, b.e, b.src, b.dst);
    h = conv2(h, b.e, b.src, b.dst);
    const int64_t d = h.size(1);
    const torch::Tensor mean = torch::zeros({b.graphs, d}).index_add(0, b.node_graph, h) / b.nodes.unsqueeze(1);
    const torch::Tensor mx = torch::zeros({b.graphs, d})
                                 .scatter_reduce(0, b.node_graph.unsqueeze(1).expand({-1, d}), h, "amax",
                                                 /*include_self=*/false);
    const torch::Tensor glob = torch::relu(glob2(torch::relu(glob1(b.g))));
    const torch::Tensor z = torch::cat({mean, mx, glob}, 1);
    return kLogScale * torch::tanh(head2(torch::relu(head1(z))));
  }

  nn::Linear enc1{nullptr}, enc2{nullptr}, glob1{nullptr}, glob2{nullptr}, head1{nullptr}, head2{nullptr};
  GraphAttention conv1{nullptr}, conv2{nullptr};
};
TORCH_MODULE(Net);

// Networks trained alike from different seeds; the correction is the mean of their log alpha and log beta (an
// ensemble: on gpucast's step dataset one network's error moves by a point with the seed, the mean's less).
struct EnsembleImpl : nn::Module {
  EnsembleImpl(const StepGnnConfig& c, int64_t n) {
    for (int64_t k = 0; k < n; ++k) members.push_back(register_module(fmt::format("m{}", k), Net(c)));
  }
  torch::Tensor forward(const GraphBatch& b) {
    std::vector<torch::Tensor> outs;
    for (Net& m : members) outs.push_back(m->forward(b));
    return torch::stack(outs).mean(0);
  }
  std::vector<Net> members;
};
TORCH_MODULE(Ensemble);

float lg1p(double x) { return static_cast<float>(std::log1p(std::max(0.0, x))); }

// Unstandardised features of one graph.
struct GraphFeatures {
  std::vector<float> node;    // nodes x kNodeFeatures
  std::vector<float> edge;    // edges x kEdgeFeatures
  std::vector<int64_t> src, dst;
  std::vector<float> global;  // kGlobalFeatures
  int64_t nodes = 0;
  double sum_ms = 0, comm_ms = 0, measured_ms = -1;
};

GraphFeatures features_of(const StepGraph& g) {
  GraphFeatures f;
  f.nodes = static_cast<int64_t>(g.nodes.size());
  f.node.reserve(g.nodes.size() * kNodeFeatures);
  for (const StepNode& x : g.nodes) {
    const int k = index_of(kKinds, x.kind);
    for (int j = 0; j < static_cast<int>(kKinds.size()); ++j) f.node.push_back(j == k ? 1.f : 0.f);
    f.node.insert(f.node.end(), {lg1p(x.flops), lg1p(x.bytes), lg1p(x.pred_ms * 1000.0)});
  }
  for (const StepEdge& e : g.edges) {
    f.edge.push_back(lg1p(e.bytes));
    f.src.push_back(e.src);
    f.dst.push_back(e.dst);
  }
  const StepGlobals& gl = g.globals;
  auto lg = [](double x) { return static_cast<float>(std::log(x)); };
  f.global = {lg(double(gl.batch)), lg(double(gl.threads))};
  const int o = index_of(kOptimizers, gl.optimizer);
  for (int j = 0; j < static_cast<int>(kOptimizers.size()); ++j) f.global.push_back(j == o ? 1.f : 0.f);
  f.global.push_back(lg(double(gl.world)));
  const int s = index_of(kStrategies, gl.strategy);
  for (int j = 0; j < static_cast<int>(kStrategies.size()); ++j) f.global.push_back(j == s ? 1.f : 0.f);
  f.global.insert(f.global.end(), {lg(gl.peak_gflops), lg(gl.mem_gbps), lg1p(g.sum_layers_ms), lg1p(g.comm_ms)});
  f.sum_ms = g.sum_layers_ms;
  f.comm_ms = g.comm_ms;
  f.measured_ms = g.measured_ms;
  return f;
}

struct Normaliser {
  std::vector<float> node_mean, node_std, edge_mean, edge_std, global_mean, global_std;

  // floor: columns whose standard deviation is taken as at least kRateSdFloor (the device rates').
  static void stats(const std::vector<const std::vector<float>*>& rows, int width, std::vector<float>& mean,
                    std::vector<float>& sd, std::initializer_list<int> floor = {}) {
    detail::column_stats(rows, width, mean, sd);
    for (int j : floor) sd[j] = std::max(sd[j], kRateSdFloor);
  }

  static Normaliser fit(const std::vector<GraphFeatures>& fs) {
    Normaliser n;
    std::vector<const std::vector<float>*> nodes, edges, globals;
    for (const auto& f : fs) {
      nodes.push_back(&f.node);
      edges.push_back(&f.edge);
      globals.push_back(&f.global);
    }
    stats(nodes, kNodeFeatures, n.node_mean, n.node_std);
    stats(edges, kEdgeFeatures, n.edge_mean, n.edge_std);
    stats(globals, kGlobalFeatures, n.global_mean, n.global_std, {kRateFeature, kRateFeature + 1});
    return n;
  }
};

// Where a graph lies, for the network's applicability: its global features, its nodes' mean features and the log
// of its node count.
constexpr int kDescriptor = kGlobalFeatures + kNodeFeatures + 1;

std::vector<float> descriptor_of(const GraphFeatures& f) {
  std::vector<float> d(f.global);
  std::vector<double> mean(kNodeFeatures, 0.0);
  for (int64_t i = 0; i < f.nodes; ++i) {
    for (int j = 0; j < kNodeFeatures; ++j) mean[j] += f.node[i * kNodeFeatures + j];
  }
  for (int j = 0; j < kNodeFeatures; ++j) d.push_back(static_cast<float>(f.nodes ? mean[j] / f.nodes : 0.0));
  d.push_back(static_cast<float>(std::log(std::max<int64_t>(f.nodes, 1))));
  return d;
}

// What makes graphs recordings of the same case (one model at one batch, thread count, world, optimizer and
// strategy, measured again on another day): "" for a graph without a model name, which is a case of its own.
std::string case_key(const StepGraph& g) {
  if (g.model.empty()) return {};
  return fmt::format("{}|{}|{}|{}|{}|{}|{}", g.family, g.model, g.globals.batch, g.globals.threads, g.globals.world,
                     g.globals.optimizer, g.globals.strategy);
}

// The training graphs' standardised descriptors and their radius: the largest distance from one of them to its
// nearest graph of another case (-1 with fewer than two cases: no limit). Recordings of one case lie next to each
// other; measured from them, the radius would shrink to their spread and leave out steps like the training ones.
struct Applicability {
  std::vector<float> mean, sd;
  std::vector<float> points;  // graphs x kDescriptor, standardised
  double radius = -1;
  std::vector<int64_t> batches;  // the training graphs' batch sizes, ascending (empty: not recorded)

  int64_t count() const { return static_cast<int64_t>(points.size()) / kDescriptor; }

  std::vector<float> standardise(const std::vector<float>& d) const {
    std::vector<float> z(kDescriptor);
    for (int j = 0; j < kDescriptor; ++j) z[j] = (d[j] - mean[j]) / sd[j];
    return z;
  }

  // Distance from z to the nearest stored point for which skip(i) is false (infinity: none).
  template <typename Skip>
  double nearest(const float* z, Skip skip) const {
    double best = std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < count(); ++i) {
      if (skip(i)) continue;
      double s = 0;
      for (int j = 0; j < kDescriptor; ++j) {
        const double d = double(z[j]) - points[i * kDescriptor + j];
        s += d * d;
      }
      best = std::min(best, s);
    }
    return std::sqrt(best);
  }
  double nearest(const float* z) const {
    return nearest(z, [](int64_t) { return false; });
  }

  // keys: case_key of each graph of fs.
  static Applicability fit(const std::vector<GraphFeatures>& fs, const std::vector<std::string>& keys) {
    Applicability a;
    std::vector<std::vector<float>> ds;
    for (const auto& f : fs) ds.push_back(descriptor_of(f));
    std::vector<const std::vector<float>*> rows;
    for (const auto& d : ds) rows.push_back(&d);
    Normaliser::stats(rows, kDescriptor, a.mean, a.sd, {kRateFeature, kRateFeature + 1});  // globals lead
    for (const auto& d : ds) {
      const std::vector<float> z = a.standardise(d);
      a.points.insert(a.points.end(), z.begin(), z.end());
    }
    double radius = 0;
    bool other_case = false;
    for (int64_t i = 0; i < a.count(); ++i) {
      const double d = a.nearest(&a.points[i * kDescriptor], [&](int64_t j) {
        return j == i || (!keys[i].empty() && keys[j] == keys[i]);
      });
      if (std::isfinite(d)) {
        radius = std::max(radius, d);
        other_case = true;
      }
    }
    if (other_case) a.radius = radius;
    return a;
  }
};

// One graph's standardised tensors, ready to be concatenated into batches.
struct GraphTensors {
  torch::Tensor x, e, src, dst, g;
  int64_t nodes = 0;
  double sum_ms = 0, comm_ms = 0, measured_ms = -1;
};

torch::Tensor standardised(const std::vector<float>& v, int width, const std::vector<float>& mean,
                           const std::vector<float>& sd) {
  const int64_t rows = static_cast<int64_t>(v.size()) / width;
  torch::Tensor t = torch::empty({rows, width});
  float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int j = 0; j < width; ++j) p[i * width + j] = (v[i * width + j] - mean[j]) / sd[j];
  }
  return t;
}

GraphTensors tensors_of(const GraphFeatures& f, const Normaliser& n) {
  GraphTensors t;
  t.x = standardised(f.node, kNodeFeatures, n.node_mean, n.node_std);
  t.e = standardised(f.edge, kEdgeFeatures, n.edge_mean, n.edge_std);
  t.src = torch::tensor(f.src, torch::kInt64);
  t.dst = torch::tensor(f.dst, torch::kInt64);
  t.g = standardised(f.global, kGlobalFeatures, n.global_mean, n.global_std);
  t.nodes = f.nodes;
  t.sum_ms = f.sum_ms;
  t.comm_ms = f.comm_ms;
  t.measured_ms = f.measured_ms;
  return t;
}

GraphBatch make_batch(const std::vector<const GraphTensors*>& gs) {
  GraphBatch b;
  b.graphs = static_cast<int64_t>(gs.size());
  std::vector<torch::Tensor> xs, es, srcs, dsts, globals, node_graph;
  std::vector<double> nodes, sum_ms, comm_ms, log_measured;
  int64_t offset = 0;
  for (size_t i = 0; i < gs.size(); ++i) {
    const GraphTensors& t = *gs[i];
    xs.push_back(t.x);
    es.push_back(t.e);
    srcs.push_back(t.src + offset);
    dsts.push_back(t.dst + offset);
    globals.push_back(t.g);
    node_graph.push_back(torch::full({t.nodes}, static_cast<int64_t>(i), torch::kInt64));
    nodes.push_back(static_cast<double>(t.nodes));
    sum_ms.push_back(t.sum_ms);
    comm_ms.push_back(t.comm_ms);
    log_measured.push_back(t.measured_ms > 0 ? std::log(t.measured_ms) : 0.0);
    offset += t.nodes;
  }
  const torch::Tensor loops = torch::arange(offset, torch::kInt64);
  srcs.push_back(loops);
  dsts.push_back(loops);
  b.x = torch::cat(xs, 0);
  b.e = torch::cat(es, 0);
  b.src = torch::cat(srcs, 0);
  b.dst = torch::cat(dsts, 0);
  b.g = torch::cat(globals, 0);
  b.node_graph = torch::cat(node_graph, 0);
  b.nodes = torch::tensor(nodes, torch::kFloat32);
  b.sum_ms = torch::tensor(sum_ms, torch::kFloat32);
  b.comm_ms = torch::tensor(comm_ms, torch::kFloat32);
  b.log_measured = torch::tensor(log_measured, torch::kFloat32);
  return b;
}

// Squared error of log step time per graph: log(alpha * sum_layers_ms + beta * comm_ms) - log(measured_ms).
torch::Tensor squared_errors(const torch::Tensor& out, const GraphBatch& b) {
  const torch::Tensor pred = out.select(1, 0).exp() * b.sum_ms + out.select(1, 1).exp() * b.comm_ms;
  return (pred.log() - b.log_measured).pow(2);
}

json config_json(const StepGnnConfig& c) {
  return {{"d_model", c.d_model}, {"heads", c.heads}, {"head_hidden", c.head_hidden}, {"message_passing_layers", 2}};
}

}  // namespace

class StepGnn {
 public:
  StepGnn(StepGnnConfig c, int64_t members, Normaliser n, Applicability a, json info)
      : net(c, members), norm(std::move(n)), reach(std::move(a)), info(std::move(info)) {
    net->eval();
  }
  mutable Ensemble net;
  Normaliser norm;
  Applicability reach;
  json info;
  mutable std::mutex mu;  // one forward at a time per loaded model
};

std::shared_ptr<const StepGnn> load_step_gnn(const std::string& path) {
  const WeightsFile w = read_weights_file(path);
  const WeightsHeader header(w, path, kStepGnnName, kStepGnnVersion, kFix);
  auto field = [&](const char* key) -> const json& { return header.field(key); };
  StepGnnConfig c;
  Normaliser n;
  Applicability a;
  int64_t members = 0;
  try {
    members = field("members").get<int64_t>();
    const json& cj = field("config");
    c.d_model = cj.at("d_model").get<int64_t>();
    c.heads = cj.at("heads").get<int64_t>();
    c.head_hidden = cj.at("head_hidden").get<int64_t>();
    n.node_mean = field("node_mean").get<std::vector<float>>();
    n.node_std = field("node_std").get<std::vector<float>>();
    n.edge_mean = field("edge_mean").get<std::vector<float>>();
    n.edge_std = field("edge_std").get<std::vector<float>>();
    n.global_mean = field("global_mean").get<std::vector<float>>();
    n.global_std = field("global_std").get<std::vector<float>>();
  } catch (const json::exception& e) {
    GPUCAST_USER_ERROR("weights file '{}': bad header field ({}){}", path, e.what(), kFix);
  }
  try {
    const json& aj = field("applicability");
    a.mean = aj.at("mean").get<std::vector<float>>();
    a.sd = aj.at("std").get<std::vector<float>>();
    a.points = aj.at("points").get<std::vector<float>>();
    a.radius = aj.at("radius").get<double>();
    if (aj.contains("batches")) a.batches = aj.at("batches").get<std::vector<int64_t>>();
  } catch (const json::exception& e) {
    GPUCAST_USER_ERROR("weights file '{}': applicability: expected an object with number lists \"mean\", \"std\" "
                       "and \"points\", a number \"radius\" and optionally a list of integers \"batches\" ({}){}",
                       path, e.what(), kFix);
  }
  if (a.batches.size() > 4096 || !std::is_sorted(a.batches.begin(), a.batches.end()) ||
      std::any_of(a.batches.begin(), a.batches.end(), [](int64_t b) { return b < 1 || b > (int64_t{1} << 30); })) {
    GPUCAST_USER_ERROR("weights file '{}': applicability batches should be at most 4096 ascending batch sizes of 1 to "
                       "2^30{}", path, kFix);
  }
  if (c.d_model < 1 || c.d_model > 4096 || c.heads < 1 || c.d_model % c.heads != 0 || c.head_hidden < 1 ||
      c.head_hidden > 65536) {
    GPUCAST_USER_ERROR("weights file '{}': implausible model configuration {}{}", path, field("config").dump(), kFix);
  }
  if (members < 1 || members > kMaxStepGnnMembers) {
    GPUCAST_USER_ERROR("weights file '{}': members is {}, expected 1 to {}{}", path, members, kMaxStepGnnMembers, kFix);
  }
  auto check_norm = [&](const char* what, const std::vector<float>& mean, const std::vector<float>& sd, int width) {
    check_normalisation(path, what, mean, sd, static_cast<size_t>(width), kFix);
  };
  check_norm("node", n.node_mean, n.node_std, kNodeFeatures);
  check_norm("edge", n.edge_mean, n.edge_std, kEdgeFeatures);
  check_norm("global", n.global_mean, n.global_std, kGlobalFeatures);
  check_norm("applicability", a.mean, a.sd, kDescriptor);
  if (a.points.empty() || a.points.size() % kDescriptor != 0 ||
      !std::all_of(a.points.begin(), a.points.end(), [](float v) { return std::isfinite(v); })) {
    GPUCAST_USER_ERROR("weights file '{}': applicability points hold {} values, expected a positive multiple of {}, "
                       "all finite{}", path, a.points.size(), kDescriptor, kFix);
  }
  if (!std::isfinite(a.radius) || (a.radius < 0 && a.radius != -1)) {
    GPUCAST_USER_ERROR("weights file '{}': applicability radius is {}, expected at least 0, or -1 for no limit{}", path,
                       a.radius, kFix);
  }
  auto model = std::make_shared<StepGnn>(c, members, n, a, header.json().value("trained", json::object()));
  load_parameters(*model->net, w, path, kFix);
  return model;
}

StepCorrection step_correction(const StepGnn& model, const StepGraph& graph) {
  validate_step_graph(graph, "step graph");
  const GraphFeatures f = features_of(graph);
  StepCorrection c;
  c.distance = model.reach.nearest(model.reach.standardise(descriptor_of(f)).data());
  c.radius = model.reach.radius;
  c.trained_batches = model.reach.batches;
  if (c.radius >= 0 && c.distance > c.radius) {
    c.source = fmt::format("none: the step lies outside the graph network's training data (its descriptor {:.2f} from "
                           "the nearest training step's; no training step lies farther than {:.2f} from its nearest)",
                           c.distance, c.radius);
    return c;
  }
  const GraphTensors t = tensors_of(f, model.norm);
  {
    std::lock_guard<std::mutex> lock(model.mu);
    torch::NoGradGuard ng;
    const torch::Tensor out = model.net->forward(make_batch({&t}));
    c.alpha = std::exp(out[0][0].item<double>());
    c.beta = std::exp(out[0][1].item<double>());
  }
  if (!std::isfinite(c.alpha) || !std::isfinite(c.beta) || c.alpha <= 0 || c.beta <= 0) {
    // The output is bounded (kLogScale * tanh) for any finite weights; only a broken file gets here.
    c.alpha = c.beta = 1.0;
    c.source = "none: the graph network's answer is not a finite positive correction";
    return c;
  }
  c.source = "gnn";
  return c;
}

StepCorrection predict_step_correction(const StepGraph& graph, const std::string& weights_path) {
  validate_step_graph(graph, "step graph");  // the same input validation either way
  std::string why;
  if (weights_path.empty()) {
    why = "no weights file for the step-time graph network";
  } else {
    const auto model = cached_model<StepGnn>(weights_path, &load_step_gnn, &why);
    if (model) {
      try {
        return step_correction(*model, graph);
      } catch (const UserError&) {
        throw;  // the graph itself is bad: the caller must hear it
      } catch (const std::exception& e) {
        why = fmt::format("the step-time graph network failed ({})", e.what());
      }
    }
  }
  StepCorrection c;
  c.source = "none: " + why;
  return c;
}

std::string default_step_gnn_weights() { return shipped_data_file("GPUCAST_STEP_GNN_WEIGHTS", "step_gnn.gcw"); }

StepGraph forecast_step_graph(const StepTimeForecast& f, const std::vector<IterationTiming>& timings,
                              const StepCorrectionSettings& s) {
  if (timings.empty()) GPUCAST_USER_ERROR("step graph: no probe timings");
  size_t r = 0;
  for (size_t i = 1; i < timings.size(); ++i) {
    if (timings[i].batch > timings[r].batch) r = i;
  }
  const IterationTiming& ref = timings[r];
  if (ref.batch < 1) GPUCAST_USER_ERROR("step graph: the largest probe's batch is {}", ref.batch);
  const double scale = static_cast<double>(f.per_rank_batch) / static_cast<double>(ref.batch);
  StepGraph g;
  for (size_t i = 0; i < std::min(ref.layers.size(), f.per_layer.size()); ++i) {
    const LayerTiming& l = ref.layers[i];
    g.nodes.push_back({l.cost_kind, l.flops * scale, l.bytes * scale,
                       f.per_layer[i].forward_ms + f.per_layer[i].backward_ms});
  }
  for (const LayerEdge& e : ref.edges) g.edges.push_back({e.src, e.dst, static_cast<double>(e.bytes) * scale});
  const int64_t world = f.dp * f.tp * f.pp;
  g.globals = {f.batch_size, s.threads, s.optimizer, world,
               world == 1           ? "single"
               : f.pp > 1           ? "pp"
               : f.tp > 1           ? "tp"
               : f.dp_mode == "fsdp" ? "fsdp"
                                     : "ddp",
               s.peak_gflops, s.mem_gbps};
  g.sum_layers_ms = f.compute_ms;
  g.comm_ms = f.exposed_comm_ms;
  return g;
}

std::string step_graph_to_json(const StepGraph& g) {
  json nodes = json::array(), edges = json::array();
  for (const StepNode& n : g.nodes) {
    nodes.push_back({{"kind", n.kind}, {"flops", n.flops}, {"bytes", n.bytes}, {"pred_ms", n.pred_ms}});
  }
  for (const StepEdge& e : g.edges) edges.push_back({e.src, e.dst, e.bytes});
  const StepGlobals& x = g.globals;
  return json{{"family", g.family},
              {"model", g.model},
              {"global",
               {{"batch", x.batch}, {"threads", x.threads}, {"optimizer", x.optimizer}, {"world", x.world},
                {"strategy", x.strategy}, {"peak_gflops", x.peak_gflops}, {"mem_gbps", x.mem_gbps}}},
              {"nodes", nodes},
              {"edges", edges},
              {"sum_layers_ms", g.sum_layers_ms},
              {"comm_ms", g.comm_ms},
              {"measured_ms", g.measured_ms < 0 ? json() : json(g.measured_ms)}}
      .dump();
}

namespace {

// Why the network is not asked about f at all ("" where it is).
std::string outside_the_network(const StepTimeForecast& f, const StepCorrectionSettings& s, const std::string& path) {
  if (!s.enabled) return "none: disabled (gnn=None)";
  if (s.target != "cpu") return "none: the shipped graph network is trained on CPU steps only";
  if (s.seq_len > 0) return "none: the graph network is trained on steps at their probes' sequence length";
  std::string why;  // a file that does not load is said by predict_step_correction
  const auto model = path.empty() ? nullptr : cached_model<StepGnn>(path, &load_step_gnn, &why);
  if (model && !model->reach.batches.empty()) {
    const std::vector<int64_t>& b = model->reach.batches;
    const int64_t lo = b.front() / kStepGnnBatchReach, hi = b.back() * kStepGnnBatchReach;
    if (f.per_rank_batch < lo || f.per_rank_batch > hi) {
      return fmt::format("none: the graph network is trained on batch sizes {}; a rank's batch of {} is outside {}-{}",
                         fmt::join(b, ", "), f.per_rank_batch, lo, hi);
    }
  }
  if (f.per_layer.empty()) {
    return "none: no layer in the iteration (its forward and backward ran inside the optimizer's step?)";
  }
  return "";
}

}  // namespace

void correct_step_time(StepTimeForecast& f, const std::vector<IterationTiming>& timings,
                       const StepCorrectionSettings& s) {
  f.uncorrected_step_ms = f.step_ms;
  const std::string path = s.weights.empty() ? default_step_gnn_weights() : s.weights;
  if (std::string why = outside_the_network(f, s, path); !why.empty()) {
    f.correction = std::move(why);
    return;
  }
  StepGraph g = forecast_step_graph(f, timings, s);
  const int64_t world = f.dp * f.tp * f.pp;
  if (world > 1) {  // the rank's compute, asked as a single-process step
    g.globals.world = 1;
    g.globals.strategy = "single";
    g.globals.batch = f.per_rank_batch;
    g.comm_ms = 0.0;
  }
  const StepCorrection c = predict_step_correction(g, path);
  f.correction = c.source;
  if (c.source != "gnn") {
    f.notes.push_back(Note{"gnn-not-applied", fmt::format("graph network not applied ({}): alpha = beta = 1", c.source)});
    return;
  }
  f.alpha = c.alpha;
  f.beta = world == 1 ? c.beta : 1.0;
  f.step_ms = corrected_step_ms(f.step_ms, f.compute_ms, f.exposed_comm_ms, f.alpha, f.beta);
  f.compute_ms *= f.alpha;
  f.exposed_comm_ms *= f.beta;
  if (world > 1) {
    f.notes.push_back(Note{"gnn-rank-compute", "graph network: alpha from the rank's compute; beta = 1 (trained without communication)"});
  }
}

StepGnnTrainResult train_step_gnn(const std::vector<StepGraph>& train, const std::vector<StepGraph>& val,
                                  const StepGnnTrainOptions& o, const std::string& out_path) {
  if (train.empty() || val.empty()) {
    GPUCAST_USER_ERROR("gpucast-train step-gnn: need training and validation graphs, got {} and {}", train.size(),
                       val.size());
  }
  const auto t0 = std::chrono::steady_clock::now();
  torch::manual_seed(o.seed);
  if (o.threads > 0) torch::set_num_threads(o.threads);
  auto featurise = [](const std::vector<StepGraph>& gs, const char* split) {
    std::vector<GraphFeatures> fs;
    for (size_t i = 0; i < gs.size(); ++i) {
      const std::string where = fmt::format("{} graph {}", split, i);
      validate_step_graph(gs[i], where);
      if (gs[i].measured_ms <= 0) {
        GPUCAST_USER_ERROR("{}: measured_ms: missing; training needs the measured time", where);
      }
      fs.push_back(features_of(gs[i]));
    }
    return fs;
  };
  const std::vector<GraphFeatures> ftr = featurise(train, "training");
  const std::vector<GraphFeatures> fva = featurise(val, "validation");
  std::vector<GraphFeatures> fall = ftr;
  fall.insert(fall.end(), fva.begin(), fva.end());
  // With rotate_val every graph may train a member: the features are standardised over them all.
  const Normaliser norm = Normaliser::fit(o.rotate_val ? fall : ftr);
  std::vector<GraphTensors> tall;  // the training graphs, then the validation graphs
  for (const auto& f : fall) tall.push_back(tensors_of(f, norm));

  StepGnnConfig config;
  config.d_model = std::max<int64_t>(1, o.d_model);
  config.heads = std::gcd(config.d_model, int64_t{4});  // 4 heads where the width allows
  config.head_hidden = 2 * config.d_model;
  if (o.members < 1 || o.members > kMaxStepGnnMembers) {
    GPUCAST_USER_ERROR("gpucast-train step-gnn: --members expects 1 to {}, got {}", kMaxStepGnnMembers, o.members);
  }
  const size_t batch_size = static_cast<size_t>(std::max<int64_t>(1, o.batch_size));
  auto batches_of = [&](const std::vector<size_t>& idx) {
    std::vector<GraphBatch> out;
    for (size_t s = 0; s < idx.size(); s += batch_size) {
      std::vector<const GraphTensors*> part;
      for (size_t k = s; k < std::min(idx.size(), s + batch_size); ++k) part.push_back(&tall[idx[k]]);
      out.push_back(make_batch(part));
    }
    return out;
  };
  auto range = [](size_t from, size_t to) {
    std::vector<size_t> idx(to - from);
    std::iota(idx.begin(), idx.end(), from);
    return idx;
  };
  auto mean_loss = [&](auto& net, const std::vector<GraphBatch>& batches, size_t count) {
    torch::NoGradGuard ng;
    net->eval();
    double se = 0;
    for (const GraphBatch& b : batches) se += squared_errors(net->forward(b), b).sum().template item<double>();
    return se / static_cast<double>(count);
  };
  // The graphs each member trains and stops on: the files' split, or with rotate_val the k-th tenth of all the
  // cases (in an order drawn from the seed; every recording of a case on the same side) for member k's early
  // stopping and the rest for its training.
  std::vector<std::string> keys;
  for (const auto* gs : {&train, &val}) {
    for (const StepGraph& g : *gs) keys.push_back(case_key(g));
  }
  std::vector<std::vector<size_t>> cases;  // each case's graphs, the cases in order of first appearance
  {
    std::map<std::string, size_t> seen;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto [it, fresh] = seen.emplace(keys[i], cases.size());
      if (keys[i].empty() || fresh) {
        cases.push_back({i});
      } else {
        cases[it->second].push_back(i);
      }
    }
  }
  std::vector<size_t> pool = range(0, cases.size());  // the cases' order
  std::shuffle(pool.begin(), pool.end(), std::mt19937_64(o.seed));
  auto split_of = [&](int64_t k) -> std::pair<std::vector<size_t>, std::vector<size_t>> {
    if (!o.rotate_val) return {range(0, ftr.size()), range(ftr.size(), tall.size())};
    const size_t n = pool.size(), part = static_cast<size_t>(k % 10);
    const size_t lo = n * part / 10, hi = std::max(lo + 1, n * (part + 1) / 10);
    std::vector<size_t> fit, held;
    for (size_t i = 0; i < n; ++i) {
      for (size_t g : cases[pool[i]]) (i >= lo && i < hi ? held : fit).push_back(g);
    }
    return {fit, held};
  };

  // Each member from its own seed (o.seed + k): initial weights and the order of the training graphs.
  StepGnnTrainResult r;
  Ensemble ensemble(config, o.members);
  json members = json::array();
  double held_out_se = 0;
  size_t held_out = 0;
  for (int64_t k = 0; k < o.members; ++k) {
    const uint64_t seed = o.seed + static_cast<uint64_t>(k);
    const auto [fit_idx, val_idx] = split_of(k);
    const std::vector<GraphBatch> val_batches = batches_of(val_idx);
    torch::manual_seed(seed);
    Net net(config);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
    std::mt19937_64 rng(seed);
    double best_val = mean_loss(net, val_batches, val_idx.size());
    int64_t best_epoch = 0, epochs = 0;
    std::vector<torch::Tensor> best;
    for (const auto& p : net->parameters()) best.push_back(p.detach().clone());
    std::vector<size_t> order = fit_idx;
    for (int64_t epoch = 1; epoch <= o.max_epochs; ++epoch) {
      net->train();
      std::shuffle(order.begin(), order.end(), rng);
      double train_se = 0;
      for (const GraphBatch& b : batches_of(order)) {
        opt.zero_grad();
        torch::Tensor loss = squared_errors(net->forward(b), b).mean();
        loss.backward();
        nn::utils::clip_grad_norm_(net->parameters(), 1.0);
        opt.step();
        train_se += loss.item<double>() * static_cast<double>(b.graphs);
      }
      const double v = mean_loss(net, val_batches, val_idx.size());
      epochs = epoch;
      if (o.verbose) {
        std::fprintf(stderr, "member %ld epoch %3ld  train mse(log) %.5f  val mse(log) %.5f%s\n", static_cast<long>(k),
                     static_cast<long>(epoch), train_se / static_cast<double>(order.size()), v,
                     v < best_val ? "  *" : "");
      }
      if (v < best_val) {
        best_val = v;
        best_epoch = epoch;
        size_t i = 0;
        for (const auto& p : net->parameters()) best[i++].copy_(p.detach());
      } else if (epoch - best_epoch >= o.patience) {
        break;
      }
    }
    {
      torch::NoGradGuard ng;
      size_t i = 0;
      for (auto& p : ensemble->members[k]->parameters()) p.copy_(best[i++]);
    }
    r.epochs = std::max(r.epochs, epochs);
    r.best_epoch = std::max(r.best_epoch, best_epoch);
    held_out_se += best_val * static_cast<double>(val_idx.size());
    held_out += val_idx.size();
    members.push_back({{"seed", seed}, {"epochs", epochs}, {"best_epoch", best_epoch}, {"val_mse_log", best_val},
                       {"train_graphs", fit_idx.size()}, {"val_graphs", val_idx.size()}});
  }
  // Without rotate_val: the ensemble on the validation graphs; with it, each member on the graphs it held out
  // (the ensemble has seen every graph).
  r.val_loss = o.rotate_val ? held_out_se / static_cast<double>(held_out)
                            : mean_loss(ensemble, batches_of(range(ftr.size(), tall.size())), fva.size());
  r.train_loss = mean_loss(ensemble, batches_of(range(0, ftr.size())), ftr.size());
  r.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Where the network may answer: around every graph it was trained or validated on.
  Applicability reach = Applicability::fit(fall, keys);
  r.radius = reach.radius;
  for (const auto* gs : {&train, &val}) {
    for (const StepGraph& g : *gs) reach.batches.push_back(g.globals.batch);
  }
  std::sort(reach.batches.begin(), reach.batches.end());
  reach.batches.erase(std::unique(reach.batches.begin(), reach.batches.end()), reach.batches.end());

  WeightsFile w;
  json h = {{"model", kStepGnnName},
            {"model_version", kStepGnnVersion},
            {"node_features", node_feature_names()},
            {"edge_features", {"log1p_bytes"}},
            {"global_features", global_feature_names()},
            {"config", config_json(config)},
            {"members", o.members},
            {"node_mean", norm.node_mean},
            {"node_std", norm.node_std},
            {"edge_mean", norm.edge_mean},
            {"edge_std", norm.edge_std},
            {"global_mean", norm.global_mean},
            {"global_std", norm.global_std},
            {"applicability",
             {{"mean", reach.mean},
              {"std", reach.sd},
              {"points", reach.points},
              {"radius", reach.radius},
              {"batches", reach.batches}}},
            {"trained",
             {{"train_graphs", train.size()}, {"val_graphs", val.size()}, {"rotate_val", o.rotate_val},
              {"seed", o.seed}, {"epochs", r.epochs},
              {"best_epoch", r.best_epoch}, {"train_mse_log", r.train_loss}, {"val_mse_log", r.val_loss},
              {"members", members}}}};
  w.header_json = h.dump();
  for (const auto& p : ensemble->named_parameters(/*recurse=*/true)) {
    w.tensors.push_back(weights_tensor(p.key(), p.value()));
  }
  write_weights_file(out_path, w);
  return r;
}

}  // namespace gpucast
