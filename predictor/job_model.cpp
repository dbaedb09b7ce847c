// The learned job-level memory model: LibTorch nn, trained by gpucast-train, loaded by the plugin.
#include "gpucast/job_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "gpucast/checked.h"
#include "gpucast/error.h"
#include "feature_stats.h"
#include "weights_cache.h"
#include "gpucast/job_features.h"

namespace gpucast {
namespace {

using nlohmann::json;
namespace nn = torch::nn;

struct NetImpl : nn::Module {
  explicit NetImpl(const JobModelConfig& c) {
    const int64_t d = c.d_model;
    proj = register_module("proj", nn::Linear(kLayerFeatures, d));
    gru = register_module("gru", nn::GRU(nn::GRUOptions(d, d).batch_first(true).bidirectional(true)));
    // dim_feedforward 4 * d: twice the encoder's width (2 * d), chosen (the Transformer paper's ratio is 4).
    encoder = register_module(
        "encoder", nn::TransformerEncoder(nn::TransformerEncoderOptions(
                                              nn::TransformerEncoderLayerOptions(2 * d, c.heads)
                                                  .dim_feedforward(4 * d)
                                                  .dropout(c.dropout),
                                              c.encoder_layers)));
    job_mlp = register_module("job_mlp", nn::Linear(kJobFeatures, d));
    head1 = register_module("head1", nn::Linear(4 * d + d, c.head_hidden));
    head2 = register_module("head2", nn::Linear(c.head_hidden, 2));
    // Start at the analytical estimate (output 0, the log-space correction of allocated bytes, at 0) and reserved
    // about 5 % above allocated (output 1 at softplus^-1(0.05) = -2.97).
    torch::NoGradGuard ng;
    head2->weight.zero_();
    head2->bias.zero_();
    head2->bias[1].fill_(-2.97);
  }

  // x: [B, L, F] standardised layer features; lengths: [B] int64; pad: [B, L] bool, true on padding;
  // job: [B, G] standardised job features. Returns [B, 2]: the log-space correction of allocated bytes, and the
  // log-space gap of reserved above allocated before its softplus.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& lengths, const torch::Tensor& pad,
                        const torch::Tensor& job) {
    const int64_t L = x.size(1);
    torch::Tensor h = torch::relu(proj(x));
    auto packed = nn::utils::rnn::pack_padded_sequence(h, lengths, /*batch_first=*/true, /*enforce_sorted=*/false);
    auto out = std::get<0>(gru->forward_with_packed_input(packed));
    torch::Tensor states = std::get<0>(nn::utils::rnn::pad_packed_sequence(out, /*batch_first=*/true, 0.0, L));
    torch::Tensor e = encoder->forward(states.transpose(0, 1), /*src_mask=*/torch::Tensor(), /*src_key_padding_mask=*/pad)
                          .transpose(0, 1);
    torch::Tensor valid = (~pad).unsqueeze(-1).to(e.dtype());
    torch::Tensor mean = (e * valid).sum(1) / valid.sum(1).clamp_min(1.0);
    torch::Tensor mx = e.masked_fill(pad.unsqueeze(-1), -1e4).amax(1);
    torch::Tensor z = torch::cat({mean, mx, torch::relu(job_mlp(job))}, 1);
    return head2(torch::relu(head1(z)));
  }

  nn::Linear proj{nullptr}, job_mlp{nullptr}, head1{nullptr}, head2{nullptr};
  nn::GRU gru{nullptr};
  nn::TransformerEncoder encoder{nullptr};
};
TORCH_MODULE(Net);

struct Normaliser {
  std::vector<float> layer_mean, layer_std, job_mean, job_std;

