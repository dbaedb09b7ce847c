// The profiler's plain-C++ side: assembly of per-thread records, backward links, categories, JSON.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <tuple>

#include "gpucast/allocation_refusal.h"
#include "gpucast/cuda_block.h"
#include "gpucast/device_timer.h"
#include "gpucast/error.h"
#include "gpucast/timed_layers.h"
#include "gpucast/trace_assembly.h"
#include "gpucast/trace_json.h"

namespace gpucast {
namespace {

OpRecord op(const std::string& name, Scope scope, Phase phase, uint64_t start, uint64_t end, int64_t parent = -1,
            int64_t seq_nr = -1, int depth = 0) {
  OpRecord o;
  o.name = name;
  o.scope = scope;
  o.phase = phase;
  o.start_seq = start;
  o.end_seq = end;
  o.start_ns = static_cast<int64_t>(start) * 10;
  o.end_ns = static_cast<int64_t>(end) * 10;
  o.parent = parent;
  o.seq_nr = seq_nr;
  o.depth = depth;
  return o;
}

MemEvent ev(uint64_t seq, uint64_t ptr, int64_t bytes, int64_t op, Phase phase, uint64_t thread = 1) {
  MemEvent e;
  e.seq = seq;
  e.ptr = ptr;
  e.bytes = bytes;
  e.block_bytes = bytes;
  e.device = "cpu";
  e.op = op;
  e.phase = phase;
  e.thread = thread;
  return e;
}

// Forward thread 1: linear(seq 7) > addmm(seq 7); relu (seq 8). Backward thread 2: AddmmBackward0 (seq 7)
// with an aten::mm inside, AccumulateGrad (no sequence number).
class AssemblyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RawThread fwd;
    fwd.thread = 1;
    fwd.ops.push_back(op("aten::linear", Scope::Function, Phase::Forward, 1, 7, -1, 7, 0));
    fwd.ops.push_back(op("aten::addmm", Scope::Function, Phase::Forward, 2, 6, 0, 7, 1));
    fwd.ops.push_back(op("aten::relu", Scope::Function, Phase::Forward, 8, 10, -1, 8, 0));
    fwd.ops[0].module = "Net.fc";
    fwd.ops[1].module = "Net.fc";
    fwd.ops[2].module = "Net.act";
    fwd.events.push_back(ev(3, 0x1000, 400, 1, Phase::Forward));   // addmm output, released in backward
    fwd.events.push_back(ev(4, 0x2000, 64, 1, Phase::Forward));    // addmm scratch...
    fwd.events.push_back(ev(5, 0x2000, -64, 1, Phase::Forward));   // ...released inside addmm
    fwd.events.push_back(ev(9, 0x3000, 400, 2, Phase::Forward));   // relu output, held at the end
    fwd.tags.push_back(Tag{0x9000, "cpu", Category::Parameter, 1});

    RawThread bwd;
    bwd.thread = 2;
    OpRecord node = op("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, 11, 15, -1, 7, 0);
    node.fwd_thread = 1;
    bwd.ops.push_back(node);
    bwd.ops.push_back(op("aten::mm", Scope::Function, Phase::Backward, 12, 14, 0, -1, 1));
    bwd.ops.back().bwd_node = 0;
    bwd.ops.push_back(op("torch::autograd::AccumulateGrad", Scope::BackwardFunction, Phase::Backward, 16, 17));
    bwd.events.push_back(ev(13, 0x1000, -400, 1, Phase::Backward, 2));  // activation released

    in.threads.push_back(std::move(fwd));
    in.threads.push_back(std::move(bwd));
    in.baseline_blocks.push_back(BaselineBlock{0x9000, 256, 256, "cpu"});
    in.baseline["cpu"] = DeviceBaseline{256, true};
    in.context = TraceContext{"0.1.0", "2.14.1", "cpu", "Release", false};
  }
  AssemblyInput in;
};

TEST_F(AssemblyTest, OrdersOpsGloballyAndRemapsReferences) {
  Trace t = assemble_trace(std::move(in));
  ASSERT_EQ(t.ops.size(), 6u);
  EXPECT_EQ(t.ops[0].name, "aten::linear");
  EXPECT_EQ(t.ops[1].name, "aten::addmm");
  EXPECT_EQ(t.ops[1].parent, 0);
  EXPECT_EQ(t.ops[3].name, "AddmmBackward0");
  EXPECT_EQ(t.ops[4].name, "aten::mm");
  EXPECT_EQ(t.ops[4].parent, 3);
  EXPECT_EQ(t.ops[4].bwd_node, 3);
  for (size_t i = 0; i < t.ops.size(); ++i) EXPECT_EQ(t.ops[i].id, static_cast<int64_t>(i));
  EXPECT_EQ(t.counters.threads, 2);
}

TEST_F(AssemblyTest, LinksBackwardNodesToInnermostForwardOp) {
  Trace t = assemble_trace(std::move(in));
  EXPECT_EQ(t.ops[3].fwd_op, 1);  // addmm, not linear: innermost with (thread 1, seq 7)
  EXPECT_EQ(t.ops[3].module, "Net.fc");
  EXPECT_EQ(t.ops[4].fwd_op, 1);  // inherited inside the node
  EXPECT_EQ(t.ops[4].module, "Net.fc");
  EXPECT_EQ(t.ops[5].fwd_op, -1);  // AccumulateGrad
  EXPECT_EQ(t.counters.linked_backward, 1);
  EXPECT_EQ(t.counters.unlinked_backward, 1);
}

// A frozen layer's ops create no node: they record the number the next node takes. Forward thread 1:
// batch_norm > native_batch_norm (a frozen norm, seq 4, deeper), then conv2d > convolution (seq 4, the node
// ConvolutionBackward0 is created inside), then relu (seq 5). The node links to the convolution, not to the deeper
// norm before it.
TEST(BackwardLinks, OpsThatCreateNoNodeShareTheNextNodesNumberAndLoseTheLink) {
  AssemblyInput in;
  RawThread fwd;
  fwd.thread = 1;
  fwd.ops.push_back(op("aten::batch_norm", Scope::Function, Phase::Forward, 1, 8, -1, 4, 0));
  fwd.ops.push_back(op("aten::_batch_norm_impl_index", Scope::Function, Phase::Forward, 2, 7, 0, 4, 1));
  fwd.ops.push_back(op("aten::native_batch_norm", Scope::Function, Phase::Forward, 3, 6, 1, 4, 2));
  fwd.ops.push_back(op("aten::conv2d", Scope::Function, Phase::Forward, 9, 14, -1, 4, 0));
  fwd.ops.push_back(op("aten::convolution", Scope::Function, Phase::Forward, 10, 13, 3, 4, 1));
  fwd.ops.push_back(op("aten::relu", Scope::Function, Phase::Forward, 15, 16, -1, 5, 0));
  for (int i = 0; i < 3; ++i) fwd.ops[i].module = "Net.frozen_bn";
  for (int i = 3; i < 5; ++i) fwd.ops[i].module = "Net.head_conv";
  fwd.ops[5].module = "Net.act";
  RawThread bwd;
  bwd.thread = 2;
  OpRecord relu_node = op("ReluBackward0", Scope::BackwardFunction, Phase::Backward, 20, 21, -1, 5, 0);
  relu_node.fwd_thread = 1;
  OpRecord conv_node = op("ConvolutionBackward0", Scope::BackwardFunction, Phase::Backward, 22, 25, -1, 4, 0);
  conv_node.fwd_thread = 1;
  bwd.ops.push_back(relu_node);
  bwd.ops.push_back(conv_node);
  in.threads.push_back(std::move(fwd));
  in.threads.push_back(std::move(bwd));
  Trace t = assemble_trace(std::move(in));
  ASSERT_EQ(t.ops[7].name, "ConvolutionBackward0");
  EXPECT_EQ(t.ops[7].fwd_op, 4);  // aten::convolution: innermost of the latest outermost op with seq 4
  EXPECT_EQ(t.ops[7].module, "Net.head_conv");
  EXPECT_EQ(t.ops[6].fwd_op, 5);
  EXPECT_EQ(t.counters.linked_backward, 2);
}

TEST_F(AssemblyTest, PairsAllocationsAndAssignsCategories) {
  Trace t = assemble_trace(std::move(in));
  ASSERT_EQ(t.events.size(), 5u);
  ASSERT_EQ(t.allocations.size(), 4u);
  const Allocation& param = t.allocations[0];
  EXPECT_TRUE(param.baseline);
  EXPECT_EQ(param.category, Category::Parameter);
  const Allocation& act = t.allocations[1];
  EXPECT_EQ(act.ptr, 0x1000u);
  EXPECT_EQ(act.category, Category::Activation);
  EXPECT_EQ(act.free_op, 4);
  const Allocation& scratch = t.allocations[2];
  EXPECT_EQ(scratch.category, Category::Temporary);
  const Allocation& out = t.allocations[3];
  EXPECT_EQ(out.free_event, -1);
  EXPECT_EQ(out.category, Category::Other);
  EXPECT_EQ(t.counters.unmatched_frees, 0);
}

// A meta tensor value (storage `storage`, shape {n}) for an op's inputs or outputs.
Value meta_tensor(uint64_t storage, int64_t n) {
  Value v;
  v.kind = Value::Kind::Tensor;
  TensorMeta t;
  t.shape = {n};
  t.dtype = "float32";
  t.device = "meta";
  t.storage = storage;
  v.tensors.push_back(t);
  return v;
}

MemEvent meta_ev(uint64_t seq, uint64_t ptr, int64_t bytes, int64_t op) {
  MemEvent e = ev(seq, ptr, bytes, op, Phase::Forward);
  e.device = "meta";
  return e;
}

// Python meta kernels: aten::addmm and the aten::mm, aten::mul and aten::add its decomposition runs; aten::linear
// around them has a C++ kernel.
bool python_kernels(const OpRecord& op) { return op.name != "aten::linear"; }

// aten::linear > aten::addmm > {aten::mm, aten::mul, aten::add} on meta: mm's and mul's results are temporaries of
// the decomposition, add's is addmm's output; then aten::relu (Python too), one output.
RawThread meta_linear() {
  RawThread t;
  t.thread = 1;
  t.ops.push_back(op("aten::linear", Scope::Function, Phase::Forward, 1, 20, -1, -1, 0));
  t.ops.push_back(op("aten::addmm", Scope::Function, Phase::Forward, 2, 19, 0, -1, 1));
  t.ops.push_back(op("aten::mm", Scope::Function, Phase::Forward, 3, 5, 1, -1, 2));
  t.ops.push_back(op("aten::mul", Scope::Function, Phase::Forward, 6, 8, 1, -1, 2));
  t.ops.push_back(op("aten::add", Scope::Function, Phase::Forward, 9, 12, 1, -1, 2));
  t.ops.push_back(op("aten::relu", Scope::Function, Phase::Forward, 21, 23, -1, -1, 0));
  t.ops[1].inputs.push_back(meta_tensor(0x50, 16));
  t.ops[1].outputs.push_back(meta_tensor(0x30, 16));
  t.events.push_back(meta_ev(4, 0x10, 64, 2));   // mm's result
  t.events.push_back(meta_ev(7, 0x20, 64, 3));   // mul's result
  t.events.push_back(meta_ev(10, 0x30, 64, 4));  // add's result: addmm's output
  t.events.push_back(meta_ev(13, 0x10, -64, 1));
  t.events.push_back(meta_ev(14, 0x20, -64, 1));
  t.events.push_back(meta_ev(22, 0x40, 64, 5));  // relu's output
  return t;
}

TEST(MetaFold, APythonKernelIsOneKernelThatAllocatesItsOutputs) {
  RawThread t = meta_linear();
  const detail::MetaFold f = detail::fold_meta_kernels(t, python_kernels);
  EXPECT_EQ(f.kernels, 2);      // addmm, relu
  EXPECT_EQ(f.ops, 3);          // mm, mul, add
  EXPECT_EQ(f.temporaries, 2);  // mm's and mul's results
  ASSERT_EQ(t.ops.size(), 3u);
  EXPECT_EQ(t.ops[1].name, "aten::addmm");
  EXPECT_EQ(t.ops[1].parent, 0);
  EXPECT_EQ(t.ops[2].name, "aten::relu");
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[0].ptr, 0x30u);
  EXPECT_EQ(t.events[0].op, 1);  // addmm's own, as the CPU records it
  EXPECT_EQ(t.events[0].seq, 10u);
  EXPECT_EQ(t.events[1].op, 2);
}

