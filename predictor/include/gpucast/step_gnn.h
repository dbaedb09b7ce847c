// gpucast/step_gnn.h: ScaleDL's graph network for step-time forecasts, and its training.
//
// One training step is a DAG of layers: nodes carry the layer's kind, FLOPs, bytes and the layer model's predicted
// time; edges carry the bytes one layer passes to the next; the graph carries the job (batch, threads, optimizer,
// world size, strategy), the device (peak GFLOP/s, memory GB/s), the summed layer time and the communication time.
// The network (LibTorch nn): node encoder MLP -> 2 TransformerConv-style attention message-passing layers (query
// from the destination, key and value from the source plus a projection of the edge; softmax over each node's
// incoming edges, self-loop included; residual + LayerNorm) -> mean and max pooling over nodes -> with an MLP of
// the global features -> MLP -> two outputs squashed to log alpha, log beta = 1.5 tanh(o) (alpha, beta in [0.22,
// 4.5]; 1 at zero output, where training starts). The forecast is step_ms = alpha * sum_layers_ms + beta * comm_ms;
// training minimises the squared error of its log. A weights file holds an ensemble of such networks trained from
// different seeds ("members"); the correction is the mean of their log alpha and log beta. Features are standardised with the training set's mean and
// deviation, stored with the weights. So is where the training graphs lie: each graph's descriptor (its global
// features, its nodes' mean features and log node count, standardised over the training graphs); a graph whose
// nearest training descriptor is farther away than any training graph's nearest neighbour (the radius) lies
// outside what the network learned, and gets no correction (alpha = beta = 1, with the distance in the source).
// This header hides torch: the plugin and the training program include it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpucast/step_time.h"

