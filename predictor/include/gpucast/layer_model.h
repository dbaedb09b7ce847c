// gpucast/layer_model.h: per-layer step times from a few timed layers, by a roofline fitted per kind of layer.
//
// Each layer of the traced iteration gets cost features: forward FLOPs (2 per multiply-add) and bytes its top-level
// forward ops read and write, their count, and a kind (matmul, conv, attention, norm, embedding, pool, elementwise)
// from its costliest op. A layer's time in one pass is a nonlinear roofline
//   t = ops * overhead + max(flops / F, bytes / B)
// with backward priced as 2x the forward FLOPs and bytes. The prior takes F, B and the overhead from the device's
// peak rates; measured layers refit them per kind (and per pass) by least squares on relative errors: a log grid
// over F and B around the prior, then a pattern search, the overhead solved in closed form at every point. Kinds
// without enough measurements fall back to a fit pooled over all measured layers, the prior scaled to them, or the
// prior. Which layers to measure is a D-optimal design (Fedorov exchange) over log cost features.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

// ---- Cost features ------------------------------------------------------------------------------------------

// The kinds a layer can have, in the order design_row() one-hot encodes them.
inline constexpr std::array<std::string_view, 7> kLayerCostKinds = {"matmul", "conv",      "attention",  "norm",
                                                                    "embedding", "pool", "elementwise"};

// The kind of one op by its name ("aten::addmm" or "addmm"):
//   matmul: mm, addmm, bmm, baddbmm, matmul, linear, einsum (and mv, addmv, dot, addbmm, _addmm_activation);
//   conv: convolution, _convolution, conv1d/2d/3d, conv_transpose1d/2d/3d, cudnn_/mkldnn_/miopen_convolution...;
//   attention: scaled_dot_product_attention and its _flash / _efficient / _cudnn / _math variants;
//   norm: layer_norm, native_layer_norm, batch_norm, native_batch_norm, group_norm, rms_norm, _fused_rms_norm...;
//   embedding: embedding, embedding_bag; pool: max_pool*, avg_pool*, adaptive_*; everything else: elementwise.
std::string_view op_cost_kind(std::string_view name);

// PyTorch's CPU im2col convolution (aten::thnn_conv2d, aten::slow_conv3d): what it runs for 1x1, stride-1
// kernels on one thread below batch 16, where from 16 on it runs mkldnn.
bool is_im2col_conv(std::string_view name);

// Forward FLOPs of one op from its recorded shapes, 2 per multiply-add:
//   mm, addmm (mat1 [M,K], mat2 [K,N]), linear (input [...,K], weight [N,K]), matmul (broadcast batch dims):
//     2 * batch * M * N * K; bmm, baddbmm: 2 * B * M * N * K;
//   convolution: 2 * N * C_out * prod(out spatial) * (C_in / groups) * prod(kernel), read off the output and the
//     weight [C_out, C_in / groups, kernel...] (transposed: 2 * N * C_in * prod(in spatial) * weight[1] * kernel);
//   scaled_dot_product_attention (q [..., L, E], k [..., S, E], v [..., S, Ev]): 2 * batch * L * S * (E + Ev);
//   einsum (the equation is not recorded): 2 * sqrt(|a| |b| |out|), exact for a plain matrix product;
//   norms and softmax: 5 per output element; views and reshapes: 0; every other op: 1 per output element.
// Missing or inconsistent shapes give 0; never throws.
double op_flops(const OpRecord& op);
// Bytes of the op's input and output tensors (element size from the dtype: 8 float64/int64/complex64,
// 4 float32/int32, 2 float16/bfloat16/int16, 1 int8/uint8/bool/float8, 16 complex128, unknown 4; undefined
// tensors 0); 0 for views and reshapes, which move no data.
double op_bytes(const OpRecord& op);

// A layer's forward work of one kind and precision: what a device without measurements prices kind by kind
// (gpu_rates.h), as the ops run one after the other.
struct CostPart {
  std::string kind = "elementwise";  // one of kLayerCostKinds
  bool half = false;            // 16-bit floating point (float16, bfloat16 inputs): tensor-core rates
  double flops = 0;
  double bytes = 0;
  int64_t kernels = 0;          // its ops that move data (views and reshapes launch no kernel)
  bool operator==(const CostPart&) const = default;
};

struct LayerCost {
  std::string layer;            // module path; "(outside modules)" for ops outside any module
  std::string kind = "elementwise";  // one of kLayerCostKinds
  double flops = 0;             // forward
  double bytes = 0;             // forward: inputs and outputs of its top-level ops
  int64_t ops = 0;              // top-level forward ops
  std::vector<CostPart> parts = {};  // the same FLOPs and bytes by each top-level op's kind and precision
  // The forward ops backward runs again (activation checkpointing recomputes them to rebuild what it did not save):
  // their FLOPs and bytes by kind and precision, costed as forward work inside the backward pass.
  std::vector<CostPart> recompute = {};
};

// The layers of the last complete iteration, grouped and ordered as iteration_timing() groups them (step_time.h):
// top-level forward ops by module path, in the order layers first appear (a layer seen only in backward is listed
// with no ops), and each layer's recomputed forward ops: ops that record an autograd sequence number inside a
// backward node (they build a graph in backward: torch.utils.checkpoint's recomputation), outermost first, in the
// layer of their module (the node's when they have none). A composite op with no formula of its own (einsum, an unknown op around matmuls) is costed by its
// matmul, conv and attention descendants. The layer's kind is that of its op with the most FLOPs; a tie between
// kinds, or no FLOPs at all, gives "elementwise".
std::vector<LayerCost> layer_costs(const Trace& t);

