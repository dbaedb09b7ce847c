// Per-layer cost features, the roofline time model fitted per kind, and D-optimal choice of the layers to time.
#include <gtest/gtest.h>

#include <map>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "gpucast/error.h"
#include "gpucast/layer_model.h"
#include "user_error.h"

namespace gpucast {
namespace {

constexpr auto err = test_util::user_error;
using Shape = std::vector<int64_t>;

Value tensor(Shape shape, const char* dtype = "float32") {
  Value v;
  v.kind = Value::Kind::Tensor;
  TensorMeta m;
  m.shape = std::move(shape);
  m.dtype = dtype;
  v.tensors.push_back(m);
  return v;
}

Value tensors(std::vector<Shape> shapes) {
  Value v;
  v.kind = Value::Kind::TensorList;
  for (Shape& s : shapes) v.tensors.push_back(tensor(std::move(s)).tensors[0]);
  return v;
}

Value scalar(double x) {
  Value v;
  v.kind = Value::Kind::Scalar;
  v.scalar = x;
  return v;
}

Value other() {
  Value v;
  v.kind = Value::Kind::Other;
  return v;
}

OpRecord make_op(const char* name, std::vector<Value> inputs, std::vector<Value> outputs) {
  OpRecord o;
  o.name = name;
  o.inputs = std::move(inputs);
  o.outputs = std::move(outputs);
  return o;
}

// Deterministic uniform draws in [0, 1) for synthetic data.
class Draws {
 public:
  explicit Draws(uint64_t seed) : s_(seed) {}
  double next() {
    s_ = s_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(s_ >> 11) * 0x1.0p-53;
  }