namespace gpucast {

inline constexpr const char* kStepGnnName = "scaledl-gnn";
inline constexpr int kStepGnnVersion = 3;  // 2: an ensemble of networks ("members"); 3: the training graphs' place
// Bounds on a weights file: chosen, far above what training makes (5 members by default); not measured.
inline constexpr int64_t kMaxStepGnnMembers = 32;
inline constexpr int64_t kMaxStepGraphNodes = 65536;
inline constexpr int64_t kMaxStepGraphEdges = 1 << 20;

struct StepNode {
  std::string kind;     // matmul, conv, attention, norm, embedding, pool, elementwise, other
  double flops = 0;
  double bytes = 0;     // bytes the layer reads and writes
  double pred_ms = 0;   // the layer model's predicted time
};

struct StepEdge {
  int64_t src = 0;      // node indices; src feeds dst
  int64_t dst = 0;
  double bytes = 0;     // bytes passed from src to dst
};

struct StepGlobals {
  int64_t batch = 1;
  int64_t threads = 1;
  std::string optimizer = "sgd";   // sgd, adam, adamw, other
  int64_t world = 1;
  std::string strategy = "single"; // single, ddp, fsdp, tp, pp
  double peak_gflops = 1;
  double mem_gbps = 1;
};

struct StepGraph {
  std::vector<StepNode> nodes;
  std::vector<StepEdge> edges;
  StepGlobals globals;
  double sum_layers_ms = 0;
  double comm_ms = 0;
  double measured_ms = -1;         // -1: unknown (a graph only to be predicted)
  std::string family;
  std::string model;
};

// One JSON object (a line of the benchmark's JSON Lines file): {"family", "model", "global": {...}, "nodes":
// [{"kind", "flops", "bytes", "pred_ms"}, ...], "edges": [[src, dst, bytes], ...], "sum_layers_ms", "comm_ms",
// "measured_ms" (absent or null: unknown)}. Errors name `where` and the field ("data.jsonl:3: edges[2]: src 7 is
// not a node (4 nodes)"); an unknown kind, optimizer or strategy is an error that lists the known ones.
StepGraph step_graph_from_json(const std::string& text, const std::string& where);
// The graph as step_graph_from_json reads it (measured_ms null where unknown).
std::string step_graph_to_json(const StepGraph& graph);
// The same checks on a graph built in C++ (ranges, edge ends, names); errors name `where` and the field.
void validate_step_graph(const StepGraph& graph, const std::string& where);

struct StepCorrection {
  double alpha = 1;    // scales sum_layers_ms
  double beta = 1;     // scales comm_ms
  std::string source;  // "gnn", or "none: <why the network was not used>"
  double distance = -1;  // to the nearest training graph (standardised descriptors); -1: not computed
  double radius = -1;    // the farthest any training graph lies from its nearest neighbour; -1: no limit
  std::vector<int64_t> trained_batches;  // the training graphs' batch sizes (the weights' header); empty: not known
};

class StepGnn;  // the network and its normalisation

// Loads and validates a weights file (format, model name and version, configuration, normalisation, tensor names
// and shapes); errors name the path, what was expected and what was found, and say how to get a good file.
std::shared_ptr<const StepGnn> load_step_gnn(const std::string& path);
// The network's correction for one graph (validated first: a bad graph throws UserError).
StepCorrection step_correction(const StepGnn& model, const StepGraph& graph);
// What the plugin answers: the network's correction when `weights_path` loads (cached by path and modification
// time), else alpha = beta = 1 with source "none: <the error>". A bad file never throws; a bad graph does.
StepCorrection predict_step_correction(const StepGraph& graph, const std::string& weights_path);
// How a forecast step is corrected (correct_step_time): the forecast's target and sequence length, and what the
// graph network's global features need from the process (its optimizer, threads and this CPU's measured rates).
struct StepCorrectionSettings {
  bool enabled = true;          // false: no correction ("none: disabled (gnn=None)")
  std::string weights;          // a weights file; "": the shipped one (default_step_gnn_weights)
  std::string target = "cpu";   // the forecast's target
  int64_t seq_len = 0;          // > 0: a forecast scaled by sequence length
  std::string optimizer = "other";
  int64_t threads = 1;
  double peak_gflops = 1;
  double mem_gbps = 1;
};

// The graph network's input for a forecast step: the layers of the largest probe (by batch) at the forecast's
// per-rank batch (kind, FLOPs, bytes, the forecast's time), the bytes passed between them, the global settings, the
// forecast's compute as sum_layers_ms and its exposed communication as comm_ms.
StepGraph forecast_step_graph(const StepTimeForecast& f, const std::vector<IterationTiming>& timings,
                              const StepCorrectionSettings& s);

// Corrects a forecast step with the graph network, where it applies: CPU targets, no scaling by sequence length, a
// rank's batch within a factor kStepGnnBatchReach of the network's training batches (its weights' header), layers
// outside the optimizer's step, the step's place within the training steps' (StepCorrection::radius). With
// communication (world > 1) the network is asked about the rank's compute as a single-process step: alpha corrects
// it, beta stays 1 (it is trained without communication). Sets f.alpha, beta, correction and the corrected
// step_ms, compute_ms and exposed_comm_ms (step_ms by what alpha and beta add: a pipeline's bubble stays), or says
// in f.correction (and a note) why it did not. A bad graph throws UserError; a missing or bad weights file does not.
void correct_step_time(StepTimeForecast& f, const std::vector<IterationTiming>& timings,
                       const StepCorrectionSettings& s);

// The step with alpha and beta applied to its compute and exposed communication (the rest, a pipeline's bubble,
// stays): the one rule for a forecast (correct_step_time) and for a graph (step = sum_layers_ms + comm_ms).
inline double corrected_step_ms(double step_ms, double compute_ms, double exposed_comm_ms, double alpha, double beta) {
  return step_ms + (alpha - 1.0) * compute_ms + (beta - 1.0) * exposed_comm_ms;
}

// A rank's batch more than this factor outside the network's training batches is not corrected: its alpha
// extrapolates there (the shipped network, trained at batches 16 and 32, gave the zoo MLP at batch 256 alpha 0.57).
inline constexpr int64_t kStepGnnBatchReach = 2;

// $GPUCAST_STEP_GNN_WEIGHTS, else data/step_gnn.gcw beside the directory of the binary holding this code
// (lib/libgpucast.so in the installed package and the build tree, bin/gpucast-train in the build tree).
std::string default_step_gnn_weights();

struct StepGnnTrainOptions {
  uint64_t seed = 0;
  // Training settings: chosen defaults, no recorded sweep of them (weight_decay 1e-4, not AdamW's default 1e-2);
  // members 5: bench/results/HISTORY.md:558, 566-569 (one network 5.88 %, five 5.22 %, ten 5.12 % in-domain).
  int64_t max_epochs = 400;
  int64_t patience = 40;     // epochs without a better validation loss before stopping
  int64_t batch_size = 32;   // graphs per optimizer step
  double lr = 3e-3;
  double weight_decay = 1e-4;
  int64_t d_model = 32;
  int64_t members = 5;       // networks of the ensemble, seeds seed .. seed + members - 1
  // Member k stops early on the k-th tenth of the training and validation graphs pooled (in an order drawn from
  // the seed) and trains on the rest, instead of all members training on `train` and stopping on `val`.
  bool rotate_val = false;
  int threads = 0;           // 0: torch's default
  bool verbose = false;      // one line per epoch on stderr
};

struct StepGnnTrainResult {
  int64_t epochs = 0;        // the most epochs a member ran
  int64_t best_epoch = 0;    // the latest best epoch of a member; 0: no member beat alpha = beta = 1 (its start)
  double train_loss = 0;     // mean squared error of log step time of the written ensemble, training graphs
  double val_loss = 0;       // the same on the validation graphs (rotate_val: each member on the graphs it held out)
  double train_seconds = 0;
  double radius = -1;        // the applicability radius written with the weights (-1: no limit)
};

// Trains each member from a fixed seed (deterministic given the seed and the thread count) with early stopping on
// `val`, and writes the members' best weights to `out_path`. Every graph needs measured_ms > 0.
StepGnnTrainResult train_step_gnn(const std::vector<StepGraph>& train, const std::vector<StepGraph>& val,
                                  const StepGnnTrainOptions& options, const std::string& out_path);

}  // namespace gpucast
