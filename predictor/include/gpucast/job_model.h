// gpucast/job_model.h: the learned job-level memory model (a BiGRU-optimized Transformer) and its training.
//
// The network (LibTorch nn): per-layer features -> linear projection -> bidirectional GRU over the layer
// sequence -> Transformer encoder over the GRU states -> masked mean and max pooling -> MLP head that also reads
// the job-level features -> a correction in log space added to the log of the analytical estimate, so the model
// predicts log-bytes. Features are standardised with the training set's mean and deviation, stored with the
// weights. This header hides torch: the plugin and the training program include it; the core does not.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpucast/job.h"

namespace gpucast {

inline constexpr const char* kJobModelName = "bigru-transformer";
// 2: two outputs (allocated, and reserved above it), trained on relative error, with the training set's range.
inline constexpr int kJobModelVersion = 2;

// Widths: chosen defaults (no recorded sweep). dropout 0.1: nn.TransformerEncoderLayer's default (torch 2.14.1
// torch/nn/modules/transformer.py:750).
struct JobModelConfig {
  int64_t d_model = 32;     // projection width and GRU hidden size per direction
  int64_t heads = 4;        // attention heads of the encoder (over 2 * d_model)
  int64_t encoder_layers = 2;
  int64_t head_hidden = 64;
  double dropout = 0.1;
};

class LearnedJobModel;  // the network and its normalisation

// Loads and validates a weights file (format, model name and version, feature version, tensor names and shapes);
// errors name the path and say how to get a good file.
std::shared_ptr<const LearnedJobModel> load_job_model(const std::string& path);
// The learned estimate (method "learned"): bytes from the network; the breakdown fields are the analytical ones.
JobEstimate learned_job_estimate(const LearnedJobModel& model, const JobDescription& job);
// What the plugin answers: the learned estimate when `weights_path` loads (cached by path and modification
// time), else the analytical one with a note that says why.
JobEstimate predict_job_memory(const JobDescription& job, const std::string& weights_path);

struct TrainingJob {
  JobDescription job;
  int64_t label_bytes = 0;           // peak allocated bytes of one rank
  int64_t label_reserved_bytes = 0;  // peak reserved bytes (0: not known, e.g. a CPU-allocator label)
};

struct TrainOptions {
  JobModelConfig model;
  uint64_t seed = 0;
  // Training settings: chosen defaults, no recorded sweep of them (weight_decay 1e-4, not AdamW's default 1e-2).
  int64_t max_epochs = 300;
  int64_t patience = 30;     // epochs without a better validation loss before stopping
  int64_t batch_size = 32;
  double lr = 2e-3;
  double weight_decay = 1e-4;
  int threads = 0;           // 0: torch's default
  bool verbose = false;      // one line per epoch on stderr
};

struct TrainResult {
  int64_t epochs = 0;
  int64_t best_epoch = 0;
  double best_val_loss = 0;  // mean relative error on the validation split (allocated, plus reserved where known)
  double train_seconds = 0;
};

// Trains from a fixed seed with early stopping on `val` and writes the best weights to `out_path`.
TrainResult train_job_model(const std::vector<TrainingJob>& train, const std::vector<TrainingJob>& val,
                            const TrainOptions& options, const std::string& out_path);

// The data pointers of the storages gpucast's loaded learned models hold (the job model's and the step graph
// network's parameters and buffers, loaded once per process): gpucast's own memory, not the training job's.
std::vector<int64_t> owned_storages();

}  // namespace gpucast
