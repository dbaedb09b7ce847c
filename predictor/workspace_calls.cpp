// Which calls gpucast.forecast measures again at the target batch (gpucast/workspace_calls.h).
#include "gpucast/workspace_calls.h"

#include <algorithm>
#include <array>
#include <limits>
#include <numeric>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "gpucast/error.h"

namespace gpucast {
namespace {

constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();

// The first tensor of a Tensor argument; nullptr for any other kind, or where none was recorded (record_shapes off).
const TensorMeta* tensor_of(const Value& v) {
  return v.kind == Value::Kind::Tensor && !v.tensors.empty() ? &v.tensors.front() : nullptr;
}

// a * b and a + b, held at kSaturated where they would overflow: sizes of absurd targets are then over every limit.
int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? kSaturated : out;
}
int64_t saturating_add(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kSaturated : out;
}

// "[[192, 561], [561, 192]]": the operands' shapes, as the skipped texts have always written them (Python's repr of a
// list of lists).
std::string shapes_text(const MatmulCall& call) {
  std::string out = "[";
  for (size_t i = 0; i < call.operands.size(); ++i) {
    out += i == 0 ? "[" : ", [";
    const std::vector<int64_t>& s = call.operands[i].shape;
    for (size_t k = 0; k < s.size(); ++k) out += (k == 0 ? "" : ", ") + std::to_string(s[k]);
    out += "]";
  }
  return out + "]";
}

// ---- Convolutions ----

// cuDNN's and MIOpen's own forward ops see the input as the kernel does (after convolution's reshapes); the backward
// of both is aten::convolution_backward (aten/src/ATen/native/Convolution.cpp).
enum class ConvPass { None, Forward, Backward };
ConvPass conv_pass(std::string_view name) {
  if (name == "aten::cudnn_convolution" || name == "aten::miopen_convolution") return ConvPass::Forward;
  if (name == "aten::convolution_backward") return ConvPass::Backward;
  return ConvPass::None;
}

// ---- Matrix multiplies ----

constexpr std::array<std::string_view, 5> kMatmuls = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                                                      "aten::addbmm"};
constexpr std::array<std::string_view, 4> kMatmulDtypes = {"float32", "float16", "bfloat16", "float64"};

bool is_matmul(std::string_view name) { return std::find(kMatmuls.begin(), kMatmuls.end(), name) != kMatmuls.end(); }

int64_t element_bytes(std::string_view dtype) {
  if (dtype == "float64") return 8;
  if (dtype == "float32") return 4;
  if (dtype == "float16" || dtype == "bfloat16") return 2;
  GPUCAST_USER_ERROR("a matrix multiply's operand of dtype '{}': expected one of float32, float16, bfloat16, float64",
                     valid_utf8(dtype));
}

// The matrix-multiply ops of a trace not nested in another of them (whose own scratch is measured with it), in
// order.
std::vector<const OpRecord*> outer_matmuls(const Trace& t) {
  std::vector<const OpRecord*> out;
  const auto n = static_cast<int64_t>(t.ops.size());
  for (const OpRecord& op : t.ops) {
    if (!is_matmul(op.name)) continue;
    if (op.parent >= 0 && op.parent < n && is_matmul(t.ops[static_cast<size_t>(op.parent)].name)) continue;
    out.push_back(&op);
  }
  return out;
}

bool same_calls(const std::vector<const OpRecord*>& a, const std::vector<const OpRecord*>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const OpRecord* x, const OpRecord* y) {
    return x->name == y->name && x->module == y->module && x->phase == y->phase;
  });
}

// The tensor arguments of an op (Tensor kind, recorded or not), in order.
std::vector<const Value*> tensor_args(const OpRecord& op) {
  std::vector<const Value*> out;
  for (const Value& v : op.inputs) {
    if (v.kind == Value::Kind::Tensor) out.push_back(&v);
  }
  return out;
}

// A call the CPU's kernels run with a scratch that depends on the problem: every tensor argument recorded, on the
// CPU, in one of kMatmulDtypes.
bool measurable(const std::vector<const Value*>& tensors) {
  if (tensors.empty()) return false;
  return std::all_of(tensors.begin(), tensors.end(), [](const Value* v) {
    const TensorMeta* t = tensor_of(*v);
    return t != nullptr && t->device == "cpu" &&
           std::find(kMatmulDtypes.begin(), kMatmulDtypes.end(), t->dtype) != kMatmulDtypes.end();
  });
}