TEST(MetaFold, NothingFoldsWithoutAPythonKernelOrAMetaTensor) {
  RawThread t = meta_linear();
  EXPECT_EQ(detail::fold_meta_kernels(t, [](const OpRecord&) { return false; }).kernels, 0);
  EXPECT_EQ(t.ops.size(), 6u);
  EXPECT_EQ(t.events.size(), 6u);
  RawThread cpu = meta_linear();
  for (MemEvent& e : cpu.events) e.device = "cpu";
  cpu.ops[1].inputs.clear();
  cpu.ops[1].outputs.clear();
  EXPECT_EQ(detail::fold_meta_kernels(cpu, python_kernels).kernels, 0);  // CPU ops run their CPU kernels
  EXPECT_EQ(cpu.events.size(), 6u);
}

TEST(MetaFold, OutputsAreAllocatedInTheirOrder) {
  // native_layer_norm's Python kernel allocates mean and rstd before the result; the CPU kernel allocates the
  // result first. The blocks move between the event slots, which keep their order.
  RawThread t;
  t.thread = 1;
  t.ops.push_back(op("aten::native_layer_norm", Scope::Function, Phase::Forward, 1, 9, -1, -1, 0));
  t.ops.push_back(op("aten::empty", Scope::Function, Phase::Forward, 2, 3, 0, -1, 1));
  t.ops[0].outputs = {meta_tensor(0x30, 64), meta_tensor(0x10, 4), meta_tensor(0x20, 4)};
  t.events.push_back(meta_ev(4, 0x10, 16, 1));
  t.events.push_back(meta_ev(5, 0x20, 16, 0));
  t.events.push_back(meta_ev(6, 0x30, 256, 0));
  detail::fold_meta_kernels(t, python_kernels);
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[0].ptr, 0x30u);
  EXPECT_EQ(t.events[0].bytes, 256);
  EXPECT_EQ(t.events[1].ptr, 0x10u);
  EXPECT_EQ(t.events[2].ptr, 0x20u);
  EXPECT_EQ(t.events[0].seq, 4u);
  EXPECT_EQ(t.events[2].seq, 6u);
  for (const MemEvent& e : t.events) EXPECT_EQ(e.op, 0);
}

TEST(MetaFold, AnAssembledTraceSaysWhatWasFolded) {
  AssemblyInput in;
  in.threads.push_back(meta_linear());
  in.meta_kernel_in_python = python_kernels;
  Trace t = assemble_trace(std::move(in));
  ASSERT_EQ(t.ops.size(), 3u);
  ASSERT_EQ(t.allocations.size(), 2u);
  EXPECT_EQ(t.allocations[0].alloc_op, 1);
  ASSERT_EQ(t.notes.size(), 1u);
  EXPECT_EQ(t.notes[0].code, "meta-kernels-folded");
}

TEST_F(AssemblyTest, CountsFreesOfUnknownBlocks) {
  in.threads[0].events.push_back(ev(20, 0xdead, -8, -1, Phase::Forward));
  Trace t = assemble_trace(std::move(in));
  EXPECT_EQ(t.counters.unmatched_frees, 1);
  EXPECT_EQ(t.events.back().allocation, -1);
}

TEST_F(AssemblyTest, JsonRoundTripIsExact) {
  Trace t = assemble_trace(std::move(in));
  t.ops[1].inputs.push_back(Value{Value::Kind::Tensor, {TensorMeta{{8, 16}, {16, 1}, "float32", "cpu", 0x1000}}, 0});
  t.ops[1].inputs.push_back(Value{Value::Kind::Scalar, {}, 2.5});
  t.ops[1].outputs.push_back(Value{Value::Kind::TensorList, {TensorMeta{{2}, {1}, "int64", "cpu", 0}}, 0});
  t.notes.push_back(Note{"a-code", "a note"});
  t.timed_layers = {"Net.fc", "(outside modules)"};
  Trace back = trace_from_json(trace_to_json(t));
  EXPECT_EQ(trace_to_json(back), trace_to_json(t));
  EXPECT_EQ(back.timed_layers, t.timed_layers);
  EXPECT_EQ(back.ops[1].inputs, t.ops[1].inputs);
  EXPECT_EQ(back.ops[1].outputs, t.ops[1].outputs);
  EXPECT_EQ(back.context.torch_version, "2.14.1");
  EXPECT_EQ(back.notes, t.notes);
}

