// gpucast/job.h: a training job described without its code (what a scheduler sees), and the job-level
// memory estimate from that description.
//
// The description is JSON (schema in docs/user-guide.md, "gpucast.describe and gpucast.predict_job"); gpucast.describe(model, make_batch) writes
// it from a model and one small probe. The analytical estimate counts, from the description alone:
// parameters, gradients, optimizer state (per optimizer), the input batch, and activations per layer
// (bytes per sample saved for backward, as the probe measured them; from layer dimensions where it did not).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpucast/note.h"

namespace gpucast {

// 2 adds the layout (tp, pp, micro_batches) and the GPU (target); version 1 files are read as version 2 with one
// tensor-parallel rank, one stage, one micro-batch and no target.
inline constexpr int kJobSchemaVersion = 2;

struct JobLayer {
  std::string kind;                  // linear, conv, norm, embedding, attention, rnn, activation, pool, dropout, other
  std::string name;                  // module path
  std::vector<int64_t> dims;         // kind-specific: linear [in, out], conv [in, out, k...], embedding [num, dim], ...
  int64_t params = 0;                // parameter count
  int64_t activation_bytes_per_sample = -1;  // measured by describe(); -1: derive from dims
};

struct JobDescription {
  int schema_version = kJobSchemaVersion;
  std::string family;                // mlp, cnn, rnn, transformer-encoder, transformer-decoder, vit, other
  std::vector<JobLayer> layers;
  int64_t batch_size = 0;
  int64_t seq_len = 0;               // tokens per sample (0 if not a sequence model)
  std::vector<int64_t> input_shape;  // per sample, e.g. [3, 224, 224]
  int64_t input_bytes_per_sample = 0;
  std::string dtype = "float32";     // parameter dtype
  bool autocast = false;
  std::string optimizer = "adamw";   // sgd, sgd_momentum, adam, adamw, other
  int64_t grad_accumulation = 1;
  bool activation_checkpointing = false;
  int64_t world_size = 1;            // every rank: data-parallel x tp x pp
  std::string strategy = "single";   // the data-parallel mode: single, ddp, zero1, zero2, fsdp
  int64_t tp = 1;                    // tensor-parallel ranks
  int64_t pp = 1;                    // pipeline stages
  int64_t micro_batches = 1;         // pipeline micro-batches per step
  std::string target;                // the GPU (gpucast.devices() name), "" unknown
};

// Data-parallel ranks of a job (world_size / (tp x pp)); errors name the fields when the layout does not divide.
int64_t job_dp(const JobDescription& job);
// Samples of one rank's micro-batch: batch / (data-parallel ranks x gradient accumulation x micro_batches), >= 1.
int64_t job_micro_batch(const JobDescription& job);

// Parses and validates: errors name the field, what was expected and what was given (unknown layer kinds,
// empty layer lists, absurd sizes, another schema version).
JobDescription job_from_json(std::string_view text, std::string_view source = "<job>");
std::string job_to_json(const JobDescription& job);

struct JobEstimate {
  int64_t bytes = 0;                 // peak bytes of one rank
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t activation_bytes = 0;
  int64_t input_bytes = 0;
  int64_t reserved_bytes = -1;       // peak reserved bytes of one rank (learned only; -1: not estimated)
  int64_t analytical_bytes = 0;      // the analytical estimate (the sum of the breakdown), beside a learned answer
  bool out_of_range = false;         // the job lies outside the learned model's training range (note says how)
  std::string method;                // "analytical" or "learned"
  std::vector<Note> notes;           // codes: docs/design.md
};

JobEstimate analytical_job_estimate(const JobDescription& job);
std::string job_estimate_to_json(const JobEstimate& e);

}  // namespace gpucast
