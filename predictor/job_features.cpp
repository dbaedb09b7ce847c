#include "gpucast/job_features.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "gpucast/error.h"
#include "gpucast/memory_forecast.h"
#include "gpucast/parallel.h"

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

constexpr size_t kMaxPeriod = 64;  // the longest repeated block looked for (a transformer block is 10-20 layers)

bool same_layer(const JobLayer& a, const JobLayer& b) {
  return a.kind == b.kind && a.params == b.params && a.dims == b.dims &&
         a.activation_bytes_per_sample == b.activation_bytes_per_sample;
}

// The layers as the model reads them: a block repeated back to back (a transformer's identical layers) once, each
// of its layers with the number of repeats. Greedy from the first layer: at each position the period (1 to
// kMaxPeriod layers) whose back-to-back repeats cover the most layers, the shortest among equals; none repeats:
// the layer alone. Returns (index of the layer, repeats) in model order.
std::vector<std::pair<size_t, int64_t>> repeated_blocks(const std::vector<JobLayer>& ls) {
  const size_t n = ls.size();
  auto block_equal = [&](size_t a, size_t b, size_t p) {
    for (size_t j = 0; j < p; ++j) {
      if (!same_layer(ls[a + j], ls[b + j])) return false;
    }
    return true;
  };
  std::vector<std::pair<size_t, int64_t>> out;
  size_t i = 0;
  while (i < n) {
    size_t best_p = 1;
    size_t best_k = 1;
    for (size_t p = 1; p <= kMaxPeriod && i + 2 * p <= n; ++p) {
      size_t k = 1;
      while (i + (k + 1) * p <= n && block_equal(i, i + k * p, p)) ++k;
      if (k >= 2 && p * k > best_p * best_k) {
        best_p = p;
        best_k = k;
      }
    }
    for (size_t j = 0; j < best_p; ++j) out.emplace_back(i + j, static_cast<int64_t>(best_k));
    i += best_p * best_k;
  }
  return out;
}

}  // namespace

const std::vector<std::string>& layer_feature_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& k : kLayerKinds) n.push_back("kind_" + k);
    for (const char* x : {"log_params", "log_act_per_sample", "act_known", "log_act_micro_batch", "log_dim0",
                          "log_dim1", "log_dims_rest", "position", "log_repeats"}) {
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
                       "log_analytic_optimizer_bytes", "log_analytic_activation_bytes", "log_analytic_bytes",
                       "opt_adafactor", "log2_tp", "log2_pp", "log2_micro_batches", "first_stage_share",
                       "log_target_gib", "target_known"});
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
  const int64_t micro = job_micro_batch(job);
  JobFeatures f;
  int64_t params = 0;
  for (size_t i = 0; i < job.layers.size(); ++i) {
    params += job.layers[i].params;
    if (index_of(kLayerKinds, job.layers[i].kind) < 0) {
      GPUCAST_USER_ERROR("job: field 'layers[{}].kind' is \"{}\", not a known layer kind", i, job.layers[i].kind);
    }
  }
  const auto rows = repeated_blocks(job.layers);
  f.layers = static_cast<int64_t>(rows.size());
  f.layer_features.reserve(rows.size() * kLayerFeatures);
  for (const auto& [i, repeats] : rows) {
    const JobLayer& l = job.layers[i];
    const int k = index_of(kLayerKinds, l.kind);
    for (int j = 0; j < static_cast<int>(kLayerKinds.size()); ++j) f.layer_features.push_back(j == k ? 1.f : 0.f);
    const bool known = l.activation_bytes_per_sample >= 0;
    const double act = known ? static_cast<double>(l.activation_bytes_per_sample) : 0.0;
    double rest = 1;
    for (size_t d = 2; d < l.dims.size(); ++d) rest *= static_cast<double>(l.dims[d]);
    f.layer_features.insert(f.layer_features.end(),
                            {lg(static_cast<double>(l.params)), lg(act), known ? 1.f : 0.f,
                             lg(act * static_cast<double>(micro)), lg(l.dims.empty() ? 0.0 : double(l.dims[0])),
                             lg(l.dims.size() < 2 ? 0.0 : double(l.dims[1])), lg(l.dims.size() < 3 ? 0.0 : rest),
                             job.layers.size() == 1 ? 0.f : float(i) / float(job.layers.size() - 1),
                             lg(static_cast<double>(repeats - 1))});
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
  const DeviceSpec* device = job.target.empty() ? nullptr : lookup_device(job.target);
  g.insert(g.end(), {job.optimizer == "adafactor" ? 1.f : 0.f, static_cast<float>(std::log2(double(job.tp))),
                     static_cast<float>(std::log2(double(job.pp))),
                     static_cast<float>(std::log2(double(job.micro_batches))),
                     static_cast<float>(double(first_stage_in_flight(job.pp, job.micro_batches)) / double(job.tp * job.pp)),
                     device ? lg(double(device->capacity_bytes) / double(1 << 30)) : 0.f, device ? 1.f : 0.f});
  f.analytic_bytes = est.bytes;
  f.log_analytic_bytes = std::log(std::max<double>(1.0, static_cast<double>(est.bytes)));
  return f;
}

// ---- Weights file -------------------------------------------------------------------------------------------
}  // namespace gpucast