TEST_F(AssemblyTest, VersionOneNotesReadAsUnclassified) {
  // Version 1 wrote each note as its text alone.
  Trace t = assemble_trace(std::move(in));
  std::string text = trace_to_json(t);
  const std::string current = "\"schema_version\":" + std::to_string(kTraceSchemaVersion);
  ASSERT_NE(text.find(current), std::string::npos);
  text.replace(text.find(current), current.size(), R"("schema_version":1)");
  const std::string notes = R"("notes":[])";
  ASSERT_NE(text.find(notes), std::string::npos);
  text.replace(text.find(notes), notes.size(), R"("notes":["CUPTI is not available"])");
  const Trace back = trace_from_json(text);
  EXPECT_EQ(back.notes, (std::vector<Note>{{"unclassified", "CUPTI is not available"}}));
}

TEST_F(AssemblyTest, NonFiniteScalarsSurviveTheRoundTrip) {
  // An attention mask's -inf fill value: JSON has no number for it, and a saved trace must load again.
  Trace t = assemble_trace(std::move(in));
  const double inf = std::numeric_limits<double>::infinity();
  for (double x : {-inf, inf, std::numeric_limits<double>::quiet_NaN()}) {
    t.ops[1].inputs.push_back(Value{Value::Kind::Scalar, {}, x});
  }
  const std::string text = trace_to_json(t);
  EXPECT_NE(text.find(R"("value":"-inf")"), std::string::npos);
  Trace back = trace_from_json(text);
  const auto& in = back.ops[1].inputs;
  ASSERT_EQ(in.size(), 3u);
  EXPECT_EQ(in[0].scalar, -inf);
  EXPECT_EQ(in[1].scalar, inf);
  EXPECT_TRUE(std::isnan(in[2].scalar));
  EXPECT_EQ(trace_to_json(back), text);
  // Files written before: no type, null where the value was not finite.
  std::string old = text;
  for (size_t at; (at = old.find(R"("type":"float",)")) != std::string::npos;) old.erase(at, 15);
  old.replace(old.find(R"("value":"inf")"), 13, R"("value":null)");
  EXPECT_TRUE(std::isnan(trace_from_json(old).ops[1].inputs[1].scalar));
  old.replace(old.find(R"("value":"nan")"), 13, R"("value":"x")");
  try {
    trace_from_json(old, "x.json");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), R"(x.json: field 'ops[1].inputs[2].value' should be a number, "inf", "-inf" or "nan", got "x")");
  }
}

TEST(TraceJson, RejectsMalformedJsonNamingThePosition) {
  try {
    trace_from_json("{\"schema_version\": 1,", "t.json");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("t.json: malformed JSON at byte 22: "), std::string::npos)
        << e.what();
  }
}

TEST(TraceJson, RejectsOtherSchemaVersionsNamingTheVersion) {
  try {
    trace_from_json(R"({"schema_version": 7})", "old.json");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "old.json: trace schema_version 7 is not supported by this gpucast (reads versions 1 to 3); record the "
                 "trace again with this version");
  }
}

TEST(TraceJson, NamesTheBadField) {
  Trace t;
  t.context = TraceContext{"0.1.0", "2.14.1", "cpu", "Release", false};
  std::string text = trace_to_json(t);
  text.replace(text.find("\"torch_version\":\"2.14.1\""), 24, "\"torch_version\":3");
  try {
    trace_from_json(text, "x.json");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), R"(x.json: field 'context.torch_version' should be a string, or {"escaped": text}, got 3)");
  }
}

