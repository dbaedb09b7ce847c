// gpucast/job_features.h: the numbers the job-level memory model reads from a job description. Plain C++ (no
// torch): the learned model, the training program and the benchmark's baselines all read the same features.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "gpucast/job.h"

namespace gpucast {

// Bumped whenever a feature is added, removed or changes meaning: weights record the version they were
// trained on and are refused by a gpucast that computes other features.
inline constexpr int kJobFeatureVersion = 2;
inline constexpr int64_t kMaxJobLayers = 4096;  // more leaf layers than this is not a real model

// Per layer (one row per layer, in model order):
//   kind one-hot (10: linear conv norm embedding attention rnn activation pool dropout other),
//   log1p(params), log1p(activation bytes per sample), activation known (0/1),
//   log1p(activation bytes of the micro-batch), log1p(dims[0]), log1p(dims[1]), log1p(product of dims[2:]),
//   position in the model (0..1), (version 2) log1p(repeats - 1).
// Version 2 reads a block of layers repeated back to back (a transformer's identical layers, same kind, parameters,
// dimensions and activation size) as one row per layer of the block with its repeat count: a 70B decoder's 960
// layers are about 15 rows.
// Per job: log1p of batch, micro-batch, sequence length, input bytes of the micro-batch; bytes per element;
//   autocast; optimizer one-hot (5: sgd sgd_momentum adam adamw other); log2(gradient accumulation);
//   activation checkpointing; log1p(world size); strategy one-hot (5: single ddp zero1 zero2 fsdp);
//   log1p(total params); log1p(layer count); log1p of the analytical estimate's parameter, gradient, optimizer,
//   activation and total bytes; (version 2) Adafactor (0/1), log2 of tp, pp and micro_batches, the share of one
//   micro-batch's activations the first pipeline stage holds (min(pp, micro_batches) / (tp x pp)), log1p of the
//   target's memory in GiB and whether the target is known (0/1).
struct JobFeatures {
  int64_t layers = 0;                // rows of layer_features (repeated blocks once)
  std::vector<float> layer_features;  // layers x kLayerFeatures, row-major
  std::vector<float> job_features;    // kJobFeatures
  double log_analytic_bytes = 0;      // log of the analytical estimate (the model predicts a correction to it)
  int64_t analytic_bytes = 0;
};

inline constexpr int kLayerFeatures = 19;
inline constexpr int kJobFeatures = 33;

const std::vector<std::string>& layer_feature_names();
const std::vector<std::string>& job_feature_names();

// Validates what the model needs beyond job_from_json (layer count within kMaxJobLayers) and computes the
// features; errors name the field.
JobFeatures job_features(const JobDescription& job);

}  // namespace gpucast
