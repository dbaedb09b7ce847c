#include "gpucast/job_features.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "gpucast/error.h"

namespace gpucast {
namespace {

const std::vector<std::string> kLayerKinds = {"linear", "conv", "norm", "embedding", "attention",
                                              "rnn", "activation", "pool", "dropout", "other"};
const std::vector<std::string> kOptimizerNames = {"sgd", "sgd_momentum", "adam", "adamw", "other"};
const std::vector<std::string> kStrategyNames = {"single", "ddp", "zero1", "zero2", "fsdp"};

float lg(double x) { return static_cast<float>(std::log1p(std::max(0.0, x))); }

int index_of(const std::vector<std::string>& xs, const std::string& x) {
  auto it = std::find(xs.begin(), xs.end(), x);
  return it == xs.end() ? -1 : static_cast<int>(it - xs.begin());
}

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "float16" || dtype == "bfloat16") return 2;
  if (dtype == "float64") return 8;
  return 4;
}

}  // namespace

const std::vector<std::string>& layer_feature_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& k : kLayerKinds) n.push_back("kind_" + k);
    for (const char* x : {"log_params", "log_act_per_sample", "act_known", "log_act_micro_batch", "log_dim0",
                          "log_dim1", "log_dims_rest", "position"}) {
      n.emplace_back(x);
    }
    return n;
  }();
  return names;
}

const std::vector<std::string>& job_feature_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {"log_batch", "log_micro_batch", "log_seq_len", "log_input_bytes", "elem_bytes",
                                  "autocast"};
    for (const auto& o : kOptimizerNames) n.push_back("opt_" + o);
    n.insert(n.end(), {"log2_grad_accumulation", "checkpointing", "log_world_size"});
    for (const auto& s : kStrategyNames) n.push_back("strategy_" + s);
    n.insert(n.end(), {"log_params", "log_layers", "log_analytic_param_bytes", "log_analytic_grad_bytes",
                       "log_analytic_optimizer_bytes", "log_analytic_activation_bytes", "log_analytic_bytes"});
    return n;
  }();
  return names;
}

JobFeatures job_features(const JobDescription& job) {
  if (job.layers.empty()) GPUCAST_USER_ERROR("job: field 'layers' is empty: a job needs at least one layer");
  if (static_cast<int64_t>(job.layers.size()) > kMaxJobLayers) {
    GPUCAST_USER_ERROR("job: field 'layers' has {} layers; the job-level model reads at most {} (leaf modules)",
                       job.layers.size(), kMaxJobLayers);
  }
  const JobEstimate est = analytical_job_estimate(job);
  const int64_t world = std::max<int64_t>(1, job.world_size);
  const int64_t ga = std::max<int64_t>(1, job.grad_accumulation);
  const int64_t micro = std::max<int64_t>(1, job.batch_size / (world * ga));
  JobFeatures f;
  f.layers = static_cast<int64_t>(job.layers.size());
  f.layer_features.reserve(job.layers.size() * kLayerFeatures);
  int64_t params = 0;
  for (size_t i = 0; i < job.layers.size(); ++i) {
    const JobLayer& l = job.layers[i];
    params += l.params;
    const int k = index_of(kLayerKinds, l.kind);
    if (k < 0) GPUCAST_USER_ERROR("job: field 'layers[{}].kind' is \"{}\", not a known layer kind", i, l.kind);
    for (int j = 0; j < static_cast<int>(kLayerKinds.size()); ++j) f.layer_features.push_back(j == k ? 1.f : 0.f);
    const bool known = l.activation_bytes_per_sample >= 0;
    const double act = known ? static_cast<double>(l.activation_bytes_per_sample) : 0.0;
    double rest = 1;
    for (size_t d = 2; d < l.dims.size(); ++d) rest *= static_cast<double>(l.dims[d]);
    f.layer_features.insert(f.layer_features.end(),
                            {lg(static_cast<double>(l.params)), lg(act), known ? 1.f : 0.f,
                             lg(act * static_cast<double>(micro)), lg(l.dims.empty() ? 0.0 : double(l.dims[0])),
                             lg(l.dims.size() < 2 ? 0.0 : double(l.dims[1])), lg(l.dims.size() < 3 ? 0.0 : rest),
                             job.layers.size() == 1 ? 0.f : float(i) / float(job.layers.size() - 1)});
  }
  auto& g = f.job_features;
  g = {lg(double(job.batch_size)), lg(double(micro)), lg(double(job.seq_len)),
       lg(double(job.input_bytes_per_sample) * double(micro)), float(dtype_bytes(job.dtype)), job.autocast ? 1.f : 0.f};
  const int o = index_of(kOptimizerNames, job.optimizer);
  for (int j = 0; j < static_cast<int>(kOptimizerNames.size()); ++j) g.push_back(j == o ? 1.f : 0.f);
  g.insert(g.end(), {static_cast<float>(std::log2(double(ga))), job.activation_checkpointing ? 1.f : 0.f,
                     lg(double(world))});
  const int s = index_of(kStrategyNames, job.strategy);
  for (int j = 0; j < static_cast<int>(kStrategyNames.size()); ++j) g.push_back(j == s ? 1.f : 0.f);
  g.insert(g.end(), {lg(double(params)), lg(double(job.layers.size())), lg(double(est.parameter_bytes)),
                     lg(double(est.gradient_bytes)), lg(double(est.optimizer_bytes)), lg(double(est.activation_bytes)),
                     lg(double(est.bytes))});
  f.analytic_bytes = est.bytes;
  f.log_analytic_bytes = std::log(std::max<double>(1.0, static_cast<double>(est.bytes)));
  return f;
}