// What trace_from_json refuses, each named by its field: a fuzzed or hand-edited file must never reach code that
// indexes, sums or recurses on it (the faults a fuzzer found: SIGSEGV on an out-of-range index, SIGSEGV on deep
// nesting, a version read modulo 2^32, sums that overflowed).
std::string trace_error(const std::string& text) {
  try {
    trace_from_json(text, "t.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "accepted";
}

const char* kSmallTrace =
    R"({"schema_version":1,"context":{"gpucast_version":"0","torch_version":"2","device":"cpu"},)"
    R"("ops":[{"id":0,"name":"aten::mm","scope":"function","phase":"forward","thread":1,"start_ns":0,"end_ns":1}],)"
    R"("events":[{"seq":0,"ptr":16,"bytes":512,"device":"cpu","op":0,"allocation":0}],)"
    R"("allocations":[{"ptr":16,"bytes":512,"device":"cpu","alloc_event":0,"alloc_op":0}]})";

std::string edited(std::string_view from, std::string_view to) {
  std::string text = kSmallTrace;
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(TraceJson, ValidatesIndicesRangesAndDepth) {
  EXPECT_EQ(trace_error(kSmallTrace), "accepted");
  EXPECT_EQ(trace_error(edited(R"("alloc_op":0)", R"("alloc_op":7)")),
            "t.json: field 'allocations[0].alloc_op' should be -1 or an index below 1, got 7");
  EXPECT_EQ(trace_error(edited(R"("allocation":0)", R"("allocation":3)")),
            "t.json: field 'events[0].allocation' should be -1 or an index below 1, got 3");
  EXPECT_EQ(trace_error(edited(R"("schema_version":1)", R"("schema_version":4294967297)")),
            "t.json: trace schema_version 4294967297 is not supported by this gpucast (reads versions 1 to 3); "
            "record the trace again with this version");
  EXPECT_EQ(trace_error(edited(R"("schema_version":1)", R"("schema_version":18446744073709551615)")),
            "t.json: field 'schema_version' should be an integer in range, got 18446744073709551615");
  EXPECT_EQ(trace_error(edited(R"("end_ns":1)", R"("end_ns":1e300)")),
            "t.json: field 'ops[0].end_ns' should be an integer in range, got 1e+300");
  EXPECT_EQ(trace_error(edited(R"("end_ns":1)", R"("end_ns":1e400)")),
            "t.json: malformed JSON: number overflow parsing '1e400'");
  EXPECT_EQ(trace_error(edited(R"("bytes":512,"device":"cpu","alloc)", R"("bytes":2199023255552,"device":"cpu","alloc)")),
            "t.json: field 'allocations[0].bytes' should be a byte count of 0 up to 1099511627776, got 2199023255552");
  EXPECT_EQ(trace_error(std::string(100000, '[') + std::string(100000, ']')),
            "t.json: malformed JSON at byte 65: nested more than 64 levels deep");
  // Invalid UTF-8 in the text: the message shows the bytes escaped.
  const std::string bad_byte = edited(R"("aten::mm")", "\"aten::\xff\"");
  const std::string msg = trace_error(bad_byte);
  EXPECT_EQ(msg.rfind("t.json: malformed JSON at byte ", 0), 0u) << msg;
  EXPECT_EQ(valid_utf8(msg), msg);
}

TEST(Utf8, InvalidBytesAreEscaped) {
  EXPECT_EQ(valid_utf8("plain"), "plain");
  EXPECT_EQ(valid_utf8("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(valid_utf8("a\xff" "b"), "a\\xFFb");
  EXPECT_EQ(valid_utf8("\xc0\xaf"), "\\xC0\\xAF");         // overlong '/'
  EXPECT_EQ(valid_utf8("\xed\xa0\x80"), "\\xED\\xA0\\x80");  // a surrogate
  EXPECT_EQ(valid_utf8("\xe2\x82"), "\\xE2\\x82");          // cut short
}

TEST(TraceJson, ChromeExportHasOneCompleteEventPerOpAndACounterPerEvent) {
  AssemblyInput in;
  RawThread th;
  th.thread = 5;
  th.ops.push_back(op("aten::add", Scope::Function, Phase::Forward, 1, 3));
  th.events.push_back(ev(2, 0x10, 100, 0, Phase::Forward, 5));
  in.threads.push_back(th);
  std::string chrome = trace_to_chrome_json(assemble_trace(std::move(in)));
  EXPECT_NE(chrome.find("\"ph\":\"X\""), std::string::npos);
  EXPECT_NE(chrome.find("\"name\":\"aten::add\""), std::string::npos);
  EXPECT_NE(chrome.find("\"ph\":\"C\""), std::string::npos);
  EXPECT_NE(chrome.find("\"bytes\":100"), std::string::npos);
}

// Round trips of every value the tracer records: a saved trace loads back with exactly the values it held.

// Doubles equal as a file must keep them: bit for bit in sign and value (-0.0 is not 0.0), any NaN equal to NaN.
bool same_double(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

void expect_same_values(const std::vector<Value>& got, const std::vector<Value>& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string w = where + "[" + std::to_string(i) + "]";
    EXPECT_EQ(got[i].kind, want[i].kind) << w;
    EXPECT_EQ(got[i].tensors, want[i].tensors) << w;
    EXPECT_EQ(got[i].scalar_type, want[i].scalar_type) << w;
    EXPECT_TRUE(same_double(got[i].scalar, want[i].scalar)) << w << ": " << got[i].scalar << " vs " << want[i].scalar;
    EXPECT_EQ(got[i].integer, want[i].integer) << w;
    EXPECT_TRUE(same_double(got[i].imag, want[i].imag)) << w << ": " << got[i].imag << " vs " << want[i].imag;
  }
}

// Every field of two traces, NaN scalars compared as NaN.
void expect_same_trace(const Trace& got, const Trace& want) {
  EXPECT_EQ(got.schema_version, want.schema_version);
  EXPECT_EQ(got.context.gpucast_version, want.context.gpucast_version);
  EXPECT_EQ(got.context.torch_version, want.context.torch_version);
  EXPECT_EQ(got.context.device, want.context.device);
  EXPECT_EQ(got.context.build_type, want.context.build_type);
  EXPECT_EQ(got.context.cuda_build, want.context.cuda_build);
  EXPECT_EQ(got.start_ns, want.start_ns);
  EXPECT_EQ(got.end_ns, want.end_ns);
  ASSERT_EQ(got.ops.size(), want.ops.size());
  for (size_t i = 0; i < want.ops.size(); ++i) {
    const OpRecord& a = got.ops[i];
    const OpRecord& b = want.ops[i];
    const std::string w = "ops[" + std::to_string(i) + "]";
    EXPECT_EQ(std::tie(a.id, a.name, a.overload, a.scope, a.phase, a.thread, a.seq_nr, a.fwd_thread, a.parent),
              std::tie(b.id, b.name, b.overload, b.scope, b.phase, b.thread, b.seq_nr, b.fwd_thread, b.parent))
        << w;
    EXPECT_EQ(std::tie(a.depth, a.start_ns, a.end_ns, a.start_seq, a.end_seq, a.complete, a.module, a.fwd_op),
              std::tie(b.depth, b.start_ns, b.end_ns, b.start_seq, b.end_seq, b.complete, b.module, b.fwd_op))
        << w;
    EXPECT_EQ(std::tie(a.bwd_node, a.device_ns, a.nested), std::tie(b.bwd_node, b.device_ns, b.nested)) << w;
    expect_same_values(a.inputs, b.inputs, w + ".inputs");
    expect_same_values(a.outputs, b.outputs, w + ".outputs");
  }
  ASSERT_EQ(got.events.size(), want.events.size());
  for (size_t i = 0; i < want.events.size(); ++i) {
    const MemEvent& a = got.events[i];
    const MemEvent& b = want.events[i];
    EXPECT_EQ(std::tie(a.seq, a.ptr, a.bytes, a.block_bytes, a.device, a.thread, a.op, a.phase, a.time_ns),
              std::tie(b.seq, b.ptr, b.bytes, b.block_bytes, b.device, b.thread, b.op, b.phase, b.time_ns))
        << "events[" << i << "]";
    EXPECT_EQ(a.allocation, b.allocation) << "events[" << i << "]";
  }
  ASSERT_EQ(got.allocations.size(), want.allocations.size());
  for (size_t i = 0; i < want.allocations.size(); ++i) {
    const Allocation& a = got.allocations[i];
    const Allocation& b = want.allocations[i];
    EXPECT_EQ(std::tie(a.ptr, a.bytes, a.block_bytes, a.device, a.baseline, a.alloc_event, a.free_event, a.alloc_op,
                       a.free_op, a.category),
              std::tie(b.ptr, b.bytes, b.block_bytes, b.device, b.baseline, b.alloc_event, b.free_event, b.alloc_op,
                       b.free_op, b.category))
        << "allocations[" << i << "]";
  }
  ASSERT_EQ(got.baseline.size(), want.baseline.size());
  for (auto a = got.baseline.begin(), b = want.baseline.begin(); b != want.baseline.end(); ++a, ++b) {
    EXPECT_EQ(a->first, b->first);
    EXPECT_EQ(std::tie(a->second.bytes, a->second.known), std::tie(b->second.bytes, b->second.known));
  }
  const TraceCounters& c = got.counters;
  const TraceCounters& d = want.counters;
  EXPECT_EQ(std::tie(c.dropped_ops, c.dropped_events, c.unlinked_backward, c.linked_backward, c.unmatched_frees,
                     c.callback_errors, c.threads),
            std::tie(d.dropped_ops, d.dropped_events, d.unlinked_backward, d.linked_backward, d.unmatched_frees,
                     d.callback_errors, d.threads));
  EXPECT_EQ(got.timing_source, want.timing_source);
  EXPECT_EQ(got.timed_layers, want.timed_layers);
  EXPECT_EQ(got.notes, want.notes);
}

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// The scalars a recorded op may hold that a double, or JSON's numbers, cannot carry naively.
std::vector<Value> extreme_scalars() {
  return {float_scalar(kNaN), float_scalar(kInf), float_scalar(-kInf), float_scalar(-0.0), float_scalar(0.0),
          float_scalar(std::numeric_limits<double>::denorm_min()), float_scalar(std::numeric_limits<double>::min()),
          float_scalar(std::numeric_limits<double>::max()), float_scalar(-std::numeric_limits<double>::max()),
          float_scalar(0.1), float_scalar(3.0), float_scalar(9007199254740993.0),
          int_scalar(kInt64Min), int_scalar(kInt64Max), int_scalar((int64_t{1} << 53) + 1),
          int_scalar((int64_t{1} << 62) + 1), int_scalar(-((int64_t{1} << 60) + 1)), int_scalar(0), int_scalar(-1),
          bool_scalar(true), bool_scalar(false), complex_scalar(1.0, 2.0), complex_scalar(-0.0, kNaN),
          complex_scalar(kInf, -kInf), complex_scalar(std::numeric_limits<double>::denorm_min(), -1e300)};
}

// A trace holding each value: scalars of every type and extreme, and strings that are not UTF-8 in each string
// field (user scopes and module paths come from C++ as any bytes).
Trace trace_of_every_value() {
  Trace t;
  t.context = TraceContext{"0.1.0\xff", "2.14.1", "cpu \xc3\x28", "Rel\\ease", true};
  t.start_ns = kInt64Min;
  t.end_ns = kInt64Max;
  OpRecord scope;
  scope.id = 0;
  scope.name = "step \xff\xfe \\xFF %41";  // RECORD_USER_SCOPE with bytes, a literal \xFF and a backslash
  scope.scope = Scope::UserScope;
  scope.module = "Net.\xe2\x82 cut short";
  scope.overload = "\xed\xa0\x80";  // an encoded surrogate: not UTF-8
  scope.inputs = extreme_scalars();
  scope.outputs = {Value{Value::Kind::Tensor, {TensorMeta{{2, 3}, {3, 1}, "int64\x80", "cuda:\xff", ~uint64_t{0}}}, 0}};
  OpRecord fill;
  fill.id = 1;
  fill.parent = 0;
  fill.depth = 1;
  fill.name = "aten::full";
  fill.module = "Net.caf\xc3\xa9";  // valid UTF-8: written as is
  fill.inputs = {Value{Value::Kind::Other}, float_scalar(-kInf), Value{Value::Kind::None}};
  t.ops = {scope, fill};
  MemEvent e;
  e.device = "dev\xc0\xaf";
  e.op = 1;
  e.allocation = 0;
  e.bytes = e.block_bytes = 512;
  t.events = {e};
  Allocation a;
  a.device = "dev\xc0\xaf";
  a.bytes = a.block_bytes = 512;
  a.alloc_event = 0;
  a.alloc_op = 1;
  t.allocations = {a};
  t.baseline["cpu"] = DeviceBaseline{256, true};
  t.baseline["dev\xc0\xaf"] = DeviceBaseline{1, false};
  t.baseline["dev\\xC0\\xAF"] = DeviceBaseline{2, true};  // what the other would read as, escaped naively
  t.timing_source = "cpu_clock";
  t.timed_layers = {"Net.\xff", "Net.\\xFF"};
  t.notes = {Note{"device-timer-report", "CUPTI said \xff\xfe"}};
  return t;
}

TEST(TraceValues, ScalarsKeepTheirTypeAndEveryDigit) {
  // A seed or a fill value above 2^53 (torch.full(..., 2**62 + 1)), a complex factor, a mask's -inf, -0.0.
  Trace t;
  OpRecord op;
  op.id = 0;
  op.name = "aten::full";
  op.inputs = extreme_scalars();
  t.ops = {op};
  const Trace back = trace_from_json(trace_to_json(t));
  expect_same_values(back.ops[0].inputs, t.ops[0].inputs, "inputs");
}

TEST(TraceValues, EveryValueTheTracerRecordsRoundTripsExactly) {
  const Trace t = trace_of_every_value();
  const std::string text = trace_to_json(t);
  EXPECT_EQ(invalid_utf8_at(text), std::string::npos);  // a file any JSON reader accepts
  EXPECT_NE(text.find(R"({"kind":"scalar","type":"int","value":4611686018427387905})"), std::string::npos) << text;
  EXPECT_NE(text.find(R"({"kind":"scalar","type":"int","value":-9223372036854775808})"), std::string::npos);
  EXPECT_NE(text.find(R"({"kind":"scalar","type":"complex","value":[1.0,2.0]})"), std::string::npos);
  EXPECT_NE(text.find(R"({"kind":"scalar","type":"float","value":"-inf"})"), std::string::npos);
  EXPECT_NE(text.find(R"("module":"Net.caf)" "\xc3\xa9\""), std::string::npos);
  EXPECT_NE(text.find(R"("name":{"escaped":"step \\xFF\\xFE \\\\xFF %41"})"), std::string::npos) << text;
  const Trace back = trace_from_json(text, "t.json");
  expect_same_trace(back, t);
  EXPECT_EQ(trace_to_json(back), text);
  // Through a file, as Trace.save and gpucast.load_trace do.
  const std::string path = ::testing::TempDir() + "/every_value.json";
  {
    std::ofstream out(path, std::ios::binary);
    write_trace_json(t, out);
  }
  expect_same_trace(load_trace(path), t);
}

TEST(TraceValues, OtherWritersOfTraceDataAcceptAnyBytes) {
  const Trace t = trace_of_every_value();
  // Each is valid UTF-8: JSON that Python's json module and browsers read.
  for (const std::string& doc : {trace_header_json(t), trace_records_json(t, "ops", 0, 2),
                                 trace_records_json(t, "events", 0, 1), trace_records_json(t, "allocations", 0, 1),
                                 ops_to_json(t, {t.ops[0].name, "aten::full"}), trace_to_chrome_json(t)}) {
    EXPECT_EQ(invalid_utf8_at(doc), std::string::npos) << doc;
  }
  // A view's records are the file's records.
  const std::string text = trace_to_json(t);
  EXPECT_NE(text.find(trace_records_json(t, "ops", 0, 2)), std::string::npos);
  EXPECT_NE(ops_to_json(t, {"aten::full"}).find(R"({"kind":"scalar","type":"float","value":"-inf"})"),
            std::string::npos);
}

TEST(TraceValues, OlderSchemaVersionsStillLoad) {
  // Version 2: scalars as numbers (ints written as doubles) or "nan", "inf", "-inf"; notes {"code", "text"}.
  const std::string v2 =
      R"({"schema_version":2,"context":{"gpucast_version":"0","torch_version":"2","device":"cpu"},)"
      R"("notes":[{"code":"c","text":"t"}],)"
      R"("ops":[{"id":0,"name":"aten::full","scope":"function","phase":"forward","thread":1,"start_ns":0,"end_ns":1,)"
      R"("inputs":[{"kind":"scalar","value":3.0},{"kind":"scalar","value":"-inf"},{"kind":"scalar","value":"nan"},)"
      R"({"kind":"scalar","value":4611686018427387904.0},{"kind":"scalar","value":7}]}],"events":[],"allocations":[]})";
  const Trace b = trace_from_json(v2, "v2.json");
  expect_same_values(b.ops[0].inputs,
                     {float_scalar(3.0), float_scalar(-kInf), float_scalar(kNaN), float_scalar(4611686018427387904.0),
                      float_scalar(7.0)},
                     "v2");
  EXPECT_EQ(b.notes, (std::vector<Note>{{"c", "t"}}));
  // Version 1: null where a scalar was not finite; notes as text.
  const std::string v1 =
      R"({"schema_version":1,"context":{"gpucast_version":"0","torch_version":"2","device":"cpu"},)"
      R"("notes":["CUPTI is not available"],)"
      R"("ops":[{"id":0,"name":"aten::full","scope":"function","phase":"forward","thread":1,"start_ns":0,"end_ns":1,)"
      R"("inputs":[{"kind":"scalar","value":null},{"kind":"scalar","value":-2.5}]}],"events":[],"allocations":[]})";
  const Trace a = trace_from_json(v1, "v1.json");
  expect_same_values(a.ops[0].inputs, {float_scalar(kNaN), float_scalar(-2.5)}, "v1");
  EXPECT_EQ(a.notes, (std::vector<Note>{{"unclassified", "CUPTI is not available"}}));
}

// A version-3 trace with one op, its module and one scalar input, for edits that break one field.
const char* kValueTrace =
    R"({"schema_version":3,"context":{"gpucast_version":"0","torch_version":"2","device":"cpu"},)"
    R"("baseline":{"cpu":{"bytes":0,"known":true}},)"
    R"("ops":[{"id":0,"name":"aten::add","scope":"function","phase":"forward","thread":1,"start_ns":0,"end_ns":1,)"
    R"("module":"Net","inputs":[{"kind":"scalar","type":"int","value":1}]}],"events":[],"allocations":[]})";

std::string value_trace_edited(std::string_view from, std::string_view to) {
  std::string text = kValueTrace;
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(TraceValues, MalformedEscapesAndScalarEncodingsAreRefusedNamingTheField) {
  EXPECT_EQ(trace_error(kValueTrace), "accepted");
  EXPECT_EQ(trace_from_json(value_trace_edited(R"("Net")", R"({"escaped":"N\\xFFt\\\\"})")).ops[0].module,
            "N\xfft\\");
  const std::string escape_expected =
      R"(text with each backslash written \\ and each byte that is not UTF-8 written \xNN (two hex digits))";
  const std::string string_expected = R"(a string, or {"escaped": text})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {value_trace_edited(R"("Net")", R"({"escaped":"N\\qt"})"),
       R"(t.json: field 'ops[0].module.escaped' should be )" + escape_expected + R"(, got "N\\qt")"},
      {value_trace_edited(R"("Net")", R"({"escaped":"N\\xF"})"),
       R"(t.json: field 'ops[0].module.escaped' should be )" + escape_expected + R"(, got "N\\xF")"},
      {value_trace_edited(R"("Net")", R"({"escaped":"N\\xG0"})"),
       R"(t.json: field 'ops[0].module.escaped' should be )" + escape_expected + R"(, got "N\\xG0")"},
      {value_trace_edited(R"("Net")", R"({"escaped":"N\\"})"),
       R"(t.json: field 'ops[0].module.escaped' should be )" + escape_expected + R"(, got "N\\")"},
      {value_trace_edited(R"("Net")", R"({"escaped":7})"),
       R"(t.json: field 'ops[0].module' should be )" + string_expected + R"(, got {"escaped":7})"},
      {value_trace_edited(R"("Net")", R"({"escape":"Net"})"),
       R"(t.json: field 'ops[0].module' should be )" + string_expected + R"(, got {"escape":"Net"})"},
      {value_trace_edited(R"("aten::add")", R"({"escaped":"a\\x"})"),
       R"(t.json: field 'ops[0].name.escaped' should be )" + escape_expected + R"(, got "a\\x")"},
      {value_trace_edited(R"("cpu":{)", R"("c\\pu":{)"),
       R"(t.json: field 'baseline' should be device names as )" + escape_expected + R"(, got "c\\pu")"},
      {value_trace_edited(R"("value":1)", R"("value":1.5)"),
       "t.json: field 'ops[0].inputs[0].value' should be an integer in range, got 1.5"},
      {value_trace_edited(R"("value":1)", R"("value":9223372036854775808)"),
       "t.json: field 'ops[0].inputs[0].value' should be an integer in range, got 9223372036854775808"},
      {value_trace_edited(R"("value":1)", R"("value":"1")"),
       R"(t.json: field 'ops[0].inputs[0].value' should be an integer in range, got "1")"},
      {value_trace_edited(R"("type":"int")", R"("type":"quaternion")"),
       R"(t.json: field 'ops[0].inputs[0].type' should be one of float, int, bool, complex, got "quaternion")"},
      {value_trace_edited(R"("type":"int")", R"("type":"bool")"),
       "t.json: field 'ops[0].inputs[0].value' should be a boolean, got 1"},
      {value_trace_edited(R"("type":"int","value":1)", R"("type":"float","value":null)"),
       R"(t.json: field 'ops[0].inputs[0].value' should be a number, "inf", "-inf" or "nan", got null)"},
      {value_trace_edited(R"("type":"int")", R"("type":"complex")"),
       R"(t.json: field 'ops[0].inputs[0].value' should be [real, imaginary], got 1)"},
      {value_trace_edited(R"("type":"int","value":1)", R"("type":"complex","value":[1])"),
       R"(t.json: field 'ops[0].inputs[0].value' should be [real, imaginary], got [1])"},
      {value_trace_edited(R"("type":"int","value":1)", R"("type":"complex","value":[1,"x"])"),
       R"(t.json: field 'ops[0].inputs[0].value[1]' should be a number, "inf", "-inf" or "nan", got "x")"},
  };
  for (const auto& [text, message] : cases) EXPECT_EQ(trace_error(text), message) << text;
}

// Random bytes, weighted to what breaks encodings: backslashes and 'x' (the escape's own text), quotes, NUL,
// bytes that start, continue or cut short multi-byte sequences, and whole valid ones.
std::string random_bytes(std::mt19937_64& rng) {
  static const std::vector<std::string> pieces = {
      "a",    "Z",        ".",  "\\",   "x",        "F",        "\"", std::string(1, '\0'), "\x7f", "\x80",
      "\xbf", "\xc0\xaf", "\xc3", "\xc3\xa9", "\xe2\x82", "\xe2\x82\xac", "\xed\xa0\x80", "\xf0\x9f\x98\x80",
      "\xf4\x90\x80\x80", "\xff", "%", "\\x",  "\\\\"};
  std::string s;
  const size_t n = rng() % 12;
  for (size_t i = 0; i < n; ++i) {
    if (rng() % 4 == 0) s += static_cast<char>(rng() % 256);
    else s += pieces[rng() % pieces.size()];
  }
  return s;
}

Value random_value(std::mt19937_64& rng) {
  static const std::vector<Value> scalars = extreme_scalars();
  switch (rng() % 6) {
    case 0: return Value{Value::Kind::None};
    case 1: return Value{Value::Kind::Other};
    case 2: return Value{Value::Kind::Tensor, {TensorMeta{{int64_t(rng() % 9), -1}, {}, random_bytes(rng),
                                                          random_bytes(rng), rng()}}};
    case 3: {
      Value v{Value::Kind::TensorList};
      for (size_t i = rng() % 3; i > 0; --i) {
        v.tensors.push_back(TensorMeta{{static_cast<int64_t>(rng())}, {1}, "float32", "cpu", 0});
      }
      return v;
    }
    case 4: return scalars[rng() % scalars.size()];
    default: {
      // Random bits: any double (NaN payloads read back as NaN), any integer, any complex.
      const uint64_t bits = rng();
      double d;
      std::memcpy(&d, &bits, sizeof d);
      if (rng() % 3 == 0) return int_scalar(static_cast<int64_t>(bits));
      if (rng() % 2 == 0) return complex_scalar(d, -d);
      return float_scalar(d);
    }
  }
}

Trace random_trace(std::mt19937_64& rng) {
  Trace t;
  t.context = TraceContext{random_bytes(rng), random_bytes(rng), random_bytes(rng), random_bytes(rng), rng() % 2 == 0};
  t.start_ns = static_cast<int64_t>(rng());
  t.end_ns = static_cast<int64_t>(rng());
  const size_t n_ops = rng() % 6;
  auto ref = [&](size_t n) { return n == 0 || rng() % 2 == 0 ? int64_t{-1} : static_cast<int64_t>(rng() % n); };
  for (size_t i = 0; i < n_ops; ++i) {
    OpRecord op;
    op.id = static_cast<int64_t>(i);
    op.name = rng() % 2 ? random_bytes(rng) : "aten::add";
    op.overload = random_bytes(rng);
    op.scope = static_cast<Scope>(rng() % 3);
    op.phase = static_cast<Phase>(rng() % 3);
    op.thread = rng();
    op.seq_nr = static_cast<int64_t>(rng());
    op.fwd_thread = rng();
    op.parent = ref(n_ops);
    op.depth = static_cast<int32_t>(rng());
    op.start_ns = static_cast<int64_t>(rng());
    op.end_ns = static_cast<int64_t>(rng());
    op.start_seq = rng();
    op.end_seq = rng();
    op.complete = rng() % 2 == 0;
    op.module = random_bytes(rng);
    op.fwd_op = ref(n_ops);
    op.bwd_node = ref(n_ops);
    op.device_ns = static_cast<int64_t>(rng());
    op.nested = static_cast<int64_t>(rng());
    for (size_t k = rng() % 5; k > 0; --k) op.inputs.push_back(random_value(rng));
    for (size_t k = rng() % 3; k > 0; --k) op.outputs.push_back(random_value(rng));
    t.ops.push_back(std::move(op));
  }
  for (size_t i = rng() % 3; i > 0; --i) {
    MemEvent e;
    e.seq = rng();
    e.ptr = rng();
    e.bytes = static_cast<int64_t>(rng() % kMaxTraceBlockBytes) * (rng() % 2 ? 1 : -1);
    e.block_bytes = e.bytes;
    e.device = random_bytes(rng);
    e.op = ref(n_ops);
    t.events.push_back(e);
  }
  for (size_t i = rng() % 3; i > 0; --i) {
    Allocation a;
    a.ptr = rng();
    a.bytes = a.block_bytes = static_cast<int64_t>(rng() % kMaxTraceBlockBytes);
    a.device = random_bytes(rng);
    a.alloc_event = ref(t.events.size());
    a.alloc_op = ref(n_ops);
    a.category = static_cast<Category>(rng() % kNumCategories);
    t.allocations.push_back(a);
  }
  for (size_t i = rng() % 3; i > 0; --i) t.baseline[random_bytes(rng)] = DeviceBaseline{int64_t(rng()), rng() % 2 == 0};
  t.timing_source = random_bytes(rng);
  for (size_t i = rng() % 3; i > 0; --i) t.timed_layers.push_back(random_bytes(rng));
  for (size_t i = rng() % 3; i > 0; --i) t.notes.push_back(Note{random_bytes(rng), random_bytes(rng)});
  return t;
}

TEST(TraceValues, RandomTracesRoundTripFieldByField) {
  std::mt19937_64 rng(20240601);  // fixed: a failure reproduces
  for (int i = 0; i < 300; ++i) {
    SCOPED_TRACE("trace " + std::to_string(i));
    const Trace t = random_trace(rng);
    std::string text;
    ASSERT_NO_THROW(text = trace_to_json(t));
    ASSERT_EQ(invalid_utf8_at(text), std::string::npos) << text;
    Trace back;
    ASSERT_NO_THROW(back = trace_from_json(text, "random.json")) << text;
    expect_same_trace(back, t);
    if (::testing::Test::HasFailure()) break;  // one trace's differences, not 300
    EXPECT_NO_THROW(trace_to_chrome_json(t));
    EXPECT_NO_THROW(trace_header_json(t));
  }
}

TEST(CudaBlock, RoundsLikeTheCachingAllocator) {
  EXPECT_EQ(cuda_block_bytes(1), 512);
  EXPECT_EQ(cuda_block_bytes(512), 512);
  EXPECT_EQ(cuda_block_bytes(513), 1024);
  EXPECT_EQ(cuda_block_bytes(1000000), 1000448);
  // 4 divisions of [1 MiB, 2 MiB): steps of 256 KiB.
  EXPECT_EQ(cuda_block_bytes(1048576 + 1, 4), 1048576 + 262144);
  auto a = cuda_trace_delta("alloc", 700);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->bytes, 700);
  EXPECT_EQ(a->block_bytes, 1024);
  auto f = cuda_trace_delta("free_requested", 700);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->block_bytes, -1024);
  EXPECT_FALSE(cuda_trace_delta("segment_alloc", 2097152).has_value());
}

// A fake of the CUDA caching allocator's order of work around its trace trackers (c10/cuda/CUDACachingAllocator.cpp:
// the block is taken, the trackers are called, then the block is returned; a tracker's exception leaves malloc) with
// gpucast's tracker body: what on_risk:raise does to a CUDA job, without a GPU.
class FakeCachingAllocator {
 public:
  explicit FakeCachingAllocator(AllocationRefusal& refusal) : refusal_(refusal) {}
  // The block's address, or throws the refusal as the hook does (a c10::Error there, a UserError here).
  int64_t malloc(int64_t size) {
    taken_ += cuda_block_bytes(size);
    track("alloc", size);
    return ++next_;
  }
  void free(int64_t size) {
    taken_ -= cuda_block_bytes(size);
    track("free_requested", size);
  }
  bool recording = false;
  int64_t taken_ = 0;
  int64_t recorded_block_bytes = 0;

 private:
  void track(const std::string& action, int64_t size) {
    const CudaEntryOutcome out =
        cuda_trace_entry_outcome(action, size, recording, refusal_, std::this_thread::get_id());
    if (out.delta) recorded_block_bytes += out.delta->block_bytes;
    if (out.refusal) GPUCAST_USER_ERROR("{}", *out.refusal);
  }
  AllocationRefusal& refusal_;
  int64_t next_ = 0;
};

TEST(AllocationRefusal, TheTrainingThreadsNextCudaAllocationFailsOnce) {
  AllocationRefusal refusal;
  FakeCachingAllocator cuda(refusal);
  EXPECT_EQ(cuda.malloc(700), 1);  // nothing armed: allocations pass, and nothing is recorded outside a trace
  EXPECT_EQ(cuda.recorded_block_bytes, 0);
  refusal.arm(std::this_thread::get_id(), "gpucast: out-of-memory risk on H100");
  EXPECT_TRUE(refusal.pending());
  // Another thread (autograd's device threads, a data loader's pin-memory thread) allocates freely.
  int64_t other = 0;
  std::thread([&] { other = cuda.malloc(4096); }).join();
  EXPECT_EQ(other, 2);
  cuda.free(700);  // a free is never refused
  EXPECT_TRUE(refusal.pending());
  try {
    cuda.malloc(1 << 20);
    ADD_FAILURE() << "the training thread's allocation was not refused";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "gpucast: out-of-memory risk on H100");
  }
  // The refused request's block stays taken (the real allocator took it before calling its trackers).
  EXPECT_EQ(cuda.taken_, 4096 + (1 << 20));
  EXPECT_FALSE(refusal.pending());
  EXPECT_EQ(cuda.malloc(512), 3);  // once: the next one passes
}

