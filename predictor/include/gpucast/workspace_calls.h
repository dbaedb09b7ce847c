// gpucast/workspace_calls.h: which calls of a probe's trace gpucast.forecast runs again at the target batch to
// measure the scratch the target's kernels take, and the bytes a call held above what it returned.
//
// cuDNN chooses each convolution's algorithm, and with it the workspace the call takes from the caching allocator,
// by the problem's size (a probe at batch 8 can run an algorithm with a 1 MB workspace where batch 64 runs one with
// 55 MiB, seen on an H200); on the CPU, oneDNN runs 16-bit matrix multiplies (and PyTorch's other CPU kernels some
// 32-bit ones) with a scratchpad taken from PyTorch's allocator inside the call, sized by its blocking of the problem
// (a ViT's weight-gradient multiply at batch 16 takes 197,760 bytes, at batch 32 865,408). Probes at small batches
// cannot show either. This file says which calls to run and at which shapes; the plugin runs them
// (plugin/ops_workspace.cpp) and the memory forecast models what they took instead of the probes' workspaces.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gpucast/trace.h"

namespace gpucast {

// ---- Convolutions (GPU probes) --------------------------------------------------------------------------------

// The convolution calls of one module in a probe: its first forward call's input (cuDNN's or MIOpen's own op, which
// sees the input as the kernel does) and whether a backward call ran and computed the input's gradient.
struct ConvCall {
  std::vector<int64_t> input_shape;  // never empty
  std::string input_dtype;           // "" where the trace did not record it
  std::string weight_dtype;
  bool backward = false;
  bool input_grad = false;
  bool operator==(const ConvCall&) const = default;
};

// By module path, in the order the modules' first convolution ran: aten::cudnn_convolution and
// aten::miopen_convolution are the forward calls, aten::convolution_backward the backward ones (its first output,
// the input's gradient, is undefined where none was asked for). Ops outside any module are left out, and so are
// modules with no forward call whose input shape was recorded.
std::vector<std::pair<std::string, ConvCall>> conv_calls(const Trace& probe);

// ---- Matrix multiplies (CPU probes) ---------------------------------------------------------------------------

// One operand of a call at the target batch: dense strides in the recorded layout's order of dimensions.
struct MatmulOperand {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::string dtype;  // one of float32, float16, bfloat16, float64
  bool operator==(const MatmulOperand&) const = default;
  bool operator<(const MatmulOperand& o) const {
    return std::tie(shape, strides, dtype) < std::tie(o.shape, o.strides, o.dtype);
  }
};

// One call: the op's name ("aten::addmm", default overload) and its tensor arguments in order; the other
// arguments keep their schema's defaults.
struct MatmulCall {
  std::string name;
  std::vector<MatmulOperand> operands;
  bool operator==(const MatmulCall&) const = default;
  bool operator<(const MatmulCall& o) const { return std::tie(name, operands) < std::tie(o.name, o.operands); }
};

struct MatmulCalls {
  std::map<int64_t, MatmulCall> calls;  // by the op's index in the largest probe's trace
  std::vector<std::string> skipped;     // calls left out, each with why
};

// The matrix-multiply calls (aten::mm, addmm, bmm, baddbmm, addbmm, not nested in another of them) of the largest
// probe `ref`, matched in order with those of the probe before it, `prev` (the same calls of the same modules in the
// same phase, whatever else the probes ran), at `batch`: each dimension of an operand extrapolated linearly from the
// two probes' batches, and only where it grows by a whole number per sample and stays at least 1 (rows = batch x
// tokens). Calls on another device than the CPU, or of another dtype, are left out silently: the CPU's kernels in
// those dtypes are the ones whose scratch depends on the problem. Where the probes' calls do not match, none is
// measured ("every call (...)"). Throws UserError where an operand's strides were not recorded (a layout that is
// not strided): the forecast then keeps every call's probe scratch.
MatmulCalls matmul_calls(const Trace& ref, const Trace& prev, int64_t ref_batch, int64_t prev_batch, int64_t batch);

// What a forecast for a large target may allocate and compute: operands of at most 1 GiB, calls of at most
// 4 GFLOP (some 0.1 s on one core).
inline constexpr int64_t kMaxMatmulOperandBytes = int64_t{1} << 30;
inline constexpr int64_t kMaxMatmulFlops = int64_t{4} << 30;

// The distinct calls to run, each once, with the op indices that take its measurement.
struct MatmulRuns {
  std::vector<MatmulCall> runs;
  std::vector<std::vector<int64_t>> ops;  // ops[i]: the op indices of runs[i], ascending
  std::vector<std::string> skipped;       // calls over a limit, each distinct call once, in the order of `calls`
};
MatmulRuns plan_matmul_runs(const std::map<int64_t, MatmulCall>& calls, int64_t max_bytes = kMaxMatmulOperandBytes,
                            int64_t max_flops = kMaxMatmulFlops);

// Bytes from an operand's first element to its last, both included (the storage a dense tensor needs).
int64_t operand_bytes(const MatmulOperand& x);
// Multiply-adds x 2 of a call whose last two operands are the multiplied ones ([..., m, k] @ [..., k, n]).
int64_t matmul_flops(const MatmulCall& call);

// ---- A call's transient bytes ---------------------------------------------------------------------------------

// Bytes a call held at its peak above what it held when it returned, from a memory trace around it alone: blocks
// held on `device`, from those held at the trace's start (what the process held before, block by block: the model,
// cuBLAS's workspaces) through each allocation and free. At least 0.
int64_t transient_bytes(const Trace& call, const std::string& device);

}  // namespace gpucast