 private:
  uint64_t s_;
};

// ---- Cost features ------------------------------------------------------------------------------------------

TEST(LayerModel, OpKinds) {
  EXPECT_EQ(op_cost_kind("aten::addmm"), "matmul");
  EXPECT_EQ(op_cost_kind("addmm"), "matmul");
  EXPECT_EQ(op_cost_kind("aten::linear"), "matmul");
  EXPECT_EQ(op_cost_kind("aten::einsum"), "matmul");
  EXPECT_EQ(op_cost_kind("aten::conv2d"), "conv");
  EXPECT_EQ(op_cost_kind("aten::_convolution"), "conv");
  EXPECT_EQ(op_cost_kind("aten::cudnn_convolution"), "conv");
  EXPECT_EQ(op_cost_kind("aten::mkldnn_convolution"), "conv");
  EXPECT_EQ(op_cost_kind("aten::scaled_dot_product_attention"), "attention");
  EXPECT_EQ(op_cost_kind("aten::_scaled_dot_product_flash_attention"), "attention");
  EXPECT_EQ(op_cost_kind("aten::_scaled_dot_product_efficient_attention"), "attention");
  EXPECT_EQ(op_cost_kind("aten::native_layer_norm"), "norm");
  EXPECT_EQ(op_cost_kind("aten::batch_norm"), "norm");
  EXPECT_EQ(op_cost_kind("aten::_fused_rms_norm"), "norm");
  EXPECT_EQ(op_cost_kind("aten::embedding_bag"), "embedding");
  EXPECT_EQ(op_cost_kind("aten::max_pool2d_with_indices"), "pool");
  EXPECT_EQ(op_cost_kind("aten::adaptive_avg_pool2d"), "pool");
  EXPECT_EQ(op_cost_kind("aten::gelu"), "elementwise");
  EXPECT_EQ(op_cost_kind("aten::_convert_indices_from_coo_to_csr"), "elementwise");
}

TEST(LayerModel, MatmulFlops) {
  // addmm(bias, mat1 [M, K], mat2 [K, N]): 2 M N K.
  EXPECT_EQ(op_flops(make_op("aten::addmm", {tensor({32}), tensor({4, 16}), tensor({16, 32})}, {tensor({4, 32})})),
            2.0 * 4 * 32 * 16);
  // linear(input [..., K], weight [N, K]): M = the product of the leading dims.
  EXPECT_EQ(op_flops(make_op("aten::linear", {tensor({2, 3, 16}), tensor({32, 16}), tensor({32})},
                             {tensor({2, 3, 32})})),
            2.0 * 6 * 32 * 16);
  EXPECT_EQ(op_flops(make_op("aten::mm", {tensor({4, 16}), tensor({16, 32})}, {tensor({4, 32})})), 2.0 * 4 * 32 * 16);
  EXPECT_EQ(op_flops(make_op("aten::bmm", {tensor({5, 4, 16}), tensor({5, 16, 32})}, {tensor({5, 4, 32})})),
            2.0 * 5 * 4 * 32 * 16);
  EXPECT_EQ(op_flops(make_op("aten::baddbmm", {tensor({5, 4, 32}), tensor({5, 4, 16}), tensor({5, 16, 32})},
                             {tensor({5, 4, 32})})),
            2.0 * 5 * 4 * 32 * 16);
  // matmul broadcasts batch dims: [2, 1] with [3] gives 6.
  EXPECT_EQ(op_flops(make_op("aten::matmul", {tensor({2, 1, 4, 16}), tensor({3, 16, 32})}, {tensor({2, 3, 4, 32})})),
            2.0 * 6 * 4 * 32 * 16);
  EXPECT_EQ(op_flops(make_op("aten::matmul", {tensor({16}), tensor({16})}, {tensor({})})), 2.0 * 16);
  // einsum without its equation: exact for a plain matrix product.
  EXPECT_EQ(op_flops(make_op("aten::einsum", {other(), tensors({{3, 4}, {4, 5}})}, {tensor({3, 5})})), 2.0 * 3 * 4 * 5);
}

TEST(LayerModel, RecurrentFlops) {
  EXPECT_EQ(op_cost_kind("aten::lstm"), "matmul");
  EXPECT_EQ(op_cost_kind("aten::gru"), "matmul");
  EXPECT_EQ(op_cost_kind("aten::rnn_tanh"), "matmul");
  // lstm(input [T 5, B 3, I 8], hx [h0, c0], params [w_ih [4H 32, 8], w_hh [32, 8], b_ih, b_hh], ...), H = 8:
  // both weights once per time step and sequence.
  const OpRecord lstm = make_op("aten::lstm", {tensor({5, 3, 8}), tensors({{1, 3, 8}, {1, 3, 8}}),
                                               tensors({{32, 8}, {32, 8}, {32}, {32}}), scalar(1), scalar(1)},
                                {tensor({5, 3, 8}), tensor({1, 3, 8}), tensor({1, 3, 8})});
  EXPECT_EQ(op_flops(lstm), 2.0 * 15 * (32 * 8 + 32 * 8));
  // Two layers, bidirectional GRU (3 gates, H 4, input 6): layer 1 reads 2H = 8 features.
  const OpRecord gru = make_op("aten::gru", {tensor({2, 7, 6}), tensor({4, 2, 4}),
                                             tensors({{12, 6}, {12, 4}, {12, 6}, {12, 4}, {12, 8}, {12, 4}, {12, 8},
                                                      {12, 4}})},
                               {tensor({2, 7, 8}), tensor({4, 2, 4})});
  EXPECT_EQ(op_flops(gru), 2.0 * 14 * (12 * (6 + 4 + 6 + 4 + 8 + 4 + 8 + 4)));
  // No weights recorded: nothing to count.
  EXPECT_EQ(op_flops(make_op("aten::lstm", {tensor({5, 3, 8})}, {tensor({5, 3, 8})})), 0);
}

TEST(LayerModel, ConvAndAttentionFlops) {
  // conv2d with groups 2: input [2, 8, 10, 10], weight [16, 8 / 2, 3, 3], output [2, 16, 8, 8].
  const OpRecord conv = make_op("aten::conv2d", {tensor({2, 8, 10, 10}), tensor({16, 4, 3, 3}), tensor({16}), other(),
                                                 other(), other(), scalar(2)},
                                {tensor({2, 16, 8, 8})});
  EXPECT_EQ(op_flops(conv), 2.0 * 2 * 16 * 64 * 4 * 9);
  // Transposed (convolution's 7th argument): input [1, 4, 5, 5], weight [C_in 4, C_out 2, 3, 3].
  const OpRecord up = make_op("aten::convolution", {tensor({1, 4, 5, 5}), tensor({4, 2, 3, 3}), tensor({2}), other(),
                                                    other(), other(), scalar(1), other(), scalar(1)},
                              {tensor({1, 2, 7, 7})});
  EXPECT_EQ(op_flops(up), 2.0 * 1 * 4 * 25 * 2 * 9);
  // Unbatched conv1d: input [3, 20], weight [6, 3, 5], output [6, 16].
  EXPECT_EQ(op_flops(make_op("aten::conv1d", {tensor({3, 20}), tensor({6, 3, 5})}, {tensor({6, 16})})),
            2.0 * 6 * 16 * 3 * 5);
  // scaled_dot_product_attention: 4 B H L S E.
  EXPECT_EQ(op_flops(make_op("aten::scaled_dot_product_attention",
                             {tensor({2, 4, 8, 16}), tensor({2, 4, 10, 16}), tensor({2, 4, 10, 16})},
                             {tensor({2, 4, 8, 16})})),
            4.0 * 2 * 4 * 8 * 10 * 16);
  EXPECT_EQ(op_flops(make_op("aten::_scaled_dot_product_flash_attention",
                             {tensor({1, 2, 8, 16}), tensor({1, 2, 8, 16}), tensor({1, 2, 8, 32})},
                             {tensor({1, 2, 8, 32})})),
            2.0 * 2 * 8 * 8 * (16 + 32));
}

TEST(LayerModel, OtherFlopsAndOddShapes) {
  EXPECT_EQ(op_flops(make_op("aten::layer_norm", {tensor({4, 8})}, {tensor({4, 8})})), 5.0 * 32);
  EXPECT_EQ(op_flops(make_op("aten::_softmax", {tensor({4, 8})}, {tensor({4, 8})})), 5.0 * 32);
  EXPECT_EQ(op_flops(make_op("aten::relu", {tensor({4, 8})}, {tensor({4, 8})})), 32.0);
  EXPECT_EQ(op_flops(make_op("aten::view", {tensor({4, 8})}, {tensor({32})})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::item", {tensor({})}, {scalar(1)})), 0.0);
  // Missing or inconsistent shapes: 0, no throw.
  EXPECT_EQ(op_flops(make_op("aten::mm", {tensor({4, 16}), tensor({15, 32})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::mm", {tensor({4, 16})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::linear", {tensor({4, 16}), other()}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::addmm", {}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::bmm", {tensor({2, 4, 16}), tensor({3, 16, 8})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::matmul", {tensor({2, 4, 16}), tensor({3, 16, 8})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::matmul", {tensor({4, -1}), tensor({16, 8})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::conv2d", {tensor({2, 8, 10, 10}), tensor({16, 4, 3, 3})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::conv2d", {tensor({2, 8, 10, 10}), tensor({16})}, {tensor({2, 16, 8, 8})})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::scaled_dot_product_attention", {tensor({16}), tensor({16})}, {})), 0.0);
  EXPECT_EQ(op_flops(make_op("aten::scaled_dot_product_attention", {}, {})), 0.0);
}

TEST(LayerModel, Bytes) {
  // addmm: bias 32 floats, mat1 64, mat2 512, output 128: (32 + 64 + 512 + 128) * 4.
  EXPECT_EQ(op_bytes(make_op("aten::addmm", {tensor({32}), tensor({4, 16}), tensor({16, 32})}, {tensor({4, 32})})),
            4.0 * (32 + 64 + 512 + 128));
  Value undefined = tensor({});
  undefined.tensors[0].dtype = "";
  const OpRecord mixed = make_op("aten::foo",
                                 {tensor({10}, "bfloat16"), tensor({3}, "int64"), tensor({5}, "bool"),
                                  tensor({2}, "float64"), tensor({7}, "int32"), tensor({2}, "qint4x2"), undefined,
                                  scalar(3), tensors({{2, 2}, {3}})},
                                 {tensor({4}, "float16"), tensor({2}, "uint8")});
  EXPECT_EQ(op_bytes(mixed), 20.0 + 24 + 5 + 16 + 28 + 8 + 0 + 0 + 4 * 7 + 8 + 2);
  EXPECT_EQ(op_bytes(make_op("aten::transpose", {tensor({4, 8})}, {tensor({8, 4})})), 0.0);
  // An op that hands back its input (dropout with p = 0) moves nothing and computes nothing; an in-place op
  // writes what it returns; an op whose output is new storage moves both.
  auto on = [](Value v, uint64_t storage) {
    v.tensors[0].storage = storage;
    return v;
  };
  const OpRecord same = make_op("aten::dropout", {on(tensor({4, 8}), 7), scalar(0), other()}, {on(tensor({4, 8}), 7)});
  EXPECT_EQ(op_bytes(same), 0.0);
  EXPECT_EQ(op_flops(same), 0.0);
  EXPECT_EQ(op_bytes(make_op("aten::relu_", {on(tensor({4, 8}), 7)}, {on(tensor({4, 8}), 7)})), 4.0 * 64);
  EXPECT_EQ(op_bytes(make_op("aten::dropout", {on(tensor({4, 8}), 7), scalar(0.1), other()}, {on(tensor({4, 8}), 8)})),
            4.0 * 64);
  EXPECT_EQ(op_bytes(make_op("aten::dropout", {tensor({4, 8}), scalar(0), other()}, {tensor({4, 8})})), 4.0 * 64);
}

// Two iterations (batch 2, then 4), each: net.fc (linear over a t + addmm, relu), net.norm (layer_norm),
// net.attn (einsum over a bmm), an add outside modules, net.tie (an mm and a mul of the same FLOPs), backward nodes,
// the optimizer step.
class LayerCostsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int64_t b : {2, 4}) iteration(b);
  }

  int64_t begin(const char* name, const char* module, std::vector<Value> in, std::vector<Value> out,
                int64_t parent = -1, Scope scope = Scope::Function, Phase phase = Phase::Forward, int64_t fwd = -1) {
    OpRecord o = make_op(name, std::move(in), std::move(out));
    o.id = static_cast<int64_t>(t_.ops.size());
    o.module = module;
    o.parent = parent;
    o.depth = parent < 0 ? 0 : t_.ops[parent].depth + 1;
    o.scope = scope;
    o.phase = phase;
    o.fwd_op = fwd;
    o.start_ns = now_++;
    o.start_seq = seq_++;
    t_.ops.push_back(o);
    return o.id;
  }
  void end(int64_t id) {
    t_.ops[id].end_seq = seq_++;
    t_.ops[id].end_ns = now_++;
  }
  int64_t leaf(const char* name, const char* module, std::vector<Value> in, std::vector<Value> out,
               int64_t parent = -1) {
    const int64_t id = begin(name, module, std::move(in), std::move(out), parent);
    end(id);
    return id;
  }

  void iteration(int64_t b) {
    const int64_t fc = begin("aten::linear", "net.fc", {tensor({b, 16}), tensor({32, 16}), tensor({32})},
                             {tensor({b, 32})});
    leaf("aten::t", "net.fc", {tensor({32, 16})}, {tensor({16, 32})}, fc);
    leaf("aten::addmm", "net.fc", {tensor({32}), tensor({b, 16}), tensor({16, 32})}, {tensor({b, 32})}, fc);
    end(fc);
    leaf("aten::relu", "net.fc", {tensor({b, 32})}, {tensor({b, 32})});
    const int64_t norm = begin("aten::layer_norm", "net.norm", {tensor({b, 32}), other(), tensor({32}), tensor({32})},
                               {tensor({b, 32})});
    leaf("aten::native_layer_norm", "net.norm", {tensor({b, 32})}, {tensor({b, 32}), tensor({b, 1}), tensor({b, 1})},
         norm);
    end(norm);
    const int64_t attn = begin("aten::einsum", "net.attn", {other(), tensors({{b, 8, 16}, {b, 16, 8}})},
                               {tensor({b, 8, 8})});
    leaf("aten::bmm", "net.attn", {tensor({b, 8, 16}), tensor({b, 16, 8})}, {tensor({b, 8, 8})}, attn);
    end(attn);
    leaf("aten::add", "", {tensor({b, 32}), tensor({b, 32})}, {tensor({b, 32})});
    leaf("aten::mm", "net.tie", {tensor({1, 4}), tensor({4, 1})}, {tensor({1, 1})});
    leaf("aten::mul", "net.tie", {tensor({8}), tensor({8})}, {tensor({8})});
    const int64_t node = begin("AddmmBackward0", "", {}, {}, -1, Scope::BackwardFunction, Phase::Backward, fc);
    leaf("aten::mm", "", {tensor({b, 32}), tensor({32, 16})}, {tensor({b, 16})}, node);
    end(node);
    end(begin("Optimizer.step#SGD.step", "", {}, {}, -1, Scope::UserScope, Phase::Optimizer));
  }

  Trace t_;
  uint64_t seq_ = 1;
  int64_t now_ = 0;
};

TEST_F(LayerCostsTest, TheLastIterationOnly) {
  const std::vector<LayerCost> c = layer_costs(t_);
  ASSERT_EQ(c.size(), 5u);
  EXPECT_EQ(c[0].layer, "net.fc");
  EXPECT_EQ(c[0].kind, "matmul");
  EXPECT_EQ(c[0].ops, 2);  // linear and relu: the t and addmm inside linear are not top-level
  EXPECT_EQ(c[0].flops, 2.0 * 4 * 32 * 16 + 4 * 32);
  EXPECT_EQ(c[0].bytes, 4.0 * (4 * 16 + 32 * 16 + 32 + 4 * 32) + 4.0 * (2 * 4 * 32));
  EXPECT_EQ(c[1].layer, "net.norm");
  EXPECT_EQ(c[1].kind, "norm");
  EXPECT_EQ(c[1].ops, 1);
  EXPECT_EQ(c[1].flops, 5.0 * 4 * 32);
  EXPECT_EQ(c[1].bytes, 4.0 * (4 * 32 + 32 + 32 + 4 * 32));
  // einsum: costed by the bmm inside it.
  EXPECT_EQ(c[2].layer, "net.attn");
  EXPECT_EQ(c[2].kind, "matmul");
  EXPECT_EQ(c[2].flops, 2.0 * 4 * 8 * 8 * 16);
  EXPECT_EQ(c[2].bytes, 4.0 * (4 * 8 * 16 * 2 + 4 * 8 * 8));
  EXPECT_EQ(c[3].layer, "(outside modules)");
  EXPECT_EQ(c[3].kind, "elementwise");
  EXPECT_EQ(c[3].flops, 4.0 * 32);
  EXPECT_EQ(c[3].bytes, 4.0 * 3 * 4 * 32);
  // An mm and a mul of 8 FLOPs each: a tie between kinds is elementwise.
  EXPECT_EQ(c[4].layer, "net.tie");
  EXPECT_EQ(c[4].kind, "elementwise");
  EXPECT_EQ(c[4].ops, 2);
  EXPECT_EQ(c[4].flops, 16.0);
  // The same work by kind and precision (float32 here), in the order kinds first appear: what a GPU table prices.
  const std::vector<CostPart> fc_parts = {
      CostPart{"matmul", false, 2.0 * 4 * 32 * 16, 4.0 * (4 * 16 + 32 * 16 + 32 + 4 * 32), 1},
      CostPart{"elementwise", false, 4.0 * 32, 4.0 * (2 * 4 * 32), 1}};
  EXPECT_EQ(c[0].parts, fc_parts);
  EXPECT_EQ(c[4].parts, (std::vector<CostPart>{CostPart{"matmul", false, 8, 4.0 * (4 + 4 + 1), 1},
                                                CostPart{"elementwise", false, 8, 4.0 * 24, 1}}));
}

TEST(LayerCosts, SixteenBitOpsArePartsOfTheirOwn) {
  Trace t;
  auto add = [&](const char* name, const char* dtype, uint64_t seq) {
    OpRecord o = make_op(name, {tensor({4, 8}), tensor({8, 2})}, {tensor({4, 2})});
    for (Value* v : {&o.inputs[0], &o.inputs[1], &o.outputs[0]}) v->tensors[0].dtype = dtype;
    o.id = static_cast<int64_t>(t.ops.size());
    o.module = "net.fc";
    o.start_seq = seq;
    o.end_seq = seq + 1;
    t.ops.push_back(o);
  };
  add("aten::mm", "float32", 1);
  add("aten::mm", "bfloat16", 3);
  add("aten::mm", "float16", 5);
  const std::vector<LayerCost> c = layer_costs(t);
  ASSERT_EQ(c.size(), 1u);
  ASSERT_EQ(c[0].parts.size(), 2u);
  EXPECT_FALSE(c[0].parts[0].half);
  EXPECT_EQ(c[0].parts[0].flops, 2.0 * 4 * 8 * 2);
  EXPECT_EQ(c[0].parts[0].bytes, 4.0 * (32 + 16 + 8));
  EXPECT_TRUE(c[0].parts[1].half);
  EXPECT_EQ(c[0].parts[1].flops, 2 * 2.0 * 4 * 8 * 2);
  EXPECT_EQ(c[0].parts[1].bytes, 2 * 2.0 * (32 + 16 + 8));
  EXPECT_EQ(c[0].parts[1].kernels, 2);
}

TEST(LayerCosts, ForwardOpsRunAgainInBackwardAreTheLayersRecomputation) {
  // net.fc's aten::mm in forward; in backward, its node runs it again (activation checkpointing: the op records an
  // autograd sequence number, so it builds a graph) before its own aten::mm (no sequence number).
  Trace t;
  auto add = [&](const char* name, Scope scope, Phase phase, int64_t parent, int64_t seq_nr, uint64_t at) {
    OpRecord o = scope == Scope::Function ? make_op(name, {tensor({4, 8}), tensor({8, 2})}, {tensor({4, 2})})
                                          : make_op(name, {}, {});
    o.id = static_cast<int64_t>(t.ops.size());
    o.scope = scope;
    o.phase = phase;
    o.parent = parent;
    o.seq_nr = seq_nr;
    o.module = "net.fc";
    o.start_seq = at;
    o.end_seq = at + 1;
    t.ops.push_back(o);
    return o.id;
  };
  add("aten::mm", Scope::Function, Phase::Forward, -1, 7, 1);
  const int64_t node = add("MmBackward0", Scope::BackwardFunction, Phase::Backward, -1, 7, 3);
  t.ops[node].fwd_op = 0;
  t.ops[node].end_seq = 10;
  add("aten::mm", Scope::Function, Phase::Backward, node, 9, 4);   // recomputed
  add("aten::mm", Scope::Function, Phase::Backward, node, -1, 6);  // the node's own
  const std::vector<LayerCost> c = layer_costs(t);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].ops, 1);
  EXPECT_EQ(c[0].flops, 2.0 * 4 * 8 * 2);
  EXPECT_EQ(c[0].recompute,
            (std::vector<CostPart>{CostPart{"matmul", false, 2.0 * 4 * 8 * 2, 4.0 * (32 + 16 + 8), 1}}));
  t.ops[2].seq_nr = -1;  // without checkpointing: nothing run again
  EXPECT_TRUE(layer_costs(t)[0].recompute.empty());
}

TEST_F(LayerCostsTest, OneIterationAndNoOptimizerStep) {
  Trace one;
  for (const OpRecord& op : t_.ops) {
    if (op.name.rfind("Optimizer", 0) == 0) break;
    one.ops.push_back(op);
  }
  const std::vector<LayerCost> c = layer_costs(one);
  ASSERT_EQ(c.size(), 5u);
  EXPECT_EQ(c[0].flops, 2.0 * 2 * 32 * 16 + 2 * 32);  // the whole trace: batch 2
  EXPECT_TRUE(layer_costs(Trace{}).empty());
}

// ---- Time model ---------------------------------------------------------------------------------------------

TEST(LayerModel, RooflinePrior) {
  const DeviceRates r{1e12, 1e11, 5e-6};
  LayerCost c;
  c.ops = 3, c.flops = 2e9, c.bytes = 1e8;  // compute-bound: 2 ms of FLOPs, 1 ms of bytes
  EXPECT_DOUBLE_EQ(roofline_ns(c, r, Phase::Forward), 15e3 + 2e6);
  EXPECT_DOUBLE_EQ(roofline_ns(c, r, Phase::Backward), 15e3 + 4e6);
  c.bytes = 5e8;  // memory-bound
  EXPECT_DOUBLE_EQ(roofline_ns(c, r, Phase::Forward), 15e3 + 5e6);
  EXPECT_DOUBLE_EQ(roofline_ns(c, r, Phase::Backward), 15e3 + 10e6);
  EXPECT_EQ(roofline_ns(LayerCost{}, r, Phase::Forward), 0.0);
}

const DeviceRates kPrior{1e15, 4e12, 4e-6};
const DeviceRates kTrueForward{4e14, 2e12, 7e-6};
const DeviceRates kTrueBackward{3e14, 1.6e12, 1.1e-5};

// Layers of one kind spread over both sides of the ridge and over op counts.
std::vector<LayerCost> synthetic_layers(size_t n, const char* kind, uint64_t seed) {
  Draws d(seed);
  std::vector<LayerCost> costs;
  for (size_t i = 0; i < n; ++i) {
    LayerCost c;
    c.layer = fmt::format("{}.{}", kind, i);
    c.kind = kind;
    c.flops = std::pow(10.0, 6 + 6 * d.next());
    c.bytes = c.flops / std::pow(10.0, 0.5 + 3 * d.next());  // 3 to 3000 FLOPs per byte; the ridge is at 200
    c.ops = 1 + static_cast<int64_t>(12 * d.next());
    costs.push_back(c);
  }
  return costs;
}

std::vector<LayerSample> measure(const std::vector<LayerCost>& costs, const std::vector<size_t>& which) {
  std::vector<LayerSample> s;
  for (size_t i : which) {
    s.push_back({i, roofline_ns(costs[i], kTrueForward, Phase::Forward),
                 roofline_ns(costs[i], kTrueBackward, Phase::Backward)});
  }
  return s;
}

std::vector<size_t> first(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

void expect_rates_near(const DeviceRates& got, const DeviceRates& want, double rel) {
  EXPECT_NEAR(got.flops_per_s / want.flops_per_s, 1, rel);
  EXPECT_NEAR(got.bytes_per_s / want.bytes_per_s, 1, rel);
  EXPECT_NEAR(got.op_overhead_s / want.op_overhead_s, 1, rel);
}

TEST(LayerModel, FitRecoversKnownRates) {
  const std::vector<LayerCost> costs = synthetic_layers(60, "matmul", 1);
  LayerTimeModel m;
  m.fit(costs, measure(costs, first(40)), kPrior);
  const KindFit& k = m.fit_for("matmul");
  EXPECT_EQ(k.forward.source, "kind");
  EXPECT_EQ(k.forward.samples, 40u);
  expect_rates_near(k.forward.rates, kTrueForward, 0.02);
  expect_rates_near(k.backward.rates, kTrueBackward, 0.02);
  EXPECT_LT(k.forward.rms_rel_error, 0.01);
  for (size_t i = 40; i < costs.size(); ++i) {  // layers it did not see
    const LayerPrediction p = m.predict(costs[i]);
    EXPECT_EQ(p.source, "kind");
    EXPECT_NEAR(p.forward_ns / roofline_ns(costs[i], kTrueForward, Phase::Forward), 1, 0.02) << i;
    EXPECT_NEAR(p.backward_ns / roofline_ns(costs[i], kTrueBackward, Phase::Backward), 1, 0.02) << i;
  }
}

TEST(LayerModel, FitIsDeterministicAndFast) {
  std::vector<LayerCost> costs;
  for (const std::string_view kind : kLayerCostKinds) {
    const auto some = synthetic_layers(72, std::string(kind).c_str(), costs.size() + 7);
    costs.insert(costs.end(), some.begin(), some.end());
  }
  costs.resize(500);
  const std::vector<LayerSample> samples = measure(costs, first(500));
  LayerTimeModel a, b;
  const auto start = std::chrono::steady_clock::now();
  a.fit(costs, samples, kPrior);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("fit of 500 layers: %.1f ms\n", ms);
  // The target is 50 ms: measured 3 ms at -O2, 10 ms at -O1, 38 ms at -O0; the bound leaves room for sanitizers
  // and busy machines.
  EXPECT_LT(ms, 500);
  b.fit(costs, samples, kPrior);
  for (const std::string_view kind : kLayerCostKinds) {
    EXPECT_EQ(a.fit_for(kind).forward.rates.flops_per_s, b.fit_for(kind).forward.rates.flops_per_s);
    EXPECT_EQ(a.fit_for(kind).backward.rates.op_overhead_s, b.fit_for(kind).backward.rates.op_overhead_s);
    expect_rates_near(a.fit_for(kind).forward.rates, kTrueForward, 0.02);
  }
}

TEST(LayerModel, KindsWithoutMeasurementsFallBack) {
  std::vector<LayerCost> costs = synthetic_layers(3, "matmul", 2);
  for (const char* kind : {"conv", "conv", "norm"}) costs.push_back(synthetic_layers(1, kind, costs.size())[0]);
  // Two kinds measured (matmul: 3, norm: 1), conv not: conv uses the fit pooled over the heavy kinds (the three
  // matmuls); a kind gpucast does not know, the fit pooled over all four.
  LayerTimeModel m;
  m.fit(costs, measure(costs, {0, 1, 2, 5}), kPrior);
  EXPECT_EQ(m.predict(costs[0]).source, "kind");
  EXPECT_EQ(m.predict(costs[3]).source, "pooled");
  EXPECT_EQ(m.fit_for("conv").forward.samples, 3u);
  EXPECT_EQ(m.fit_for("nonsense").forward.source, "pooled");
  EXPECT_EQ(m.fit_for("nonsense").forward.samples, 4u);
  EXPECT_EQ(m.fit_for("pool").forward.samples, 4u);  // a light kind: pooled over all

  // Only light layers measured (norms): a heavy kind takes the prior, never rates fitted on memory-bound layers.
  std::vector<LayerCost> light = costs;
  light.push_back(synthetic_layers(1, "norm", light.size())[0]);
  LayerTimeModel l;
  l.fit(light, measure(light, {5, 6}), kPrior);
  EXPECT_EQ(l.fit_for("norm").forward.source, "kind");
  EXPECT_EQ(l.fit_for("pool").forward.source, "pooled");
  EXPECT_EQ(l.predict(light[3]).source, "prior");
  EXPECT_EQ(l.predict(light[3]).forward_ns, roofline_ns(light[3], kPrior, Phase::Forward));
  // One norm measurement: the prior scaled to it, which then reproduces it.
  const LayerPrediction norm = m.predict(costs[5]);
  EXPECT_EQ(norm.source, "kind");
  EXPECT_EQ(m.fit_for("norm").forward.samples, 1u);
  EXPECT_NEAR(norm.forward_ns / roofline_ns(costs[5], kTrueForward, Phase::Forward), 1, 1e-12);
  EXPECT_NEAR(norm.backward_ns / roofline_ns(costs[5], kTrueBackward, Phase::Backward), 1, 1e-12);

  // One measurement in all: every other kind takes the prior scaled by its measured / prior ratio.
  LayerTimeModel one;
  one.fit(costs, measure(costs, {0}), kPrior);
  const double ratio =
      roofline_ns(costs[0], kTrueForward, Phase::Forward) / roofline_ns(costs[0], kPrior, Phase::Forward);
  const LayerPrediction conv = one.predict(costs[3]);
  EXPECT_EQ(conv.source, "scaled_prior");
  EXPECT_NEAR(conv.forward_ns / (ratio * roofline_ns(costs[3], kPrior, Phase::Forward)), 1, 1e-12);
  EXPECT_EQ(one.predict(costs[1]).source, "kind");

  // None: the prior.
  LayerTimeModel none;
  none.fit(costs, {}, kPrior);
  const LayerPrediction p = none.predict(costs[4]);
  EXPECT_EQ(p.source, "prior");
  EXPECT_EQ(p.forward_ns, roofline_ns(costs[4], kPrior, Phase::Forward));
  EXPECT_EQ(p.backward_ns, roofline_ns(costs[4], kPrior, Phase::Backward));
}

TEST(LayerModel, NoExtrapolationFarBeyondTheFittedWork) {
  // Two small matmuls (1e6 and 2e6 FLOPs) fit the kind; a layer 1e6 times larger is priced at the prior's
  // rates, keeping the fitted per-op overhead; one within 4x of the largest keeps the fit.
  std::vector<LayerCost> costs = {{"a", "matmul", 1e6, 1e4, 1}, {"b", "matmul", 2e6, 2e4, 2}};
  LayerTimeModel m;
  m.fit(costs, measure(costs, {0, 1}), kPrior);
  const KindFit& k = m.fit_for("matmul");
  const LayerCost big{"big", "matmul", 1e12, 1e9, 3};
  const LayerPrediction p = m.predict(big);
  EXPECT_EQ(p.source, "prior");
  EXPECT_NEAR(p.forward_ns, 3 * k.forward.rates.op_overhead_s * 1e9 + std::max(1e12 / 1e15, 1e9 / 4e12) * 1e9, 1e-6);
  EXPECT_NEAR(p.backward_ns, 3 * k.backward.rates.op_overhead_s * 1e9 + 2 * std::max(1e12 / 1e15, 1e9 / 4e12) * 1e9,
              1e-6);
  const LayerCost near{"near", "matmul", 7e6, 7e4, 1};
  EXPECT_EQ(m.predict(near).source, "kind");
  EXPECT_NEAR(m.predict(near).forward_ns, roofline_ns(near, k.forward.rates, Phase::Forward), 1e-9);
  // The same small layer priced against its reach (its work at a larger batch, beyond 4x): the prior's rates, as
  // at that larger batch; a reach within 4x keeps the fit.
  const LayerCost far{"near", "matmul", 7e8, 7e6, 1};
  EXPECT_EQ(m.predict(near, &far).source, "prior");
  EXPECT_NEAR(m.predict(near, &far).forward_ns,
              k.forward.rates.op_overhead_s * 1e9 + std::max(7e6 / 1e15, 7e4 / 4e12) * 1e9, 1e-6);
  EXPECT_EQ(m.predict(near, &near).source, "kind");
}

TEST(LayerModel, PassWithoutTimesFallsBackAlone) {
  std::vector<LayerCost> costs = synthetic_layers(4, "matmul", 3);
  for (size_t i = 2; i < 4; ++i) costs[i].kind = "conv";
  std::vector<LayerSample> samples = measure(costs, {0, 1, 2, 3});
  samples[0].backward_ns = samples[1].backward_ns = 0;  // matmul's backward not measured
  LayerTimeModel m;
  m.fit(costs, samples, kPrior);
  EXPECT_EQ(m.fit_for("matmul").forward.source, "kind");
  EXPECT_EQ(m.fit_for("matmul").backward.source, "pooled");
  EXPECT_EQ(m.fit_for("matmul").backward.samples, 2u);
  EXPECT_EQ(m.predict(costs[0]).source, "pooled");  // the less specific pass
  EXPECT_EQ(m.predict(costs[2]).source, "kind");
}

TEST(LayerModel, Describe) {
  const std::vector<LayerCost> costs = synthetic_layers(3, "matmul", 4);
  LayerTimeModel m;
  m.fit(costs, measure(costs, {0, 1, 2}), DeviceRates{1e15, 4e12, 5e-6});
  const std::string d = m.describe();
  EXPECT_EQ(d.rfind("layer time model: prior 1000 Tflop/s, 4 TB/s, 5 us/op\n", 0), 0u) << d;
  EXPECT_NE(d.find("  matmul      forward kind (3 layers): "), std::string::npos) << d;
  EXPECT_NE(d.find("  conv        forward pooled (3 layers): "), std::string::npos) << d;
  EXPECT_EQ(LayerTimeModel().describe(), "layer time model: not fitted");
}

TEST(LayerModel, FitErrors) {
  const std::vector<LayerCost> costs = synthetic_layers(2, "matmul", 5);
  LayerTimeModel m;
  EXPECT_EQ(err([&] { m.predict(costs[0]); }), "layer time model: fit() should be called before the model is used");
  EXPECT_EQ(err([&] { m.fit(costs, {}, DeviceRates{0, 1, 0}); }),
            "layer time model: the prior's flops_per_s should be a positive number, got 0");
  EXPECT_EQ(err([&] { m.fit(costs, {}, DeviceRates{1, -2, 0}); }),
            "layer time model: the prior's bytes_per_s should be a positive number, got -2");
  EXPECT_EQ(err([&] { m.fit(costs, {}, DeviceRates{1, 1, -1e-6}); }),
            "layer time model: the prior's op_overhead_s should be a number of at least 0, got -1e-06");
  EXPECT_EQ(err([&] { m.fit(costs, {{0, 1, 1}, {5, 1, 1}}, kPrior); }),
            "layer time model: sample 1 has index 5, but there are 2 layers");
}

// ---- Which layers to time -----------------------------------------------------------------------------------

TEST(LayerModel, DesignRow) {
  LayerCost c;
  c.kind = "norm", c.flops = 1e6, c.bytes = 4e3, c.ops = 3;
  EXPECT_EQ(design_row(c),
            (std::vector<double>{0, 0, 0, 1, 0, 0, 0, std::log1p(1e6), std::log1p(4e3), std::log1p(3)}));
  c.kind = "unknown";
  EXPECT_EQ(design_row(c)[6], 1.0);
}

TEST(LayerModel, DOptimalPicksTheExtremesOfALine) {
  std::vector<std::vector<double>> rows;
  for (int x = 0; x <= 10; ++x) rows.push_back({1.0, static_cast<double>(x)});
  EXPECT_EQ(d_optimal_design(rows, 2), (std::vector<size_t>{0, 10}));
  EXPECT_EQ(d_optimal_design(rows, 2, 7), (std::vector<size_t>{0, 10}));  // from a random start
  EXPECT_TRUE(d_optimal_design(rows, 0).empty());
  EXPECT_EQ(d_optimal_design(rows, 11).size(), 11u);
  EXPECT_EQ(d_optimal_design(rows, 50).size(), 11u);
  // det [[2, 10], [10, 100]] = 100 (and the ridge).
  EXPECT_NEAR(design_log_det(rows, {0, 10}), std::log(100.0), 1e-6);
}

TEST(LayerModel, DOptimalBeatsRandomDesigns) {
  Draws d(11);
  std::vector<std::vector<double>> rows(200, std::vector<double>(6));
  for (auto& r : rows) {
    for (double& x : r) x = 2 * d.next() - 1;
  }
  const double best = design_log_det(rows, d_optimal_design(rows, 20));
  const double best_seeded = design_log_det(rows, d_optimal_design(rows, 20, 3));
  double random_best = -1e300;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    const std::vector<size_t> r = random_design(rows.size(), 20, seed);
    ASSERT_EQ(r.size(), 20u);
    random_best = std::max(random_best, design_log_det(rows, r));
  }
  EXPECT_GE(best, random_best);
  EXPECT_GE(best_seeded, random_best);
  EXPECT_NEAR(best, best_seeded, 0.05 * std::abs(best));  // local optima of the exchange, close together
  // Fewer rows than dimensions: the ridge keeps it defined.
  EXPECT_EQ(d_optimal_design(rows, 3).size(), 3u);
}

TEST(LayerModel, RandomDesign) {
  const std::vector<size_t> a = random_design(50, 10, 42);
  EXPECT_EQ(a, random_design(50, 10, 42));
  ASSERT_EQ(a.size(), 10u);
  for (size_t i = 1; i < a.size(); ++i) EXPECT_LT(a[i - 1], a[i]);
  EXPECT_LT(a.back(), 50u);
  EXPECT_EQ(random_design(3, 5, 1), (std::vector<size_t>{0, 1, 2}));
}

TEST(LayerModel, ChooseLayersToTime) {
  std::vector<LayerCost> costs = synthetic_layers(30, "matmul", 6);
  costs[4].kind = costs[9].kind = costs[17].kind = "norm";
  costs[21].kind = "embedding";
  size_t top_matmul = 0, top_norm = 4;
  for (size_t i = 0; i < costs.size(); ++i) {
    if (costs[i].kind == "matmul" && costs[i].flops > costs[top_matmul].flops) top_matmul = i;
    if (costs[i].kind == "norm" && costs[i].flops > costs[top_norm].flops) top_norm = i;
  }
  std::vector<size_t> want = {top_matmul, top_norm, 21};
  std::sort(want.begin(), want.end());
  // 0.1 of 30 is 3 (not 4, for rounding): the costliest layer of each kind.
  EXPECT_EQ(choose_layers_to_time(costs, 0.1), want);
  const std::vector<size_t> six = choose_layers_to_time(costs, 0.2);
  ASSERT_EQ(six.size(), 6u);
  for (size_t i : want) EXPECT_TRUE(std::binary_search(six.begin(), six.end(), i)) << i;
  EXPECT_EQ(choose_layers_to_time(costs, 1.0).size(), 30u);
  EXPECT_TRUE(choose_layers_to_time({}, 0.5).empty());
  // Fewer layers than kinds: the kinds with the most layers, each by its costliest layer.
  EXPECT_EQ(choose_layers_to_time(costs, 0.01), (std::vector<size_t>{top_matmul}));
  EXPECT_EQ(choose_layers_to_time(costs, 2.0 / 30), (std::vector<size_t>{std::min(top_matmul, top_norm),
                                                                          std::max(top_matmul, top_norm)}));
  // The rest in proportion to each kind's layers: 26 matmuls, 3 norms, 1 embedding; 10 layers are 1 each, then
  // largest remainders of 26/30 * 10 - 1 = 7.67 (matmul) and 3/30 * 10 - 1 = 0: 8 matmuls, 1 norm, 1 embedding.
  const std::vector<size_t> ten = choose_layers_to_time(costs, 10.0 / 30);
  ASSERT_EQ(ten.size(), 10u);
  std::map<std::string, int> per_kind;
  for (size_t i : ten) ++per_kind[costs[i].kind];
  EXPECT_EQ(per_kind, (std::map<std::string, int>{{"embedding", 1}, {"matmul", 8}, {"norm", 1}}));
}

TEST(LayerModel, DesignErrors) {
  EXPECT_EQ(err([] { choose_layers_to_time({}, 0); }), "time_fraction should be in (0, 1], got 0");
  EXPECT_EQ(err([] { choose_layers_to_time({}, 1.5); }), "time_fraction should be in (0, 1], got 1.5");
  EXPECT_EQ(err([] { choose_layers_to_time({}, -0.25); }), "time_fraction should be in (0, 1], got -0.25");
  EXPECT_EQ(err([] { choose_layers_to_time({}, std::nan("")); }), "time_fraction should be in (0, 1], got nan");
  EXPECT_EQ(err([] { d_optimal_design({{1, 2}, {3, 4}, {5}}, 1); }),
            "d_optimal_design: row 2 has 1 values, but row 0 has 2: every row needs the same length");
  EXPECT_EQ(err([] { d_optimal_design({{1, 2}, {INFINITY, 4}}, 1); }),
            "d_optimal_design: row 1 value 0 should be a finite number, got inf");
  EXPECT_EQ(err([] { design_log_det({{1, 2}}, {1}); }),
            "design_log_det: row index 1 is out of range: there are 1 rows");
}

}  // namespace
}  // namespace gpucast