TEST(AllocationRefusal, TheFirstAllocatorToAllocateTakesItAndAnEmptyMessageClears) {
  AllocationRefusal refusal;
  FakeCachingAllocator cuda(refusal);
  cuda.recording = true;
  refusal.arm(std::this_thread::get_id(), "stop");
  // The CPU wrapper allocates first on this thread (a batch built on the CPU): it takes the refusal.
  EXPECT_EQ(refusal.take(std::this_thread::get_id()), std::optional<std::string>("stop"));
  EXPECT_EQ(cuda.malloc(700), 1);
  EXPECT_EQ(cuda.recorded_block_bytes, 1024);  // recorded while a trace records
  refusal.arm(std::this_thread::get_id(), "stop");
  refusal.arm(std::this_thread::get_id(), "");
  EXPECT_FALSE(refusal.pending());
  EXPECT_EQ(cuda.malloc(700), 2);
  EXPECT_EQ(refusal.take(std::this_thread::get_id()), std::nullopt);
}

}  // namespace
}  // namespace gpucast

namespace gpucast {
namespace {

// A timer that starts with a given result and reports fixed spans.
class FakeTimer final : public DeviceTimer {
 public:
  FakeTimer(std::string name, TimerStart result, int* starts) : name_(std::move(name)), result_(result), starts_(starts) {}
  std::string name() const override { return name_; }
  TimerStart start() override {
    ++*starts_;
    return result_;
  }
  void op_begin(uint64_t) noexcept override {}
  void op_end(uint64_t) noexcept override {}
  std::vector<DeviceSpan> stop() override { return {{7, 100, 350}, {7, 400, 450}, {9, 0, 10}}; }