  static Normaliser fit(const std::vector<JobFeatures>& fs) {
    Normaliser n;
    std::vector<const std::vector<float>*> layers, jobs;
    for (const auto& f : fs) {
      layers.push_back(&f.layer_features);
      jobs.push_back(&f.job_features);
    }
    detail::column_stats(layers, kLayerFeatures, n.layer_mean, n.layer_std);
    detail::column_stats(jobs, kJobFeatures, n.job_mean, n.job_std);
    return n;
  }
};

struct Batch {
  torch::Tensor x, lengths, pad, job, log_analytic;
  torch::Tensor target, target_reserved, has_reserved;  // log-bytes; reserved known (1) or not (0)
};

// log allocated and log reserved from the network's output (reserved never below allocated).
std::pair<torch::Tensor, torch::Tensor> predicted(const torch::Tensor& log_analytic, const torch::Tensor& out) {
  torch::Tensor alloc = log_analytic + out.select(1, 0);
  return {alloc, alloc + torch::softplus(out.select(1, 1))};
}

// The loss: the mean relative error of allocated bytes, plus that of reserved bytes over the jobs that know it, each
// taken against the smaller of answer and label (exp(|d|) - 1 for a log-space error d): symmetric, so that answering
// low (an out-of-memory risk) costs as much as answering high; linear beyond |d| = 3 (20x), so that a wild early
// guess neither dominates nor stops learning.
torch::Tensor relative_loss(const Batch& b, const torch::Tensor& out, bool sum) {
  auto [alloc, reserved] = predicted(b.log_analytic, out);
  auto rel = [](const torch::Tensor& d) {
    const torch::Tensor a = d.abs();
    const double e3 = std::exp(3.0);
    return torch::where(a < 3.0, torch::expm1(a.clamp_max(3.0)), (e3 - 1.0) + e3 * (a - 3.0));
  };
  torch::Tensor a = rel(alloc - b.target);
  torch::Tensor r = rel(reserved - b.target_reserved) * b.has_reserved;
  if (sum) return a.sum() + r.sum();
  return a.mean() + r.sum() / b.has_reserved.sum().clamp_min(1.0);
}

struct Labels {
  std::vector<double> alloc, reserved, has_reserved;  // log-bytes
};

Batch make_batch(const std::vector<const JobFeatures*>& fs, const Normaliser& n, const Labels* labels) {
  const int64_t B = static_cast<int64_t>(fs.size());
  int64_t L = 1;
  for (const auto* f : fs) L = std::max(L, f->layers);
  Batch b;
  b.x = torch::zeros({B, L, kLayerFeatures});
  b.pad = torch::ones({B, L}, torch::kBool);
  b.lengths = torch::empty({B}, torch::kInt64);
  b.job = torch::empty({B, kJobFeatures});
  b.log_analytic = torch::empty({B});
  auto x = b.x.accessor<float, 3>();
  auto pad = b.pad.accessor<bool, 2>();
  auto len = b.lengths.accessor<int64_t, 1>();
  auto job = b.job.accessor<float, 2>();
  auto la = b.log_analytic.accessor<float, 1>();
  for (int64_t i = 0; i < B; ++i) {
    const JobFeatures& f = *fs[i];
    for (int64_t t = 0; t < f.layers; ++t) {
      for (int j = 0; j < kLayerFeatures; ++j) {
        x[i][t][j] = (f.layer_features[t * kLayerFeatures + j] - n.layer_mean[j]) / n.layer_std[j];
      }
      pad[i][t] = false;
    }
    len[i] = f.layers;
    for (int j = 0; j < kJobFeatures; ++j) job[i][j] = (f.job_features[j] - n.job_mean[j]) / n.job_std[j];
    la[i] = static_cast<float>(f.log_analytic_bytes);
  }
  if (labels != nullptr) {
    b.target = torch::tensor(labels->alloc, torch::kFloat32);
    b.target_reserved = torch::tensor(labels->reserved, torch::kFloat32);
    b.has_reserved = torch::tensor(labels->has_reserved, torch::kFloat32);
  }
  return b;
}

json config_json(const JobModelConfig& c) {
  return {{"d_model", c.d_model}, {"heads", c.heads}, {"encoder_layers", c.encoder_layers},
          {"head_hidden", c.head_hidden}, {"dropout", c.dropout}};
}

}  // namespace

class LearnedJobModel {
 public:
  LearnedJobModel(JobModelConfig c, Normaliser n, json info) : net(c), norm(std::move(n)), info(std::move(info)) {
    net->eval();
  }
  mutable Net net;
  Normaliser norm;
  json info;
  mutable std::mutex mu;  // one forward at a time per loaded model
};