// ---- Time model ---------------------------------------------------------------------------------------------

struct DeviceRates {
  double flops_per_s = 0;
  double bytes_per_s = 0;
  double op_overhead_s = 0;  // per top-level op (launch, dispatch)
};

// The roofline time of a layer in one pass: ops * overhead + max(flops / F, bytes / B), with the FLOPs and bytes
// doubled for Phase::Backward (any other phase is priced as forward).
double roofline_ns(const LayerCost& c, const DeviceRates& r, Phase pass);

struct LayerSample {
  size_t index = 0;  // into the costs given to fit()
  double forward_ns = 0;
  double backward_ns = 0;  // a pass measured as 0 (or not finite) is not used for that pass
};

struct LayerPrediction {
  double forward_ns = 0;
  double backward_ns = 0;
  // "kind" (fitted on layers of its kind), "pooled" (fitted on all measured layers), "scaled_prior" (the prior
  // scaled by the median measured / prior ratio) or "prior"; when the passes differ, the less specific one.
  // Measured layers are the caller's: predict() never answers "measured".
  std::string source;
};

// One pass's model for one kind.
struct PassFit {
  DeviceRates rates;         // backward rates apply to the doubled FLOPs and bytes
  std::string source = "prior";
  size_t samples = 0;        // measurements it was fitted on
  double rms_rel_error = 0;  // over those measurements
  double max_work_s = 0;     // the largest roofline work (prior rates, no overhead) among them
};

struct KindFit {
  std::string kind;
  PassFit forward, backward;
};

class LayerTimeModel {
 public:
  // Per kind and pass: >= 2 usable measurements: F, B > 0 and overhead >= 0 fitted; 1: the prior scaled by one
  // factor to it; none: the pooled fit over all measurements (>= 2; for matmul, conv and attention over those
  // three kinds' measurements only), the prior scaled by their median measured / prior ratio (1), or the prior. Deterministic. Errors (UserError): a prior rate not positive (overhead
  // negative), a sample's index out of range.
  void fit(const std::vector<LayerCost>& costs, const std::vector<LayerSample>& samples, const DeviceRates& prior);
  // UserError before fit(). Beyond 4x the largest work (the prior's roofline without overhead) of the layers a
  // pass was fitted on, that pass prices the work at the prior's rates (keeping its fitted overhead), source "prior".
  // With `reach` (the same layer at the largest size it is priced at), that decision is taken on reach's work,
  // so that one layer priced at several batch sizes is priced the same way at each.
  LayerPrediction predict(const LayerCost& c, const LayerCost* reach = nullptr) const;
  // The model predict() uses for a kind (the fallback for a kind without measurements or not in kLayerCostKinds).
  const KindFit& fit_for(std::string_view kind) const;
  // One line per kind: measurements, fitted rates and errors of each pass, and the fallback's.
  std::string describe() const;

 private:
  bool fitted_ = false;
  DeviceRates prior_;
  std::array<KindFit, kLayerCostKinds.size()> kinds_;
  KindFit fallback_;
};

// ---- Which layers to time -----------------------------------------------------------------------------------

// A layer's row for the design: one-hot kind (7, in kLayerCostKinds order), log1p(flops), log1p(bytes),
// log1p(ops). The one-hot columns act as per-kind intercepts (no separate constant column, which they would make
// collinear) of the surrogate log t ~ kind + a log flops + b log bytes + c log ops.
std::vector<double> design_row(const LayerCost& c);

// log det(sum over rows of a a^T + 1e-9 I): what d_optimal_design maximizes.
double design_log_det(const std::vector<std::vector<double>>& candidates, const std::vector<size_t>& rows);

// k distinct rows maximizing design_log_det, by Fedorov exchange (each chosen row in turn swapped for the unchosen
// row that raises the determinant most, until a pass improves nothing; at most 100 passes) from a greedy start
// (seed 0: each next row the one that raises the determinant most) or a random one (other seeds). Sorted indices;
// all rows when k >= their count. Errors (UserError): rows of different lengths, values not finite.
std::vector<size_t> d_optimal_design(const std::vector<std::vector<double>>& candidates, size_t k, uint64_t seed = 0);

// k distinct indices out of n drawn uniformly (sorted); the baseline d_optimal_design is compared with.
std::vector<size_t> random_design(size_t n, size_t k, uint64_t seed);

// The layers to time: k = max(1, ceil(fraction * n)) of the n layers, stratified by kind as the layer models are
// fitted (one model per kind): one layer per kind (with fewer layers than kinds, the kinds with the most layers),
// the rest spread over the kinds in proportion to their number of layers (largest remainders); within each kind
// a D-optimal design (Fedorov exchange, `seed` as for d_optimal_design) over that kind's model features (an
// intercept, log FLOPs, log bytes, log ops), its costliest layer (most FLOPs, then bytes) always in it. Sorted
// indices. Errors (UserError): fraction outside (0, 1].
std::vector<size_t> choose_layers_to_time(const std::vector<LayerCost>& costs, double fraction, uint64_t seed = 0);

}  // namespace gpucast