 private:
  std::string name_;
  TimerStart result_;
  int* starts_;
};

class TimerChoiceTest : public ::testing::Test {
 protected:
  std::unique_ptr<DeviceTimer> cupti(TimerStart r) { return std::make_unique<FakeTimer>("cupti", r, &cupti_starts); }
  std::unique_ptr<DeviceTimer> events(TimerStart r = {}) {
    return std::make_unique<FakeTimer>("cuda_events", r, &event_starts);
  }
  int cupti_starts = 0, event_starts = 0;
};

TEST_F(TimerChoiceTest, CuptiWhenItStarts) {
  TimerChoice c = choose_device_timer(true, false, cupti({}), events());
  EXPECT_EQ(c.source, "cupti");
  EXPECT_EQ(c.timer->name(), "cupti");
  EXPECT_TRUE(c.notes.empty());
  EXPECT_EQ(event_starts, 0);
}

TEST_F(TimerChoiceTest, AnotherSubscriberMeansCudaEvents) {
  TimerChoice c = choose_device_timer(
      true, false, cupti({TimerStart::Status::Busy, "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"}), events());
  EXPECT_EQ(c.source, "cuda_events");
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0].code, "cupti-busy");
  EXPECT_NE(c.notes[0].text.find("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"), std::string::npos);  // the why
}