// The shape at `batch` from the shapes at the two probes' batches; nullopt where a dimension does not grow by a
// whole number per sample, or would be under 1.
std::optional<std::vector<int64_t>> extrapolate(const std::vector<int64_t>& ref, const std::vector<int64_t>& prev,
                                                int64_t ref_batch, int64_t prev_batch, int64_t batch) {
  if (ref.size() != prev.size() || ref_batch == prev_batch) return std::nullopt;
  const int64_t samples = ref_batch - prev_batch;
  std::vector<int64_t> out;
  for (size_t i = 0; i < ref.size(); ++i) {
    int64_t step = 0;
    if (__builtin_mul_overflow(ref[i] - prev[i], batch - ref_batch, &step) || step % samples != 0) return std::nullopt;
    int64_t d = 0;
    if (__builtin_add_overflow(ref[i], step / samples, &d) || d < 1) return std::nullopt;
    out.push_back(d);
  }
  return out;
}

// Dense strides for `shape` in the recorded layout's order of dimensions, innermost first: a transposed operand stays
// transposed; a broadcast dimension (recorded stride 0) keeps its stride 0; dimensions of equal recorded stride are
// laid out with the earlier one inner.
std::vector<int64_t> dense_strides(const std::vector<int64_t>& shape, const std::vector<int64_t>& recorded) {
  std::vector<size_t> order(shape.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return recorded[a] != recorded[b] ? recorded[a] < recorded[b] : a < b;
  });
  std::vector<int64_t> strides(shape.size(), 0);
  int64_t step = 1;
  for (size_t i : order) {
    if (recorded[i] == 0) continue;
    strides[i] = step;
    step = saturating_mul(step, shape[i]);
  }
  return strides;
}

// The operands of `op` at `batch`, from the matching call `other` of the other probe; nullopt where a shape does not
// extrapolate (or the calls' tensor arguments differ in number).
std::optional<std::vector<MatmulOperand>> operands_at(const OpRecord& op, const std::vector<const Value*>& tensors,
                                                      const OpRecord& other, int64_t ref_batch, int64_t prev_batch,
                                                      int64_t batch) {
  const std::vector<const Value*> other_tensors = tensor_args(other);
  if (other_tensors.size() != tensors.size()) return std::nullopt;
  std::vector<MatmulOperand> out;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorMeta& x = *tensor_of(*tensors[k]);
    const TensorMeta* y = tensor_of(*other_tensors[k]);
    std::optional<std::vector<int64_t>> shape =
        extrapolate(x.shape, y != nullptr ? y->shape : std::vector<int64_t>{}, ref_batch, prev_batch, batch);
    if (!shape) return std::nullopt;
    if (x.strides.size() < x.shape.size()) {
      GPUCAST_USER_ERROR("{} of {}: an operand's strides were not recorded (a layout that is not strided)",
                         valid_utf8(op.name), op.module.empty() ? "no module" : valid_utf8(op.module));
    }
    std::vector<int64_t> strides = dense_strides(*shape, x.strides);
    out.push_back(MatmulOperand{std::move(*shape), std::move(strides), x.dtype});
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, ConvCall>> conv_calls(const Trace& probe) {
  std::vector<std::pair<std::string, ConvCall>> calls;  // in the order of each module's first call
  std::vector<bool> has_input;
  std::map<std::string, size_t> index;
  for (const OpRecord& op : probe.ops) {
    const ConvPass pass = conv_pass(op.name);
    if (pass == ConvPass::None || op.module.empty()) continue;
    auto [it, added] = index.try_emplace(op.module, calls.size());
    if (added) {
      calls.emplace_back(op.module, ConvCall{});
      has_input.push_back(false);
    }
    ConvCall& c = calls[it->second].second;
    if (pass == ConvPass::Forward) {
      if (has_input[it->second] || op.inputs.size() < 2) continue;
      const TensorMeta* x = tensor_of(op.inputs[0]);
      if (x == nullptr || x->shape.empty()) continue;
      const TensorMeta* w = tensor_of(op.inputs[1]);
      c.input_shape = x->shape;
      c.input_dtype = x->dtype;
      c.weight_dtype = w != nullptr ? w->dtype : "";
      has_input[it->second] = true;
    } else {
      c.backward = true;
      const TensorMeta* grad_input = op.outputs.empty() ? nullptr : tensor_of(op.outputs.front());
      c.input_grad = c.input_grad || (grad_input != nullptr && !grad_input->shape.empty());
    }
  }
  std::vector<std::pair<std::string, ConvCall>> out;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (has_input[i]) out.push_back(std::move(calls[i]));
  }
  return out;
}

