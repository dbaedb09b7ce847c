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
    head2 = register_module("head2", nn::Linear(c.head_hidden, 1));
    // Start at the analytical estimate: the network learns a correction to it.
    torch::NoGradGuard ng;
    head2->weight.zero_();
    head2->bias.zero_();
  }

  // x: [B, L, F] standardised layer features; lengths: [B] int64; pad: [B, L] bool, true on padding;
  // job: [B, G] standardised job features. Returns [B]: the log-space correction.
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
    return head2(torch::relu(head1(z))).squeeze(-1);
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
  torch::Tensor x, lengths, pad, job, log_analytic, target;
};

Batch make_batch(const std::vector<const JobFeatures*>& fs, const Normaliser& n, const std::vector<double>* labels) {
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
  if (labels != nullptr) b.target = torch::tensor(*labels, torch::kFloat32);
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

// The range of learned corrections taken as answers; outside it the model is taken to be broken.
constexpr double kMinLearnedRatio = 0.25, kMaxLearnedRatio = 4.0;

JobEstimate learned_job_estimate(const LearnedJobModel& model, const JobDescription& job) {
  const JobFeatures f = job_features(job);
  JobEstimate e = analytical_job_estimate(job);
  double correction;
  {
    std::lock_guard<std::mutex> lock(model.mu);
    torch::NoGradGuard ng;
    Batch b = make_batch({&f}, model.norm, nullptr);
    correction = model.net->forward(b.x, b.lengths, b.pad, b.job).item<double>();
  }
  // The model corrects the analytical estimate; an answer that is not finite or lies outside 0.25x-4x of it is
  // taken for a broken model (the shipped model's answers over the dataset's 3,108 jobs lie within 0.74x-3.90x:
  // bench/results/learned_ratio.txt), so the analytical estimate stands, said in a note.
  const double ratio = std::exp(correction);
  if (!std::isfinite(ratio) || ratio < kMinLearnedRatio || ratio > kMaxLearnedRatio) {
    e.notes.insert(e.notes.begin(),
                   Note{"learned-implausible", fmt::format("learned model's answer implausible ({}x the analytical "
                                                           "estimate, outside {}x-{}x); analytical estimate",
                                                           ratio, kMinLearnedRatio, kMaxLearnedRatio)});
    return e;
  }
  e.method = "learned";
  const double bytes = std::exp(f.log_analytic_bytes + correction);
  e.bytes = static_cast<int64_t>(std::min(bytes, 9.0e18));
  e.notes.insert(e.notes.begin(),
                 Note{"learned", fmt::format("{} model v{} trained on {} jobs; breakdown fields are the analytical "
                                             "estimate's",
                                             kJobModelName, kJobModelVersion, model.info.value("train_jobs", 0))});
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
  auto featurise = [](const std::vector<TrainingJob>& jobs, std::vector<JobFeatures>& fs, std::vector<double>& y) {
    for (const auto& j : jobs) {
      if (j.label_bytes < 1) GPUCAST_USER_ERROR("gpucast-train: a job has label {} bytes; labels must be >= 1", j.label_bytes);
      fs.push_back(job_features(j.job));
      y.push_back(std::log(static_cast<double>(j.label_bytes)));
    }
  };
  std::vector<JobFeatures> ftr, fva;
  std::vector<double> ytr, yva;
  featurise(train, ftr, ytr);
  featurise(val, fva, yva);
  const Normaliser norm = Normaliser::fit(ftr);
  Net net(o.model);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  std::mt19937_64 rng(o.seed);

  // Batches of similar length waste less padding: sort by length, cut, shuffle the batches.
  auto batches_of = [&](const std::vector<JobFeatures>& fs, const std::vector<double>& y, bool shuffle) {
    std::vector<size_t> idx(fs.size());
    std::iota(idx.begin(), idx.end(), 0);
    if (shuffle) std::shuffle(idx.begin(), idx.end(), rng);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return fs[a].layers < fs[b].layers; });
    std::vector<Batch> out;
    for (size_t s = 0; s < idx.size(); s += static_cast<size_t>(o.batch_size)) {
      std::vector<const JobFeatures*> part;
      std::vector<double> lab;
      for (size_t k = s; k < std::min(idx.size(), s + static_cast<size_t>(o.batch_size)); ++k) {
        part.push_back(&fs[idx[k]]);
        lab.push_back(y[idx[k]]);
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
    double se = 0;
    for (const Batch& b : val_batches) {
      torch::Tensor pred = b.log_analytic + net->forward(b.x, b.lengths, b.pad, b.job);
      se += (pred - b.target).pow(2).sum().item<double>();
    }
    return se / static_cast<double>(fva.size());
  };

  TrainResult r;
  r.best_val_mse_log = val_loss();
  std::vector<torch::Tensor> best;
  for (const auto& p : net->parameters()) best.push_back(p.detach().clone());
  for (int64_t epoch = 1; epoch <= o.max_epochs; ++epoch) {
    net->train();
    double train_se = 0;
    for (const Batch& b : batches_of(ftr, ytr, true)) {
      opt.zero_grad();
      torch::Tensor pred = b.log_analytic + net->forward(b.x, b.lengths, b.pad, b.job);
      torch::Tensor loss = torch::mse_loss(pred, b.target);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
      opt.step();
      train_se += loss.item<double>() * b.target.size(0);
    }
    const double v = val_loss();
    r.epochs = epoch;
    if (o.verbose) {
      std::fprintf(stderr, "epoch %3ld  train mse(log) %.5f  val mse(log) %.5f%s\n", static_cast<long>(epoch),
                   train_se / ftr.size(), v, v < r.best_val_mse_log ? "  *" : "");
    }
    if (v < r.best_val_mse_log) {
      r.best_val_mse_log = v;
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
              {"best_epoch", r.best_epoch}, {"val_mse_log", r.best_val_mse_log}}}};
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