TEST_F(TimerChoiceTest, TorchProfilerRunningLeavesCuptiAlone) {
  TimerChoice c = choose_device_timer(true, /*other_holder=*/true, cupti({}), events());
  EXPECT_EQ(cupti_starts, 0);
  EXPECT_EQ(c.source, "cuda_events");
  EXPECT_EQ(c.notes[0].code, "cupti-busy");
}

TEST_F(TimerChoiceTest, CuptiSetAsideAfterItAttributedNothingMeansCudaEvents) {
  TimerChoice c = choose_device_timer(true, false, cupti({}), events(),
                                      "CUPTI attributed no device work to ops in an earlier trace of this process");
  EXPECT_EQ(cupti_starts, 0);
  EXPECT_EQ(event_starts, 1);
  EXPECT_EQ(c.source, "cuda_events");
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0].code, "cupti-set-aside");
}

TEST_F(TimerChoiceTest, UnavailableCuptiFallsBackToEvents) {
  TimerChoice c = choose_device_timer(true, false, nullptr, events());
  EXPECT_EQ(c.source, "cuda_events");
  EXPECT_EQ(c.notes[0].code, "cupti-unavailable");
}

TEST_F(TimerChoiceTest, NoCudaMeansCpuClocksWithoutTouchingTimers) {
  TimerChoice c = choose_device_timer(false, false, cupti({}), events());
  EXPECT_EQ(c.source, "cpu_clock");
  EXPECT_EQ(c.timer, nullptr);
  EXPECT_EQ(cupti_starts + event_starts, 0);
}

TEST_F(TimerChoiceTest, NothingStartsMeansCpuClocksAndSaysWhy) {
  TimerChoice c = choose_device_timer(true, false, cupti({TimerStart::Status::Unavailable, "no driver"}),
                                      events({TimerStart::Status::Unavailable, "no CUDA device"}));
  EXPECT_EQ(c.source, "cpu_clock");
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0].code, "cupti-start-failed");
  EXPECT_EQ(c.timer, nullptr);
}

TEST_F(TimerChoiceTest, SpansAddUpPerOp) {
  auto by_op = device_time_by_op(events()->stop());
  EXPECT_EQ(by_op.at(7), 300);
  EXPECT_EQ(by_op.at(9), 10);
}

TEST(DeviceTimes, PerLaunchTimesAddUpTheOpTree) {
  // linear (0) > addmm (1) > a kernel; linear's backward node (2) > mm (3), mm (4); an untimed op (5) > a timed
  // one (6): what each op launched itself, then each op with the ops inside it.
  const std::vector<int32_t> parent = {-1, 0, -1, 2, 2, -1, 5};
  const std::vector<int64_t> own = {0, 500, 10, 200, 300, -1, 40};
  EXPECT_EQ(inclusive_device_times(parent, own), (std::vector<int64_t>{500, 500, 510, 200, 300, -1, 40}));
  EXPECT_TRUE(inclusive_device_times({}, {}).empty());
  // Only CUPTI's spans are per launch; CUDA events and the stand-in span the op with what runs inside it.
  EXPECT_FALSE(make_cpu_span_timer()->per_launch());
}