MatmulCalls matmul_calls(const Trace& ref, const Trace& prev, int64_t ref_batch, int64_t prev_batch, int64_t batch) {
  const std::vector<const OpRecord*> a = outer_matmuls(ref), b = outer_matmuls(prev);
  MatmulCalls out;
  if (!same_calls(a, b)) {
    out.skipped.push_back(
        fmt::format("every call (the probes' matrix multiplies differ: {} and {} calls)", a.size(), b.size()));
    return out;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    const OpRecord& op = *a[i];
    const std::vector<const Value*> tensors = tensor_args(op);
    if (!measurable(tensors)) continue;
    std::optional<std::vector<MatmulOperand>> operands = operands_at(op, tensors, *b[i], ref_batch, prev_batch, batch);
    if (!operands) {
      out.skipped.push_back(fmt::format("{} of {} (its shapes do not scale with the batch)", op.name,
                                        op.module.empty() ? "no module" : op.module));
      continue;
    }
    out.calls[op.id] = MatmulCall{op.name, std::move(*operands)};
  }
  return out;
}

int64_t operand_bytes(const MatmulOperand& x) {
  int64_t extent = 1;
  for (size_t k = 0; k < x.shape.size() && k < x.strides.size(); ++k) {
    extent = saturating_add(extent, saturating_mul(x.shape[k] - 1, x.strides[k]));
  }
  return saturating_mul(extent, element_bytes(x.dtype));
}

int64_t matmul_flops(const MatmulCall& call) {
  const size_t n = call.operands.size();
  if (n < 2 || call.operands[n - 1].shape.empty()) {
    GPUCAST_USER_ERROR("{}: expected its last two operands to be the multiplied matrices", valid_utf8(call.name));
  }
  int64_t flops = saturating_mul(2, call.operands[n - 1].shape.back());
  for (int64_t d : call.operands[n - 2].shape) flops = saturating_mul(flops, d);
  return flops;
}

MatmulRuns plan_matmul_runs(const std::map<int64_t, MatmulCall>& calls, int64_t max_bytes, int64_t max_flops) {
  MatmulRuns out;
  std::map<MatmulCall, int64_t> done;  // a distinct call: its index in out.runs, or -1 where it is not run
  for (const auto& [op, call] : calls) {
    auto it = done.find(call);
    if (it == done.end()) {
      int64_t bytes = 0;
      for (const MatmulOperand& x : call.operands) bytes = saturating_add(bytes, operand_bytes(x));
      int64_t run = -1;
      if (bytes > max_bytes) {
        out.skipped.push_back(fmt::format("{} {} (operands of {} bytes at the target batch)", call.name,
                                          shapes_text(call), bytes));
      } else if (const int64_t flops = matmul_flops(call); flops > max_flops) {
        out.skipped.push_back(fmt::format("{} {} ({} FLOP at the target batch)", call.name, shapes_text(call), flops));
      } else {
        run = static_cast<int64_t>(out.runs.size());
        out.runs.push_back(call);
        out.ops.emplace_back();
      }
      it = done.emplace(call, run).first;
    }
    if (it->second >= 0) out.ops[static_cast<size_t>(it->second)].push_back(op);
  }
  return out;
}

int64_t transient_bytes(const Trace& call, const std::string& device) {
  int64_t held = 0;
  for (const Allocation& a : call.allocations) {
    if (a.baseline && a.device == device) held += a.block_bytes;
  }
  int64_t peak = held;
  for (const MemEvent& e : call.events) {
    if (e.device != device || e.allocation < 0) continue;
    held += e.block_bytes;
    peak = std::max(peak, held);
  }
  return std::max<int64_t>(0, peak - held);
}

}  // namespace gpucast