// ---- Weights file -------------------------------------------------------------------------------------------
namespace {

constexpr char kMagic[8] = {'G', 'P', 'U', 'C', 'A', 'S', 'T', 'J'};

uint64_t fnv1a(const char* p, size_t n, uint64_t h = 1469598103934665603ull) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 1099511628211ull;
  }
  return h;
}

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

void write_weights_file(const std::string& path, const WeightsFile& w) {
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kWeightsFormatVersion);
  put<uint32_t>(out, static_cast<uint32_t>(w.header_json.size()));
  out += w.header_json;
  put<uint32_t>(out, static_cast<uint32_t>(w.tensors.size()));
  for (const WeightsTensor& t : w.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (n != static_cast<int64_t>(t.data.size())) {
      GPUCAST_USER_ERROR("weights tensor '{}': shape holds {} values, data has {}", t.name, n, t.data.size());
    }
    put<uint32_t>(out, static_cast<uint32_t>(t.name.size()));
    out += t.name;
    put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) put<int64_t>(out, d);
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
  }
  put<uint64_t>(out, fnv1a(out.data(), out.size()));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) GPUCAST_USER_ERROR("cannot write weights file '{}': {}", tmp, std::strerror(errno));
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f) GPUCAST_USER_ERROR("cannot write weights file '{}': {}", tmp, std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    GPUCAST_USER_ERROR("cannot move '{}' to '{}': {}", tmp, path, std::strerror(errno));
  }
}

WeightsFile read_weights_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) GPUCAST_USER_ERROR("cannot open weights file '{}': {}", path, std::strerror(errno));
  const std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const char* fix = "; retrain with gpucast-train or reinstall gpucast to get the shipped weights";
  if (data.size() < sizeof(kMagic) || std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    GPUCAST_USER_ERROR("'{}' is not a gpucast weights file (it does not start with \"GPUCASTJ\"){}", path, fix);
  }
  if (data.size() < sizeof(kMagic) + 8 + 8) {
    GPUCAST_USER_ERROR("weights file '{}' is truncated: {} bytes, shorter than any weights file{}", path, data.size(),
                       fix);
  }
  uint32_t version = 0;
  std::memcpy(&version, data.data() + sizeof(kMagic), 4);
  if (version != kWeightsFormatVersion) {
    GPUCAST_USER_ERROR("weights file '{}' has format version {}; this gpucast reads version {}{}", path, version,
                       kWeightsFormatVersion, fix);
  }
  // The checksum covers everything: a truncated file fails here before any size in it is trusted.
  const size_t body_end = data.size() - 8;
  uint64_t stored = 0;
  std::memcpy(&stored, data.data() + body_end, 8);
  if (stored != fnv1a(data.data(), body_end)) {
    GPUCAST_USER_ERROR("weights file '{}' is corrupt or truncated: its checksum does not match its {} bytes{}", path,
                       data.size(), fix);
  }
  size_t pos = sizeof(kMagic) + 4;
  auto take = [&](size_t n, const char* what) {
    if (body_end < pos || body_end - pos < n) {
      GPUCAST_USER_ERROR("weights file '{}' is corrupt: it ends inside the {}{}", path, what, fix);
    }
    const char* p = data.data() + pos;
    pos += n;
    return p;
  };
  auto u32 = [&](const char* what) {
    uint32_t v;
    std::memcpy(&v, take(4, what), 4);
    return v;
  };
  WeightsFile w;
  const uint32_t header_len = u32("header length");
  w.header_json.assign(take(header_len, "header"), header_len);
  const uint32_t count = u32("tensor count");
  for (uint32_t i = 0; i < count; ++i) {
    WeightsTensor t;
    const uint32_t name_len = u32("tensor name length");
    t.name.assign(take(name_len, "tensor name"), name_len);
    const uint32_t ndim = u32("tensor rank");
    if (ndim > 8) GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor '{}' has rank {}{}", path, t.name, ndim, fix);
    int64_t n = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      int64_t v;
      std::memcpy(&v, take(8, "tensor shape"), 8);
      if (v < 0 || v > (int64_t{1} << 32)) {
        GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor '{}' has dimension {}{}", path, t.name, v, fix);
      }
      t.shape.push_back(v);
      n *= v;
    }
    if (n > static_cast<int64_t>(body_end)) {
      GPUCAST_USER_ERROR("weights file '{}' is corrupt: tensor '{}' claims {} values{}", path, t.name, n, fix);
    }
    t.data.resize(static_cast<size_t>(n));
    std::memcpy(t.data.data(), take(static_cast<size_t>(n) * sizeof(float), "tensor data"),
                static_cast<size_t>(n) * sizeof(float));
    w.tensors.push_back(std::move(t));
  }
  if (pos != body_end) {
    GPUCAST_USER_ERROR("weights file '{}' is corrupt: {} bytes after the last tensor{}", path, body_end - pos, fix);
  }
  return w;
}

}  // namespace gpucast