TEST(SparseTiming, NoChoiceTimesEveryLayer) {
  const TimedLayers all;
  EXPECT_TRUE(all.all());
  EXPECT_TRUE(all.layer_timed("Net.fc"));
  EXPECT_TRUE(TimedLayers(std::vector<std::string>{}).all());
  const TimedLayers some({"Net.fc", kOutsideModules});
  EXPECT_FALSE(some.all());
  EXPECT_TRUE(some.layer_timed("Net.fc"));
  EXPECT_TRUE(some.layer_timed("(outside modules)"));
  EXPECT_FALSE(some.layer_timed("Net.fc.0"));  // layers are exact module paths, not prefixes
  EXPECT_FALSE(some.layer_timed("Net"));
  EXPECT_EQ(some.layers(), (std::vector<std::string>{"Net.fc", "(outside modules)"}));
}

TEST(DeviceTimer, RecordBuffersAreBounded) {
  // CUPTI's record buffers: 3 of 8 bytes fit under 25; the fourth is refused (CUPTI drops its records) until one
  // is given back; refusals are counted for the trace's notes.
  BufferBudget budget(25);
  EXPECT_TRUE(budget.take(8));
  EXPECT_TRUE(budget.take(8));
  EXPECT_TRUE(budget.take(8));
  EXPECT_EQ(budget.held(), 24u);
  EXPECT_FALSE(budget.take(8));
  EXPECT_FALSE(budget.take(8));
  EXPECT_EQ(budget.refused(), 2u);
  EXPECT_EQ(budget.held(), 24u);
  budget.give(8);
  EXPECT_TRUE(budget.take(8));
  EXPECT_FALSE(budget.take(26));  // larger than the bound itself
  EXPECT_EQ(budget.refused(), 3u);
  budget.clear_refused();
  EXPECT_EQ(budget.refused(), 0u);
  for (int i = 0; i < 3; ++i) budget.give(8);
  EXPECT_EQ(budget.held(), 0u);
  budget.give(8);  // more than held: never below zero
  EXPECT_EQ(budget.held(), 0u);
}

TEST(SparseTiming, WhichOpsGetDeviceTimers) {
  using P = Phase;
  using S = Scope;
  // Everything, when no layers were chosen.
  EXPECT_TRUE(op_device_timed(true, false, P::Forward, S::Function, false, false));
  // Forward ops by their innermost module.
  EXPECT_TRUE(op_device_timed(false, false, P::Forward, S::Function, true, false));
  EXPECT_FALSE(op_device_timed(false, false, P::Forward, S::Function, false, false));
  // Inside a timed op (an addmm under a timed linear, a mm under a timed backward node).
  EXPECT_TRUE(op_device_timed(false, true, P::Forward, S::Function, false, false));
  EXPECT_TRUE(op_device_timed(false, true, P::Backward, S::Function, false, false));
  // Backward nodes by the forward op that made them, not by a module (backward runs outside module scopes).
  EXPECT_TRUE(op_device_timed(false, false, P::Backward, S::BackwardFunction, false, true));
  EXPECT_FALSE(op_device_timed(false, false, P::Backward, S::BackwardFunction, true, false));
  // A backward op outside any node (engine bookkeeping) is not a chosen layer's...
  EXPECT_FALSE(op_device_timed(false, false, P::Backward, S::Function, true, false));
  // ... unless it is the engine's work after a timed node, in the record around that node (a bias's gradient
  // reduced to its shape).
  EXPECT_TRUE(op_device_timed(false, false, P::Backward, S::Function, false, false, true));
  EXPECT_FALSE(op_device_timed(false, false, P::Forward, S::Function, false, false, true));
  // The optimizer step, always.
  EXPECT_TRUE(op_device_timed(false, false, P::Optimizer, S::UserScope, false, false));
  EXPECT_TRUE(op_device_timed(false, false, P::Optimizer, S::Function, false, false));
  // A user scope in forward (a record_function block) is not a layer.
  EXPECT_FALSE(op_device_timed(false, false, P::Forward, S::UserScope, true, false));
}

TEST(SparseTiming, SequenceMarksSetClearAndWrap) {
  auto marks = std::make_unique<SeqMarks>();  // 128 KiB: not on the stack
  EXPECT_FALSE(marks->marked(7));
  marks->mark(7, true);
  marks->mark(8, false);
  EXPECT_TRUE(marks->marked(7));
  EXPECT_FALSE(marks->marked(8));
  EXPECT_FALSE(marks->marked(6));
  // A later forward op with a number that shares the bit overwrites it either way.
  marks->mark(7 + SeqMarks::kBits, false);
  EXPECT_FALSE(marks->marked(7));
  marks->mark(8 + 3 * SeqMarks::kBits, true);
  EXPECT_TRUE(marks->marked(8));
  // No sequence number (-1): nothing marked, never timed by its mark.
  marks->mark(-1, true);
  EXPECT_FALSE(marks->marked(-1));
  EXPECT_FALSE(marks->marked(SeqMarks::kBits - 1));
}

}  // namespace
}  // namespace gpucast

namespace gpucast {
namespace {

// Iterations end at the last of the optimizer steps that no backward op separates.
TEST(IterationEnds, StepsBackToBackEndOneIterationAndABackwardPassBetweenThemTwo) {
  auto trace = [](std::initializer_list<std::pair<const char*, Phase>> ops) {
    Trace t;
    uint64_t seq = 1;
    for (auto [name, phase] : ops) {
      OpRecord o;
      o.id = static_cast<int64_t>(t.ops.size());
      o.name = name;
      const bool user = std::string(name).rfind("Optimizer.", 0) == 0 || std::string(name).rfind("gpucast.", 0) == 0;
      o.scope = user ? Scope::UserScope : phase == Phase::Backward ? Scope::BackwardFunction : Scope::Function;
      o.phase = phase;
      o.start_seq = seq++;
      o.end_seq = seq++;
      t.ops.push_back(o);
    }
    return t;
  };
  const auto F = Phase::Forward, B = Phase::Backward, O = Phase::Optimizer;
  // Two iterations, each: forward, backward, AdamW's step then SGD's (a zero_grad between them).
  const Trace two = trace({{"aten::linear", F}, {"AddmmBackward0", B}, {"Optimizer.step#AdamW.step", O},
                           {"Optimizer.zero_grad#SGD.zero_grad", O}, {"Optimizer.step#SGD.step", O},
                           {"aten::linear", F}, {"AddmmBackward0", B}, {"Optimizer.step#AdamW.step", O},
                           {"Optimizer.step#SGD.step", O}});
  EXPECT_EQ(iteration_ends(two), (std::vector<uint64_t>{10, 18}));
  // A GAN's turns: a backward pass before each optimizer's step.
  const Trace gan = trace({{"aten::linear", F}, {"AddmmBackward0", B}, {"Optimizer.step#Adam.step", O},
                           {"aten::linear", F}, {"AddmmBackward0", B}, {"Optimizer.step#Adam.step", O}});
  EXPECT_EQ(iteration_ends(gan), (std::vector<uint64_t>{6, 12}));
  EXPECT_EQ(iteration_ends(trace({{"aten::linear", F}, {"AddmmBackward0", B}})), std::vector<uint64_t>{});
  // A nested step (an optimizer stepping inside another's step) is not an iteration's end.
  Trace nested = trace({{"AddmmBackward0", B}, {"Optimizer.step#Lookahead.step", O}});
  OpRecord inner = nested.ops.back();
  inner.depth = 1;
  inner.name = "Optimizer.step#AdamW.step";
  nested.ops.push_back(inner);
  EXPECT_EQ(iteration_ends(nested), std::vector<uint64_t>{4});
  // gpucast.forecast's markers after each call of the step: the GAN's turns are one iteration.
  const Trace marked = trace({{"aten::linear", F}, {"AddmmBackward0", B}, {"Optimizer.step#Adam.step", O},
                              {"aten::linear", F}, {"AddmmBackward0", B}, {"Optimizer.step#Adam.step", O},
                              {"gpucast.iteration_end", F}, {"aten::linear", F}, {"gpucast.iteration_end", F}});
  EXPECT_EQ(iteration_ends(marked), (std::vector<uint64_t>{14, 18}));
}

}  // namespace
}  // namespace gpucast