std::shared_ptr<const LearnedJobModel> load_job_model(const std::string& path) {
  const WeightsFile w = read_weights_file(path);
  const char* fix = "; retrain with gpucast-train or reinstall gpucast to get the shipped weights";
  const WeightsHeader header(w, path, kJobModelName, kJobModelVersion, fix);
  auto field = [&](const char* key) -> const json& { return header.field(key); };
  if (field("feature_version") != kJobFeatureVersion) {
    GPUCAST_USER_ERROR("weights file '{}' was trained on job features version {}; this gpucast computes version {}{}",
                       path, field("feature_version").dump(), kJobFeatureVersion, fix);
  }
  JobModelConfig c;
  Normaliser n;
  try {
    const json& cj = field("config");
    c.d_model = cj.at("d_model").get<int64_t>();
    c.heads = cj.at("heads").get<int64_t>();
    c.encoder_layers = cj.at("encoder_layers").get<int64_t>();
    c.head_hidden = cj.at("head_hidden").get<int64_t>();
    c.dropout = cj.at("dropout").get<double>();
    n.layer_mean = field("layer_mean").get<std::vector<float>>();
    n.layer_std = field("layer_std").get<std::vector<float>>();
    n.job_mean = field("job_mean").get<std::vector<float>>();
    n.job_std = field("job_std").get<std::vector<float>>();
  } catch (const json::exception& e) {
    GPUCAST_USER_ERROR("weights file '{}': bad header field ({}){}", path, e.what(), fix);
  }
  if (c.d_model < 1 || c.d_model > 4096 || c.heads < 1 || (2 * c.d_model) % c.heads != 0 || c.encoder_layers < 1 ||
      c.encoder_layers > 64 || c.head_hidden < 1 || c.head_hidden > 65536) {
    GPUCAST_USER_ERROR("weights file '{}': implausible model configuration {}{}", path, field("config").dump(), fix);
  }
  check_normalisation(path, "layer", n.layer_mean, n.layer_std, kLayerFeatures, fix);
  check_normalisation(path, "job", n.job_mean, n.job_std, kJobFeatures, fix);
  auto model = std::make_shared<LearnedJobModel>(c, n, header.json().value("trained", json::object()));
  load_parameters(*model->net, w, path, fix);
  return model;
}

// The range of learned corrections taken as answers where the weights do not record their training set's.
constexpr double kDefaultMinRatio = 0.25, kDefaultMaxRatio = 4.0;

namespace {

// What the training range is read on: parameters, ranks, and tokens (or samples) of one rank's micro-batch.
struct RangeKeys {
  double params, world, tokens;
};

RangeKeys range_keys(const JobDescription& job) {
  int64_t params = 0;
  for (const JobLayer& l : job.layers) params = checked_add(params, l.params, "job");
  return {static_cast<double>(params), static_cast<double>(job.world_size),
          static_cast<double>(job_micro_batch(job)) * static_cast<double>(std::max<int64_t>(1, job.seq_len))};
}

// The first key of `job` outside the training set's range ("" inside), as the note says it.
std::string out_of_range(const json& range, const JobDescription& job) {
  if (!range.is_object()) return "";
  const RangeKeys k = range_keys(job);
  for (const auto& [name, value] : {std::pair<const char*, double>{"parameters", k.params}, {"ranks", k.world},
                                    {"tokens per micro-batch", k.tokens}}) {
    const json& r = range.value(name, json());
    if (!r.is_array() || r.size() != 2 || !r[0].is_number() || !r[1].is_number()) continue;
    if (value < r[0].get<double>() || value > r[1].get<double>()) {
      return fmt::format("{} {:.4g} outside the training set's {:.4g} to {:.4g}", name, value, r[0].get<double>(),
                         r[1].get<double>());
    }
  }
  return "";
}

}  // namespace

JobEstimate learned_job_estimate(const LearnedJobModel& model, const JobDescription& job) {
  const JobFeatures f = job_features(job);
  JobEstimate e = analytical_job_estimate(job);
  double correction, gap;
  {
    std::lock_guard<std::mutex> lock(model.mu);
    torch::NoGradGuard ng;
    Batch b = make_batch({&f}, model.norm, nullptr);
    const torch::Tensor out = model.net->forward(b.x, b.lengths, b.pad, b.job);
    correction = out[0][0].item<double>();
    gap = torch::softplus(out[0][1]).item<double>();
  }
  // The model corrects the analytical estimate; an answer that is not finite or lies outside half the smallest to
  // twice the largest ratio of label to analytical estimate its training set held (0.25x-4x for weights that do
  // not record it) is taken for a broken model, so the analytical estimate stands, said in a note
  // (bench/results/learned_ratio.txt: the shipped model's answers against these bounds).
  const json& seen = model.info.value("ratio", json());
  const bool recorded = seen.is_array() && seen.size() == 2 && seen[0].is_number() && seen[1].is_number();
  const double min_ratio = recorded ? seen[0].get<double>() / 2 : kDefaultMinRatio;
  const double max_ratio = recorded ? seen[1].get<double>() * 2 : kDefaultMaxRatio;
  const double ratio = std::exp(correction);
  const std::string outside = out_of_range(model.info.value("range", json()), job);
  e.out_of_range = !outside.empty();
  if (!std::isfinite(ratio) || ratio < min_ratio || ratio > max_ratio) {
    e.notes.insert(e.notes.begin(),
                   Note{"learned-implausible", fmt::format("learned model's answer implausible ({}x the analytical "
                                                           "estimate, outside {}x-{}x); analytical estimate",
                                                           ratio, min_ratio, max_ratio)});
  } else {
    e.method = "learned";
    const double bytes = std::exp(f.log_analytic_bytes + correction);
    e.bytes = static_cast<int64_t>(std::min(bytes, 9.0e18));
    e.reserved_bytes = static_cast<int64_t>(std::min(bytes * std::exp(gap), 9.0e18));
    e.notes.insert(e.notes.begin(),
                   Note{"learned", fmt::format("{} model v{} trained on {} jobs; breakdown fields are the analytical "
                                               "estimate's",
                                               kJobModelName, kJobModelVersion, model.info.value("train_jobs", 0))});
  }
  if (e.out_of_range) {
    // Said beside whichever answer stands; the analytical estimate is in analytical_bytes either way.
    e.notes.insert(e.notes.begin() + 1,
                   Note{"learned-out-of-range", fmt::format("the job lies outside the learned model's training "
                                                            "range ({}): a learned answer is an extrapolation; the "
                                                            "analytical estimate is {} bytes",
                                                            outside, e.analytical_bytes)});
  }
  return e;
}

