// Which calls gpucast.forecast measures again at the target batch (gpucast/workspace_calls.h), over hand-built
// traces: the convolutions of a GPU probe, the matrix multiplies of two CPU probes at the target's shapes, the limits
// on what is run, and a call's transient bytes.
#include <gtest/gtest.h>

#include "gpucast/workspace_calls.h"
#include "user_error.h"

namespace gpucast {
namespace {

using test_util::user_error;

}  // namespace

// Readable failures: a call as the skipped texts write it, with strides and dtypes.
void PrintTo(const MatmulOperand& x, std::ostream* os) {
  *os << testing::PrintToString(x.shape) << " strides " << testing::PrintToString(x.strides) << " " << x.dtype;
}
void PrintTo(const MatmulCall& c, std::ostream* os) {
  *os << c.name << " " << testing::PrintToString(c.operands);
}
void PrintTo(const ConvCall& c, std::ostream* os) {
  *os << testing::PrintToString(c.input_shape) << " " << c.input_dtype << "/" << c.weight_dtype
      << (c.backward ? " backward" : "") << (c.input_grad ? " input_grad" : "");
}

namespace {

Value tensor(std::vector<int64_t> shape, std::vector<int64_t> strides, std::string dtype = "bfloat16",
             std::string device = "cpu") {
  Value v;
  v.kind = Value::Kind::Tensor;
  v.tensors.push_back(TensorMeta{std::move(shape), std::move(strides), std::move(dtype), std::move(device), 0});
  return v;
}

// An undefined tensor as the tracer records it (convolution_backward's input gradient where none was asked for).
Value undefined_tensor() { return tensor({}, {}, ""); }

// Appends an op (its id its index) and returns its index.
int64_t add_op(Trace& t, std::string name, std::string module, std::vector<Value> inputs, int64_t parent = -1,
               Phase phase = Phase::Forward, std::vector<Value> outputs = {}) {
  OpRecord op;
  op.id = static_cast<int64_t>(t.ops.size());
  op.name = std::move(name);
  op.module = std::move(module);
  op.inputs = std::move(inputs);
  op.outputs = std::move(outputs);
  op.parent = parent;
  op.phase = phase;
  t.ops.push_back(std::move(op));
  return t.ops.back().id;
}

// ---- Convolutions ----

TEST(ConvCalls, ByModuleInTheOrderTheyFirstRan) {
  Trace t;
  const Value w = tensor({32, 3, 3, 3}, {27, 9, 3, 1}, "float32", "cuda:0");
  // aten::convolution, the op the module calls, is not cuDNN's own: its input is not the kernel's.
  add_op(t, "aten::convolution", "CNN.features.0", {tensor({8, 3, 32, 32}, {3072, 1024, 32, 1}, "float32"), w});
  add_op(t, "aten::cudnn_convolution", "CNN.features.4",
         {tensor({8, 32, 16, 16}, {8192, 256, 16, 1}, "float16", "cuda:0"), tensor({64, 32, 3, 3}, {}, "float32")});
  add_op(t, "aten::cudnn_convolution", "CNN.features.0",
         {tensor({8, 3, 32, 32}, {3072, 1024, 32, 1}, "float32", "cuda:0"), w});
  // A second forward call of a module (the next iteration, another batch) keeps the first one's input.
  add_op(t, "aten::cudnn_convolution", "CNN.features.0",
         {tensor({4, 3, 32, 32}, {3072, 1024, 32, 1}, "float16", "cuda:0"), w});
  add_op(t, "aten::miopen_convolution", "CNN.head", {tensor({8, 64, 8, 8}, {}, "bfloat16"), Value{}});
  add_op(t, "aten::cudnn_convolution", "", {tensor({8, 3, 32, 32}, {}), w});        // outside any module
  add_op(t, "aten::cudnn_convolution", "CNN.unrecorded", {Value{}, Value{}});      // record_shapes off
  add_op(t, "aten::convolution_backward", "CNN.features.4", {}, -1, Phase::Backward,
         {tensor({8, 32, 16, 16}, {}), tensor({64, 32, 3, 3}, {})});
  // The data's convolution computes no input gradient; a later one with it would say it does.
  add_op(t, "aten::convolution_backward", "CNN.features.0", {}, -1, Phase::Backward,
         {undefined_tensor(), tensor({32, 3, 3, 3}, {})});
  add_op(t, "aten::convolution_backward", "CNN.unrecorded", {}, -1, Phase::Backward, {});
  const std::vector<std::pair<std::string, ConvCall>> calls = conv_calls(t);
  const std::vector<std::pair<std::string, ConvCall>> expected = {
      {"CNN.features.4", ConvCall{{8, 32, 16, 16}, "float16", "float32", true, true}},
      {"CNN.features.0", ConvCall{{8, 3, 32, 32}, "float32", "float32", true, false}},
      {"CNN.head", ConvCall{{8, 64, 8, 8}, "bfloat16", "", false, false}},
  };
  EXPECT_EQ(calls, expected);
}

// ---- Matrix multiplies ----

// Batch b of two probes (17 tokens per sample): a weight gradient (its first operand transposed), an addmm with a
// bias, a multiply inside it (measured with it), a multiply on the GPU (not the CPU kernels'), and one whose rows do
// not grow by a whole number per sample; then other ops, as many as the batch (not matched). `first` false: the
// weight gradient left out.
Trace matmul_probe(int64_t b, bool first = true) {
  Trace t;
  const int64_t rows = 17 * b;
  const Value alpha = float_scalar(1.0);
  if (first) add_op(t, "aten::mm", "Net.fc", {tensor({192, rows}, {1, 192}), tensor({rows, 192}, {192, 1}), alpha});
  const int64_t addmm = add_op(t, "aten::addmm", "Net.fc",
                               {tensor({576}, {1}), tensor({rows, 192}, {192, 1}), tensor({192, 576}, {1, 192})});
  add_op(t, "aten::mm", "Net.fc", {tensor({rows, 192}, {192, 1}), tensor({192, 192}, {192, 1})}, addmm);
  add_op(t, "aten::mm", "Net.fc", {tensor({rows, 192}, {192, 1}, "bfloat16", "cuda:0"), tensor({192, 192}, {192, 1})});
  add_op(t, "aten::mm", "Net.fc", {tensor({rows + (b == 8 ? 1 : 0), 8}, {8, 1}), tensor({8, 8}, {8, 1})});
  for (int64_t i = 0; i < b; ++i) add_op(t, "aten::relu", "Net.act", {});
  return t;
}

MatmulCall weight_gradient_at_33() {
  return MatmulCall{"aten::mm", {{{192, 561}, {1, 192}, "bfloat16"}, {{561, 192}, {192, 1}, "bfloat16"}}};
}
MatmulCall addmm_at_33() {
  return MatmulCall{"aten::addmm",
                    {{{576}, {1}, "bfloat16"}, {{561, 192}, {192, 1}, "bfloat16"}, {{192, 576}, {1, 192}, "bfloat16"}}};
}

TEST(MatmulCalls, AtTheTargetBatchsShapesInTheRecordedLayouts) {
  const MatmulCalls c = matmul_calls(matmul_probe(8), matmul_probe(4), 8, 4, 33);
  const std::map<int64_t, MatmulCall> expected = {{0, weight_gradient_at_33()}, {1, addmm_at_33()}};
  EXPECT_EQ(c.calls, expected);
  EXPECT_EQ(c.skipped, std::vector<std::string>{"aten::mm of Net.fc (its shapes do not scale with the batch)"});
}

TEST(MatmulCalls, NoneWhereTheProbesCallsDiffer) {
  const MatmulCalls c = matmul_calls(matmul_probe(8), matmul_probe(4, /*first=*/false), 8, 4, 33);
  EXPECT_TRUE(c.calls.empty());
  EXPECT_EQ(c.skipped, std::vector<std::string>{"every call (the probes' matrix multiplies differ: 4 and 3 calls)"});
}

TEST(MatmulCalls, ShapesThatShrinkBelowOneOrAProbeAtTheSameBatchDoNotScale) {
  Trace ref, prev;
  add_op(ref, "aten::bmm", "", {tensor({2, 10, 4}, {40, 4, 1}, "float32"), tensor({2, 4, 4}, {16, 4, 1}, "float32")});
  add_op(prev, "aten::bmm", "", {tensor({2, 5, 4}, {20, 4, 1}, "float32"), tensor({2, 4, 4}, {16, 4, 1}, "float32")});
  // 10 rows at batch 2, 5 at batch 1: none at batch 0.
  EXPECT_EQ(matmul_calls(ref, prev, 2, 1, 0).skipped,
            std::vector<std::string>{"aten::bmm of no module (its shapes do not scale with the batch)"});
  EXPECT_EQ(matmul_calls(ref, ref, 2, 2, 4).skipped,
            std::vector<std::string>{"aten::bmm of no module (its shapes do not scale with the batch)"});
  const MatmulCalls at_6 = matmul_calls(ref, prev, 2, 1, 6);
  EXPECT_EQ(at_6.calls.at(0).operands[0].shape, (std::vector<int64_t>{2, 30, 4}));
}

TEST(MatmulCalls, ABroadcastOperandKeepsItsZeroStrides) {
  Trace ref, prev;
  // A bias expanded over a batch of one and the rows (strides 0).
  add_op(ref, "aten::baddbmm", "M",
         {tensor({1, 16, 8}, {0, 0, 1}, "float32"), tensor({1, 16, 4}, {64, 4, 1}, "float32"),
          tensor({1, 4, 8}, {32, 8, 1}, "float32")});
  add_op(prev, "aten::baddbmm", "M",
         {tensor({1, 8, 8}, {0, 0, 1}, "float32"), tensor({1, 8, 4}, {32, 4, 1}, "float32"),
          tensor({1, 4, 8}, {32, 8, 1}, "float32")});
  const MatmulCall c = matmul_calls(ref, prev, 2, 1, 3).calls.at(0);
  EXPECT_EQ(c.operands[0], (MatmulOperand{{1, 24, 8}, {0, 0, 1}, "float32"}));
  EXPECT_EQ(c.operands[1], (MatmulOperand{{1, 24, 4}, {96, 4, 1}, "float32"}));
  EXPECT_EQ(c.operands[2], (MatmulOperand{{1, 4, 8}, {32, 8, 1}, "float32"}));
  EXPECT_EQ(operand_bytes(c.operands[0]), 8 * 4);
  EXPECT_EQ(operand_bytes(c.operands[1]), 96 * 4);
}

TEST(MatmulCalls, AnOperandWithoutStridesLeavesEveryCallToTheProbes) {
  Trace ref, prev;
  add_op(ref, "aten::mm", "Net.fc", {tensor({8, 4}, {}, "float32"), tensor({4, 4}, {4, 1}, "float32")});
  add_op(prev, "aten::mm", "Net.fc", {tensor({4, 4}, {}, "float32"), tensor({4, 4}, {4, 1}, "float32")});
  EXPECT_EQ(user_error([&] { matmul_calls(ref, prev, 2, 1, 3); }),
            "aten::mm of Net.fc: an operand's strides were not recorded (a layout that is not strided)");
}

TEST(MatmulRuns, EachDistinctCallOnceWithinTheLimits) {
  const std::map<int64_t, MatmulCall> calls = {{0, weight_gradient_at_33()}, {5, weight_gradient_at_33()},
                                               {1, addmm_at_33()}};
  // The addmm's operands: (576 + 561 x 192 + 192 x 576) x 2 bytes.
  MatmulRuns r = plan_matmul_runs(calls, /*max_bytes=*/431000);
  EXPECT_EQ(r.runs, std::vector<MatmulCall>{weight_gradient_at_33()});
  EXPECT_EQ(r.ops, (std::vector<std::vector<int64_t>>{{0, 5}}));
  EXPECT_EQ(r.skipped, std::vector<std::string>{"aten::addmm [[576], [561, 192], [192, 576]] (operands of 437760 "
                                                "bytes at the target batch)"});
  // Nor is a call of more FLOP than the limit run (2 x 192 x 561 x 192; the addmm 2 x 576 x 561 x 192); each distinct
  // call is named once, in the order of the ops.
  EXPECT_EQ(matmul_flops(weight_gradient_at_33()), 41361408);
  r = plan_matmul_runs(calls, kMaxMatmulOperandBytes, /*max_flops=*/41361407);
  EXPECT_TRUE(r.runs.empty());
  EXPECT_TRUE(r.ops.empty());
  EXPECT_EQ(r.skipped,
            (std::vector<std::string>{"aten::mm [[192, 561], [561, 192]] (41361408 FLOP at the target batch)",
                                      "aten::addmm [[576], [561, 192], [192, 576]] (124084224 FLOP at the target "
                                      "batch)"}));
  // The defaults: 1 GiB of operands, 4 GFLOP.
  r = plan_matmul_runs(calls);
  EXPECT_EQ(r.runs.size(), 2u);
  EXPECT_TRUE(r.skipped.empty());
}

// ---- A call's transient bytes ----

TEST(TransientBytes, ThePeakAboveWhatTheCallHeldWhenItReturned) {
  Trace t;
  auto block = [&](int64_t bytes, std::string device, bool baseline) {
    Allocation a;
    a.block_bytes = bytes;
    a.device = std::move(device);
    a.baseline = baseline;
    t.allocations.push_back(a);
    return static_cast<int64_t>(t.allocations.size() - 1);
  };
  auto event = [&](int64_t allocation, int64_t bytes, std::string device) {
    MemEvent e;
    e.allocation = allocation;
    e.block_bytes = bytes;
    e.device = std::move(device);
    t.events.push_back(e);
  };
  block(4 << 20, "cpu", true);  // held before the call: not the call's
  const int64_t scratch = block(1 << 20, "cpu", false), result = block(16, "cpu", false);
  const int64_t other = block(64 << 20, "cuda:0", false);
  event(scratch, 1 << 20, "cpu");
  event(other, 64 << 20, "cuda:0");
  event(result, 16, "cpu");
  event(-1, 1 << 30, "cpu");  // an event of no block the trace kept
  event(scratch, -(1 << 20), "cpu");
  EXPECT_EQ(transient_bytes(t, "cpu"), 1 << 20);
  EXPECT_EQ(transient_bytes(t, "cuda:0"), 0);
  EXPECT_EQ(transient_bytes(t, "cuda:1"), 0);
}

}  // namespace
}  // namespace gpucast