JobEstimate predict_job_memory(const JobDescription& job, const std::string& weights_path) {
  std::string why;
  if (weights_path.empty()) {
    why = "no weights file for the learned model";
  } else {
    const auto model = cached_model<LearnedJobModel>(weights_path, &load_job_model, &why);
    if (model) {
      try {
        return learned_job_estimate(*model, job);
      } catch (const UserError&) {
        throw;  // the job itself is bad: the caller must hear it
      } catch (const std::exception& e) {
        why = fmt::format("the learned model failed ({})", e.what());
      }
    }
  }
  job_features(job);  // the same input validation either way
  JobEstimate e = analytical_job_estimate(job);
  e.notes.insert(e.notes.begin(),
                 Note{"learned-unavailable", fmt::format("learned model unavailable: {}; analytical estimate", why)});
  return e;
}

TrainResult train_job_model(const std::vector<TrainingJob>& train, const std::vector<TrainingJob>& val,
                            const TrainOptions& o, const std::string& out_path) {
  if (train.empty() || val.empty()) {
    GPUCAST_USER_ERROR("gpucast-train: need training and validation jobs, got {} and {}", train.size(), val.size());
  }
  const auto t0 = std::chrono::steady_clock::now();
  torch::manual_seed(o.seed);
  if (o.threads > 0) torch::set_num_threads(o.threads);
  auto featurise = [](const std::vector<TrainingJob>& jobs, std::vector<JobFeatures>& fs, Labels& y) {
    for (const auto& j : jobs) {
      if (j.label_bytes < 1) GPUCAST_USER_ERROR("gpucast-train: a job has label {} bytes; labels must be >= 1", j.label_bytes);
      if (j.label_reserved_bytes != 0 && j.label_reserved_bytes < j.label_bytes) {
        GPUCAST_USER_ERROR("gpucast-train: a job has reserved {} bytes below its allocated {} bytes",
                           j.label_reserved_bytes, j.label_bytes);
      }
      fs.push_back(job_features(j.job));
      y.alloc.push_back(std::log(static_cast<double>(j.label_bytes)));
      const bool known = j.label_reserved_bytes > 0;
      y.reserved.push_back(known ? std::log(static_cast<double>(j.label_reserved_bytes)) : y.alloc.back());
      y.has_reserved.push_back(known ? 1.0 : 0.0);
    }
  };
  std::vector<JobFeatures> ftr, fva;
  Labels ytr, yva;
  featurise(train, ftr, ytr);
  featurise(val, fva, yva);
  double ratio_lo = 1e300, ratio_hi = 0;
  for (size_t i = 0; i < ftr.size(); ++i) {
    const double r = std::exp(ytr.alloc[i]) / std::max<double>(1.0, static_cast<double>(ftr[i].analytic_bytes));
    ratio_lo = std::min(ratio_lo, r);
    ratio_hi = std::max(ratio_hi, r);
  }
  json range = json::object();
  {
    RangeKeys lo{1e300, 1e300, 1e300}, hi{0, 0, 0};
    for (const auto& j : train) {
      const RangeKeys k = range_keys(j.job);
      lo = {std::min(lo.params, k.params), std::min(lo.world, k.world), std::min(lo.tokens, k.tokens)};
      hi = {std::max(hi.params, k.params), std::max(hi.world, k.world), std::max(hi.tokens, k.tokens)};
    }
    range = {{"parameters", {lo.params, hi.params}}, {"ranks", {lo.world, hi.world}},
             {"tokens per micro-batch", {lo.tokens, hi.tokens}}};
  }
  const Normaliser norm = Normaliser::fit(ftr);
  Net net(o.model);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  std::mt19937_64 rng(o.seed);

  // Batches of similar length waste less padding: sort by length, cut, shuffle the batches.
  auto batches_of = [&](const std::vector<JobFeatures>& fs, const Labels& y, bool shuffle) {
    std::vector<size_t> idx(fs.size());
    std::iota(idx.begin(), idx.end(), 0);
    if (shuffle) std::shuffle(idx.begin(), idx.end(), rng);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return fs[a].layers < fs[b].layers; });
    std::vector<Batch> out;
    for (size_t s = 0; s < idx.size(); s += static_cast<size_t>(o.batch_size)) {
      std::vector<const JobFeatures*> part;
      Labels lab;
      for (size_t k = s; k < std::min(idx.size(), s + static_cast<size_t>(o.batch_size)); ++k) {
        part.push_back(&fs[idx[k]]);
        lab.alloc.push_back(y.alloc[idx[k]]);
        lab.reserved.push_back(y.reserved[idx[k]]);
        lab.has_reserved.push_back(y.has_reserved[idx[k]]);
      }
      out.push_back(make_batch(part, norm, &lab));
    }
    if (shuffle) std::shuffle(out.begin(), out.end(), rng);
    return out;
  };
  const std::vector<Batch> val_batches = batches_of(fva, yva, false);
  auto val_loss = [&]() {
    torch::NoGradGuard ng;
    net->eval();
    double total = 0;
    for (const Batch& b : val_batches) total += relative_loss(b, net->forward(b.x, b.lengths, b.pad, b.job), true).item<double>();
    return total / static_cast<double>(fva.size());
  };

  TrainResult r;
  r.best_val_loss = val_loss();
  std::vector<torch::Tensor> best;
  for (const auto& p : net->parameters()) best.push_back(p.detach().clone());
  for (int64_t epoch = 1; epoch <= o.max_epochs; ++epoch) {
    net->train();
    double train_loss = 0;
    for (const Batch& b : batches_of(ftr, ytr, true)) {
      opt.zero_grad();
      torch::Tensor loss = relative_loss(b, net->forward(b.x, b.lengths, b.pad, b.job), false);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
      opt.step();
      train_loss += loss.item<double>() * b.target.size(0);
    }
    const double v = val_loss();
    r.epochs = epoch;
    if (o.verbose) {
      std::fprintf(stderr, "epoch %3ld  train loss %.5f  val loss %.5f%s\n", static_cast<long>(epoch),
                   train_loss / ftr.size(), v, v < r.best_val_loss ? "  *" : "");
    }
    if (v < r.best_val_loss) {
      r.best_val_loss = v;
      r.best_epoch = epoch;
      size_t i = 0;
      for (const auto& p : net->parameters()) best[i++].copy_(p.detach());
    } else if (epoch - r.best_epoch >= o.patience) {
      break;
    }
  }
  r.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  WeightsFile w;
  json h = {{"model", kJobModelName},
            {"model_version", kJobModelVersion},
            {"feature_version", kJobFeatureVersion},
            {"layer_features", layer_feature_names()},
            {"job_features", job_feature_names()},
            {"config", config_json(o.model)},
            {"layer_mean", norm.layer_mean},
            {"layer_std", norm.layer_std},
            {"job_mean", norm.job_mean},
            {"job_std", norm.job_std},
            {"trained",
             {{"train_jobs", train.size()}, {"val_jobs", val.size()}, {"seed", o.seed}, {"epochs", r.epochs},
              {"best_epoch", r.best_epoch}, {"val_loss", r.best_val_loss}, {"range", range},
              {"ratio", {ratio_lo, ratio_hi}}}}};
  w.header_json = h.dump();
  size_t i = 0;
  for (const auto& p : net->named_parameters(/*recurse=*/true)) {
    w.tensors.push_back(weights_tensor(p.key(), best[i++]));
  }
  write_weights_file(out_path, w);
  return r;
}

std::vector<int64_t> owned_storages() {
  OwnedStorages& r = owned_storage_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<int64_t> out;
  for (const auto& [model, ptrs] : r.by_model) out.insert(out.end(), ptrs.begin(), ptrs.end());
  return out;
}

}  // namespace gpucast
