// Step-time forecast over hand-built traces: per-layer times, fits over probe batches, DDP buckets.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "gpucast/error.h"
#include "notes.h"
#include "user_error.h"
#include "gpucast/memory_timeline.h"
#include "gpucast/step_time.h"

namespace gpucast {
namespace {

using test_util::codes;
using test_util::count_code;

constexpr auto err = test_util::user_error;

// An op appended to t, linked to its enclosing op (parent), backward node (node) and forward op (fwd); its depth
// one more than its parent's. The caller sets its clocks.
OpRecord& push_op(Trace& t, const char* name, Scope scope, Phase phase, const char* module, int64_t parent,
                  int64_t node, int64_t fwd) {
  OpRecord o;
  o.id = static_cast<int64_t>(t.ops.size());
  o.name = name;
  o.scope = scope;
  o.phase = phase;
  o.module = module;
  o.parent = parent;
  o.bwd_node = node;
  o.fwd_op = fwd;
  o.depth = parent < 0 ? 0 : t.ops[static_cast<size_t>(parent)].depth + 1;
  t.ops.push_back(o);
  return t.ops.back();
}

// Two iterations; in each: forward ops in Net.a (k ns) and Net.b (2k ns), backward nodes for b then a (3k, 4k),
// a gradient of 600 KiB for each layer, then the optimizer step (500 ns). Times in ns, k scales with the batch.
Trace make_trace(int64_t k, int64_t out_bytes = 0) {
  Trace t;
  uint64_t seq = 1;
  int64_t now = 0;
  uint64_t last_output = 0;
  auto op = [&](const char* name, Scope scope, Phase phase, const char* module, int64_t dur, int64_t fwd = -1) {
    OpRecord& o = push_op(t, name, scope, phase, module, -1, -1, fwd);
    o.start_ns = now;
    o.end_ns = now + dur;
    o.start_seq = seq++;
    o.end_seq = seq++;
    if (out_bytes > 0 && phase == Phase::Forward && scope == Scope::Function) {
      Value v;
      v.kind = Value::Kind::Tensor;
      if (last_output != 0) {  // consumes the previous forward op's output
        Value in;
        in.kind = Value::Kind::Tensor;
        in.tensors.push_back(TensorMeta{{out_bytes / 4}, {1}, "float32", "cpu", last_output});
        o.inputs.push_back(in);
      }
      last_output = 1000 + static_cast<uint64_t>(o.id);
      v.tensors.push_back(TensorMeta{{out_bytes / 4}, {1}, "float32", "cpu", last_output});
      o.outputs.push_back(v);
    }
    now += dur + 10;  // 10 ns between ops: "other"
    return o.id;
  };
  for (int it = 0; it < 2; ++it) {
    const int64_t fa = op("aten::linear", Scope::Function, Phase::Forward, "Net.a", k);
    const int64_t fb = op("aten::linear", Scope::Function, Phase::Forward, "Net.b", 2 * k);
    const int64_t bb = op("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, "", 3 * k, fb);
    const int64_t ba = op("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, "", 4 * k, fa);
    for (int64_t node : {bb, ba}) {
      Allocation a;
      a.category = Category::Gradient;
      a.alloc_op = node;
      a.block_bytes = 600 << 10;
      t.allocations.push_back(a);
    }
    op("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer, "", 500);
  }
  return t;
}

TEST(StepTime, IterationTimingOfTheLastIteration) {
  const IterationTiming it = iteration_timing(make_trace(1000), 4);
  EXPECT_EQ(it.batch, 4);
  EXPECT_EQ(it.clock, "cpu");
  ASSERT_EQ(it.layers.size(), 2u);
  EXPECT_EQ(it.layers[0].layer, "Net.a");
  EXPECT_EQ(it.layers[0].forward_ns, 1000);
  EXPECT_EQ(it.layers[0].backward_ns, 4000);
  EXPECT_EQ(it.layers[0].backward_order, 1);
  EXPECT_EQ(it.layers[0].grad_bytes, 600 << 10);  // the last iteration's gradients only
  EXPECT_EQ(it.layers[1].layer, "Net.b");
  EXPECT_EQ(it.layers[1].backward_order, 0);
  EXPECT_EQ(it.optimizer_ns, 500);
  // Wall: 10 000 ns of layers + 500 optimizer + 4 gaps of 10 ns between the 5 ops.
  EXPECT_EQ(it.wall_ns, 10000 + 500 + 40);
  EXPECT_EQ(it.other_ns, 40);
}

TEST(StepTime, TheTracersCostComesOutByOpCount) {
  IterationTiming it = iteration_timing(make_trace(1000), 4);
  EXPECT_EQ(it.ops_total, 5);  // two forward ops, two backward nodes, the optimizer step
  EXPECT_EQ(it.optimizer_ops, 1);
  EXPECT_EQ(it.other_ops, 0);
  EXPECT_EQ(it.layers[0].forward_ops_all, 1);
  EXPECT_EQ(it.layers[1].backward_ops_all, 1);
  it.untraced_wall_ns = it.wall_ns - 500;  // 100 ns per recorded op
  StepTimeOptions o;
  o.batch_size = 4;
  const StepTimeForecast f = forecast_step_time({it}, o);
  EXPECT_NEAR(f.forward_ms, (900 + 1900) / 1e6, 1e-12);
  EXPECT_NEAR(f.backward_ms, (3900 + 2900) / 1e6, 1e-12);
  EXPECT_NEAR(f.optimizer_ms, 400 / 1e6, 1e-15);
  EXPECT_NEAR(f.other_ms, 40 / 1e6, 1e-15);
  const IterationTiming back = iteration_timing_from_json(iteration_timing_to_json(it));
  EXPECT_EQ(back.untraced_wall_ns, it.untraced_wall_ns);
  EXPECT_EQ(back.layers[0].forward_ops_all, 1);
}

TEST(StepTime, LaunchingOpsAreTheOutermostOpsThatDoWork) {
  // aten::linear runs aten::t (a view) and aten::addmm, which on the CPU runs aten::copy_ (the bias): one launch.
  // aten::view launches nothing; aten::contiguous (a view op) running aten::clone: the clone launches. The
  // optimizer's ops are left out (a GPU runs them as multi-tensor kernels).
  Trace t;
  uint64_t seq = 1;
  auto op = [&](const char* name, int64_t parent, Scope scope = Scope::Function, Phase phase = Phase::Forward) {
    OpRecord o;
    o.id = static_cast<int64_t>(t.ops.size());
    o.name = name;
    o.scope = scope;
    o.phase = phase;
    o.parent = parent;
    o.depth = parent < 0 ? 0 : t.ops[static_cast<size_t>(parent)].depth + 1;
    o.module = "Net.a";
    o.start_seq = seq++;
    t.ops.push_back(o);
    return o.id;
  };
  auto end = [&](int64_t i) { t.ops[static_cast<size_t>(i)].end_seq = seq++; };
  const int64_t linear = op("aten::linear", -1);
  end(op("aten::t", linear));
  const int64_t addmm = op("aten::addmm", linear);
  end(op("aten::copy_", addmm));
  end(addmm);
  end(linear);
  end(op("aten::view", -1));
  const int64_t contiguous = op("aten::contiguous", -1);
  end(op("aten::clone", contiguous));
  end(contiguous);
  const int64_t step = op("Optimizer.step#SGD.step", -1, Scope::UserScope, Phase::Optimizer);
  end(op("aten::add_", step, Scope::Function, Phase::Optimizer));
  end(step);
  IterationTiming it = iteration_timing(t, 2);
  EXPECT_EQ(it.launch_ops, 2);
  EXPECT_EQ(iteration_timing_from_json(iteration_timing_to_json(it)).launch_ops, 2);
  // Light traces (nested ops counted, not recorded) cannot tell.
  t.ops[static_cast<size_t>(linear)].nested = 2;
  EXPECT_EQ(iteration_timing(t, 2).launch_ops, -1);
  EXPECT_EQ(iteration_timing_from_json("{\"batch\": 2, \"wall_ns\": 0, \"optimizer_ns\": 0, \"other_ns\": 0, "
                                       "\"clock\": \"cpu\", \"layers\": []}").launch_ops, -1);
  // A timing trace takes the count of the full trace whose structure it borrows.
  IterationTiming light = iteration_timing(t, 2);
  t.ops[static_cast<size_t>(linear)].nested = 0;
  EXPECT_EQ(with_structure(light, iteration_timing(t, 2)).launch_ops, 2);
}

TEST(StepTime, FitsScaleLayersToTheTargetBatch) {
  // Layer times a + c b with a = 0: k = 250 b.
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) probes.push_back(iteration_timing(make_trace(250 * b), b));
  StepTimeOptions o;
  o.batch_size = 32;
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_EQ(f.per_rank_batch, 32);
  EXPECT_NEAR(f.forward_ms, 3 * 250 * 32 / 1e6, 1e-12);
  EXPECT_NEAR(f.backward_ms, 7 * 250 * 32 / 1e6, 1e-12);
  EXPECT_NEAR(f.optimizer_ms, 500 / 1e6, 1e-15);
  EXPECT_NEAR(f.other_ms, 40 / 1e6, 1e-15);
  EXPECT_NEAR(f.step_ms, f.compute_ms, 0);
  EXPECT_EQ(f.exposed_comm_ms, 0);
  ASSERT_EQ(f.per_layer.size(), 2u);
  EXPECT_NEAR(f.per_layer[1].backward_ms, 3 * 250 * 32 / 1e6, 1e-12);
}

TEST(StepTime, TheOptimizersTimeIsTheProbesNearestTheTarget) {
  // On a CPU the optimizer step slows after a larger backward (less of its data left in the caches): 500, 600 and
  // 800 ns at batch 2, 4 and 8. Not fitted over the batch (its work does not grow with it): the nearest probe's.
  std::vector<IterationTiming> probes;
  for (auto [b, ns] : {std::pair<int64_t, double>{2, 500}, {4, 600}, {8, 800}}) {
    probes.push_back(iteration_timing(make_trace(250 * b), b));
    probes.back().optimizer_ns = ns;
    probes.back().wall_ns += ns - 500;
  }
  StepTimeOptions o;
  for (auto [batch, ns] : {std::pair<int64_t, double>{32, 800}, {8, 800}, {6, 800}, {5, 600}, {3, 600}, {2, 500},
                           {1, 500}}) {
    o.batch_size = batch;
    EXPECT_NEAR(forecast_step_time(probes, o).optimizer_ms, ns / 1e6, 1e-15) << "batch " << batch;
  }
  std::reverse(probes.begin(), probes.end());  // whatever their order
  o.batch_size = 3;
  EXPECT_NEAR(forecast_step_time(probes, o).optimizer_ms, 600 / 1e6, 1e-15);
}

TEST(StepTime, DeviceClocksBoundTheStepByTheHostOrByTheKernels) {
  // Kernel times 2500 b ns over the layers and 500 ns for the optimizer; the host takes 50 us per step untraced
  // (80 us traced) at every probe batch: the probes are host-bound. At batch 16 the kernels take 40.5 us and the
  // step stays the host's 50 us; at batch 64 they take 160.5 us and the step is theirs.
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) {
    IterationTiming p = iteration_timing(make_trace(250 * b), b);
    p.clock = "device";
    p.wall_ns = 80000;
    p.untraced_wall_ns = 50000;
    probes.push_back(p);
  }
  StepTimeOptions o;
  o.batch_size = 16;
  StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_EQ(f.clock, "device");
  EXPECT_NEAR(f.forward_ms + f.backward_ms, 40000 / 1e6, 1e-12);  // the tracer's cost stays out of the kernels
  EXPECT_NEAR(f.optimizer_ms, 500 / 1e6, 1e-15);
  EXPECT_NEAR(f.other_ms, 9500 / 1e6, 1e-12);
  EXPECT_NEAR(f.step_ms, 50000 / 1e6, 1e-12);
  EXPECT_EQ(f.notes.back().code, "host-bound");  // the host's 0.050 ms against the kernels' 0.041 ms
  EXPECT_NEAR(f.host_ms, 50000 / 1e6, 1e-12);
  o.batch_size = 64;
  f = forecast_step_time(probes, o);
  EXPECT_NEAR(f.other_ms, 0, 0);
  EXPECT_NEAR(f.step_ms, 160500 / 1e6, 1e-12);
  EXPECT_NEAR(f.host_ms, 50000 / 1e6, 1e-12);
}

TEST(StepTime, DeviceClocksOfDeviceBoundProbesKeepTheFittedRest) {
  // Walls that grow with the batch (the kernels plus 40 ns between ops, traced; untraced 1 % less): the host does
  // not show, and the rest of the step is the fit over the probes, as with CPU clocks. At batch 1, below the
  // probes, the step is not bound by the largest probe's wall.
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) {
    IterationTiming p = iteration_timing(make_trace(250 * b), b);
    p.clock = "device";
    p.untraced_wall_ns = p.wall_ns * 0.99;
    probes.push_back(p);
  }
  StepTimeOptions o;
  o.batch_size = 1;
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_EQ(f.host_ms, -1);
  EXPECT_EQ(count_code(f.notes, "host-bound") + count_code(f.notes, "device-bound"), 0);
  EXPECT_NEAR(f.forward_ms + f.backward_ms, 2500 / 1e6, 1e-12);
  EXPECT_LT(f.step_ms, probes.front().wall_ns / 1e6);
}

TEST(StepTime, LayersThatRanOtherKernelsInSmallProbesAreFittedOnTheLargeOnes) {
  // Net.a runs another kernel at batch 2 and 4 (three recorded ops in its forward instead of one, 10x slower);
  // from batch 8 on its time is 250 b like Net.b's.
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8, 16}) {
    IterationTiming p = iteration_timing(make_trace(250 * b), b);
    if (b < 8) {
      p.layers[0].forward_ops_all = 3;
      p.layers[0].forward_ns *= 10;
      p.im2col_conv_ops = 2;
    }
    probes.push_back(p);
  }
  StepTimeOptions o;
  o.batch_size = 32;
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_NEAR(f.per_layer[0].forward_ms, 250 * 32 / 1e6, 1e-12);  // from batch 8 and 16 only
  EXPECT_NEAR(f.per_layer[1].forward_ms, 2 * 250 * 32 / 1e6, 1e-12);
  EXPECT_EQ(codes(f.notes), std::vector<std::string>{"kernel-switch"});
  EXPECT_EQ(iteration_timing_from_json(iteration_timing_to_json(probes[0])).im2col_conv_ops, 2);
  // One matching probe: its time in proportion to the batch.
  probes.pop_back();
  probes[2].layers[0].forward_ns = 250 * 8;
  const StepTimeForecast g = forecast_step_time(probes, o);
  EXPECT_NEAR(g.per_layer[0].forward_ms, 250 * 32 / 1e6, 1e-12);
  // Sparse timing says the same.
  o.time_fraction = 0.5;
  const StepTimeForecast s = forecast_step_time(probes, o);
  EXPECT_EQ(s.timed_layers, 1);
  EXPECT_EQ(s.notes[0].code, "kernel-switch");
}

TEST(StepTime, IterationTimingCountsIm2colConvolutions) {
  Trace t = make_trace(1000);
  OpRecord conv = t.ops[t.ops.size() - 5];  // the last iteration's first forward op
  conv.id = static_cast<int64_t>(t.ops.size());
  conv.name = "aten::thnn_conv2d";
  conv.parent = conv.id - 5;
  conv.start_seq = t.ops[static_cast<size_t>(conv.parent)].start_seq;
  conv.end_seq = conv.start_seq;
  t.ops.push_back(conv);
  EXPECT_EQ(iteration_timing(t, 4).im2col_conv_ops, 1);
  EXPECT_EQ(iteration_timing(make_trace(1000), 4).im2col_conv_ops, 0);
}

// Probes at batch 2, 4 and 8 of make_trace with k = 250 us per sample (k = 2 ms at 8).
std::vector<IterationTiming> linear_probes() {
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) probes.push_back(iteration_timing(make_trace(250000 * b), b));
  return probes;
}

TEST(StepTime, DdpBucketsOverlapBackward) {
  std::vector<IterationTiming> probes = linear_probes();
  StepTimeOptions o;
  o.batch_size = 16;  // 8 per rank: k = 2 ms
  o.parallel.dp = 2;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");  // 10 us per step, 1000 B/us
  const StepTimeForecast f = forecast_step_time(probes, o);
  // Backward order: Net.b (6 ms) then Net.a (8 ms). Each layer's 600 KiB fills no 1 MiB bucket alone: one bucket of
  // 1200 KiB ready when Net.a's backward ends.
  ASSERT_EQ(f.buckets.size(), 1u);
  EXPECT_EQ(f.buckets[0].bytes, 1200 << 10);
  const double other = 40 / 1e6, fwd = 6.0, bwd_end = other + fwd + 14.0;
  EXPECT_NEAR(f.buckets[0].ready_ms, bwd_end, 1e-9);
  const double ar_ms = allreduce_us(1200 << 10, 2, o.topology.intra) / 1e3;  // 2(N-1)/N S/B + 2(N-1) alpha
  EXPECT_NEAR(ar_ms, (1228800.0 / 1000.0 + 20.0) / 1e3, 1e-12);
  EXPECT_NEAR(f.comm_ms, ar_ms, 1e-12);
  EXPECT_NEAR(f.exposed_comm_ms, ar_ms, 1e-9);
  EXPECT_NEAR(f.step_ms, f.compute_ms + ar_ms, 1e-9);
  // The group sat idle since the previous step's reduction: this step's forward, backward and optimizer step.
  EXPECT_NEAR(f.buckets[0].idle_ms, bwd_end + f.optimizer_ms, 1e-9);
  // With a 500 KiB first bucket, Net.b's gradients go alone, hidden behind Net.a's backward: two buckets.
  o.first_bucket_bytes = 500 << 10;
  const StepTimeForecast g = forecast_step_time(probes, o);
  ASSERT_EQ(g.buckets.size(), 2u);
  EXPECT_NEAR(g.buckets[0].ready_ms, other + fwd + 6.0, 1e-9);
  EXPECT_NEAR(g.exposed_comm_ms, allreduce_us(600 << 10, 2, o.topology.intra) / 1e3, 1e-9);
  EXPECT_NEAR(g.buckets[0].idle_ms, other + fwd + 6.0 + g.optimizer_ms, 1e-9);
  EXPECT_NEAR(g.buckets[1].idle_ms, 8.0, 1e-9);  // Net.a's backward since the first bucket was ready
  // DDP's bucket_cap_mb sizes every bucket, the first too: 0.5 MiB puts each layer's 600 KiB in a bucket of its
  // own, 2 MiB both in one.
  o.first_bucket_bytes = int64_t{1} << 20;
  o.parallel = ParallelConfig::parse("dp:2,bucket_cap_mb:0.5");
  EXPECT_EQ(o.parallel.bucket_bytes, 524288);
  EXPECT_EQ(forecast_step_time(probes, o).buckets.size(), 2u);
  o.parallel = ParallelConfig::parse("dp:2,bucket_cap_mb:2");
  EXPECT_EQ(forecast_step_time(probes, o).buckets.size(), 1u);
  o.parallel = ParallelConfig::parse("dp:2");
  EXPECT_EQ(forecast_step_time(probes, o).buckets.size(), 1u);  // 1 MiB first: 1.2 MiB fill it at once
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("bucket_cap_mb:0"); }),
            "parallel: option 'bucket_cap_mb' expects a positive number of MiB, got '0'");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("bucket_cap_mb:25MB"); }),
            "parallel: option 'bucket_cap_mb' expects a positive number of MiB, got '25MB'");
  // FSDP's units: module paths joined by '|', for dp_mode fsdp only.
  EXPECT_EQ(ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:GPT.blocks.0|GPT.blocks.1").fsdp_units,
            (std::vector<std::string>{"GPT.blocks.0", "GPT.blocks.1"}));
  EXPECT_TRUE(ParallelConfig::parse("dp:2,dp_mode:fsdp").fsdp_units.empty());
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:GPT.blocks.0||GPT.head"); }),
            "parallel: option 'fsdp_units' expects module paths separated by '|', got an empty one in "
            "'GPT.blocks.0||GPT.head'");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:2,fsdp_units:GPT.blocks.0"); }),
            "parallel: option 'fsdp_units' applies to dp_mode 'fsdp', got dp_mode 'ddp'");
  // FSDP2's reshard_after_forward: True (1), False (0), or a number of ranks dividing dp (1 and dp mean False and
  // True, as in fully_shard).
  EXPECT_EQ(ParallelConfig::parse("dp:4,dp_mode:fsdp").reshard_after_forward, -1);  // not given: the default
  EXPECT_EQ(ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:True").reshard_after_forward, 1);
  EXPECT_EQ(ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:False").reshard_after_forward, 0);
  EXPECT_EQ(ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:2").reshard_after_forward, 2);
  EXPECT_EQ(ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:1").reshard_after_forward, 0);
  EXPECT_EQ(ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:4").reshard_after_forward, 1);
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:3"); }),
            "parallel: option 'reshard_after_forward' expects True, False or a number of ranks that divides dp (4), "
            "got '3'");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:4,dp_mode:fsdp,reshard_after_forward:yes"); }),
            "parallel: option 'reshard_after_forward' expects True, False or a number of ranks that divides dp (4), "
            "got 'yes'");
  // MixedPrecisionPolicy's dtypes: bytes per element, torch's names accepted.
  const ParallelConfig mp = ParallelConfig::parse("dp:2,dp_mode:fsdp,param_dtype:torch.bfloat16,reduce_dtype:float32");
  EXPECT_EQ(mp.param_dtype_bytes, 2);
  EXPECT_EQ(mp.reduce_dtype_bytes, 4);
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:2,dp_mode:fsdp,param_dtype:int8"); }),
            "parallel: option 'param_dtype' expects bfloat16, float16 or float32, got 'int8'");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:2,param_dtype:bfloat16"); }),
            "parallel: option 'param_dtype' applies to dp_mode 'fsdp', got dp_mode 'ddp'");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:4,reshard_after_forward:2"); }),
            "parallel: option 'reshard_after_forward' applies to dp_mode 'fsdp', got dp_mode 'ddp'");
}

TEST(StepTime, DdpReductionsAfterALongIdleSpellTakeTheLateSamples) {
  std::vector<IterationTiming> probes = linear_probes();
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel.dp = 2;
  o.first_bucket_bytes = 500 << 10;  // two buckets of 600 KiB: idle 6 ms + forward + the optimizer, then 8 ms
  const std::string samples = "alpha_us:10,bytes_per_us:1000,samples:614400/700;1228800/1300,ranks:2";
  o.topology = Topology::parse(samples);
  const StepTimeForecast plain = forecast_step_time(probes, o);
  ASSERT_EQ(plain.buckets.size(), 2u);
  EXPECT_NEAR(plain.comm_ms, 1.4, 1e-12);  // 700 us each
  // Measured after 4 ms and 12 ms of compute: the first (12 ms idle and a little more) takes the late sample, the
  // second (8 ms) lies log(8/4) / log(12/4) of the way in log(spell).
  o.topology = Topology::parse(samples + ",samples_gap_us:4000,late_samples:614400/1100,late_gap_us:12000");
  const StepTimeForecast late = forecast_step_time(probes, o);
  ASSERT_EQ(late.buckets.size(), 2u);
  ASSERT_GE(late.buckets[0].idle_ms, 12.0);
  EXPECT_NEAR(late.buckets[0].end_ms - late.buckets[0].start_ms, 1.1, 1e-12);
  const double second = 0.7 + 0.4 * std::log(2.0) / std::log(3.0);
  EXPECT_NEAR(late.buckets[1].end_ms - late.buckets[1].start_ms, second, 1e-12);
  EXPECT_NEAR(late.comm_ms, 1.1 + second, 1e-12);
}

TEST(StepTime, DdpBroadcastsTheBuffersBeforeTheForward) {
  std::vector<IterationTiming> probes = linear_probes();
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel = ParallelConfig::parse("dp:2,buffer_bytes:4096");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast f = forecast_step_time(probes, o);
  // A pipelined broadcast of 4096 B over 2 ranks: the message once over the link and one latency step.
  const double bc = (4096.0 / 1000.0 + 10.0) / 1e3;
  EXPECT_NEAR(broadcast_us(4096, 2, o.topology.intra) / 1e3, bc, 1e-12);
  ASSERT_EQ(f.comm.size(), 2u);
  EXPECT_EQ(f.comm[0].kind, "dp_broadcast_buffers");
  EXPECT_EQ(f.comm[0].bytes, 4096);
  EXPECT_NEAR(f.comm[0].start_ms, 0.0, 1e-12);
  EXPECT_NEAR(f.comm[0].end_ms, bc, 1e-12);
  // Everything after it starts that much later: the bucket, its all-reduce, the step.
  const double ar = allreduce_us(1200 << 10, 2, o.topology.intra) / 1e3;
  ASSERT_EQ(f.buckets.size(), 1u);
  EXPECT_NEAR(f.buckets[0].ready_ms, bc + 40 / 1e6 + 6.0 + 14.0, 1e-9);
  EXPECT_NEAR(f.exposed_comm_ms, bc + ar, 1e-9);
  EXPECT_NEAR(f.step_ms, f.compute_ms + bc + ar, 1e-9);
  EXPECT_NEAR(f.buckets[0].idle_ms, f.buckets[0].ready_ms - bc, 1e-9);  // since the broadcast
  // Not with broadcast_buffers=False, nor under FSDP (buffers are synced once, at wrapping), nor on one rank.
  for (const char* text : {"dp:2,buffer_bytes:4096,broadcast_buffers:False", "dp:2,buffer_bytes:4096,dp_mode:fsdp"}) {
    o.parallel = ParallelConfig::parse(text);
    for (const CommForecast& c : forecast_step_time(probes, o).comm) EXPECT_NE(c.kind, "dp_broadcast_buffers") << text;
  }
  o.parallel = ParallelConfig::parse("buffer_bytes:4096");
  o.batch_size = 8;
  EXPECT_TRUE(forecast_step_time(probes, o).comm.empty());
  // Gradient accumulation: once per step, before the first micro-batch.
  o.parallel = ParallelConfig::parse("dp:2,buffer_bytes:4096,micro_batches:2");
  o.batch_size = 32;
  int broadcasts = 0;
  for (const CommForecast& c : forecast_step_time(probes, o).comm) broadcasts += c.kind == "dp_broadcast_buffers";
  EXPECT_EQ(broadcasts, 1);
  // buffer_bytes is a byte count (0: none, as by default).
  EXPECT_EQ(ParallelConfig::parse("dp:2,buffer_bytes:0").buffer_bytes, 0);
  EXPECT_EQ(err([] { ParallelConfig::parse("dp:2,buffer_bytes:-1"); }),
            "parallel: option 'buffer_bytes' expects a non-negative integer, got '-1'");
}

TEST(StepTime, DdpOverheadOutsideBackwardOncePerStep) {
  std::vector<IterationTiming> probes = linear_probes();
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel.dp = 2;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast plain = forecast_step_time(probes, o);
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,ddp_overhead_us:600");
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_NEAR(f.other_ms, plain.other_ms + 0.6, 1e-12);
  EXPECT_NEAR(f.step_ms, plain.step_ms + 0.6, 1e-9);
  EXPECT_EQ(f.notes.back().code, "ddp-overhead");
  // Once per step with gradient accumulation; not under FSDP; not on one rank.
  o.parallel = ParallelConfig::parse("dp:2,micro_batches:2");
  o.batch_size = 32;
  const double with = forecast_step_time(probes, o).step_ms;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  EXPECT_NEAR(with, forecast_step_time(probes, o).step_ms + 0.6, 1e-9);
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,ddp_overhead_us:600");
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp");
  o.batch_size = 16;
  EXPECT_NEAR(forecast_step_time(probes, o).other_ms, plain.other_ms, 1e-12);
  o.parallel = ParallelConfig::parse("dp:1");
  o.batch_size = 8;
  EXPECT_NEAR(forecast_step_time(probes, o).other_ms, 40 / 1e6, 1e-12);
  EXPECT_EQ(test_util::user_error([] { Topology::parse("ddp_overhead_us:-1"); }),
            "link: 'ddp_overhead_us' should be a non-negative number, got '-1'");
}

TEST(StepTime, DdpOverheadByTheRanksGradientBytes) {
  // Samples by gradient bytes per rank: linear between them, the nearest outside them; they replace
  // ddp_overhead_us where given.
  const Topology t = Topology::parse("ddp_overhead_us:50,ddp_overhead_samples:3000/500;1000/100");
  ASSERT_EQ(t.ddp_overhead_samples.size(), 2u);
  EXPECT_EQ(t.ddp_overhead_samples.front().bytes, 1000);  // sorted by bytes
  EXPECT_EQ(t.ddp_overhead_for(10), 100);
  EXPECT_EQ(t.ddp_overhead_for(1000), 100);
  EXPECT_EQ(t.ddp_overhead_for(1500), 200);
  EXPECT_EQ(t.ddp_overhead_for(2500), 400);
  EXPECT_EQ(t.ddp_overhead_for(1e9), 500);
  EXPECT_EQ(Topology::parse("ddp_overhead_us:50").ddp_overhead_for(1e9), 50);
  EXPECT_EQ(Topology::parse("ddp_overhead_samples:1000/0").ddp_overhead_for(5), 0);  // none measured
  // In the step: the probes' gradient bytes, halfway between two samples 100 bytes either side.
  std::vector<IterationTiming> probes = linear_probes();
  int64_t grad = 0;
  for (const LayerTiming& l : probes.back().layers) grad += l.grad_bytes;
  ASSERT_GT(grad, 0);
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel.dp = 2;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast plain = forecast_step_time(probes, o);
  o.topology = Topology::parse(fmt::format("alpha_us:10,bytes_per_us:1000,ddp_overhead_us:9999,ddp_overhead_samples:"
                                           "{}/200;{}/600", grad - 100, grad + 100));
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_NEAR(f.other_ms, plain.other_ms + 0.4, 1e-12);
  EXPECT_EQ(f.notes.back().code, "ddp-overhead");
  // Under FSDP none (its own collectives are modelled); on one rank none.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp");
  EXPECT_NEAR(forecast_step_time(probes, o).other_ms, plain.other_ms, 1e-12);
  // Bad pairs name the key and the item.
  EXPECT_EQ(test_util::user_error([] { Topology::parse("ddp_overhead_samples:1000/-5"); }),
            "link: 'ddp_overhead_samples' should be BYTES/MICROSECONDS pairs joined by ';' (positive bytes, "
            "non-negative microseconds), got '1000/-5' in '1000/-5'");
  EXPECT_EQ(test_util::user_error([] { Topology::parse("ddp_overhead_samples:0/5"); }),
            "link: 'ddp_overhead_samples' should be BYTES/MICROSECONDS pairs joined by ';' (positive bytes, "
            "non-negative microseconds), got '0/5' in '0/5'");
}

TEST(StepTime, RanksSharingAHostContendAndMayNotOverlap) {
  std::vector<IterationTiming> probes = linear_probes();
  for (IterationTiming& p : probes) {
    p.layers[0].flops = 0, p.layers[0].bytes = 100;   // Net.a memory-bound
    p.layers[1].flops = 400, p.layers[1].bytes = 100;  // Net.b: half and half at 4 FLOP per byte
  }
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel.dp = 2;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,memory_contention:1.5,compute_contention:1.1,balance:4");
  const StepTimeForecast f = forecast_step_time(probes, o);
  // k = 2 ms at 8 per rank: Net.a 2 + 8 ms at x1.5; Net.b 4 + 6 ms at x1.3; the optimizer x1.5, the rest x1.1.
  EXPECT_NEAR(f.per_layer[0].forward_ms, 2.0 * 1.5, 1e-9);
  EXPECT_NEAR(f.per_layer[1].backward_ms, 6.0 * 1.3, 1e-9);
  EXPECT_NEAR(f.optimizer_ms, 500 / 1e6 * 1.5, 1e-12);
  EXPECT_NEAR(f.other_ms, 40 / 1e6 * 1.1, 1e-12);
  EXPECT_EQ(f.notes[0].code, "host-contention");
  {
    // By working set: Net.a's 100 bytes at the reference batch 8 are 200 at 16 per rank: x1.0 below 256 bytes;
    // Net.b's memory-bound half too. The optimizer's bytes (none recorded here): memory_contention.
    StepTimeOptions s = o;
    s.batch_size = 32;
    s.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,memory_contention:1.5,compute_contention:1.1,"
                                 "balance:4,memory_contention_samples:256/1;4096/1.5");
    const StepTimeForecast g = forecast_step_time(probes, s);
    EXPECT_NEAR(g.per_layer[0].forward_ms, 4.0, 1e-9);             // k = 4 ms at 16 per rank
    EXPECT_NEAR(g.per_layer[1].backward_ms, 12.0 * 1.05, 1e-9);    // half x1.0, half x1.1
    EXPECT_NEAR(g.optimizer_ms, 500 / 1e6 * 1.5, 1e-12);
    EXPECT_EQ(g.notes[0].code, "host-contention");
    // At 128 per rank the 100 bytes are 1600: x(1 + 0.5 * log(1600/256) / log(16)).
    s.batch_size = 256;
    const double x = 1.0 + 0.5 * std::log(1600.0 / 256.0) / std::log(16.0);
    EXPECT_NEAR(forecast_step_time(probes, s).per_layer[0].forward_ms, 32.0 * x, 1e-9);
  }
  // One process: nothing to contend with.
  o.parallel.dp = 1;
  o.batch_size = 8;
  EXPECT_NEAR(forecast_step_time(probes, o).per_layer[0].forward_ms, 2.0, 1e-9);
  // Without overlap, with a 500 KiB first bucket: both buckets run after backward, one after the other.
  o.parallel.dp = 2;
  o.batch_size = 16;
  o.first_bucket_bytes = 500 << 10;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,overlap:False");
  const StepTimeForecast g = forecast_step_time(probes, o);
  ASSERT_EQ(g.buckets.size(), 2u);
  const double ar = allreduce_us(600 << 10, 2, o.topology.intra) / 1e3;
  const double bwd_end = 40 / 1e6 + 6.0 + 14.0;
  EXPECT_NEAR(g.buckets[0].start_ms, bwd_end, 1e-9);
  EXPECT_NEAR(g.buckets[1].start_ms, bwd_end + ar, 1e-9);
  EXPECT_NEAR(g.exposed_comm_ms, 2 * ar, 1e-9);
  EXPECT_NEAR(g.step_ms, g.compute_ms + 2 * ar, 1e-9);
  EXPECT_EQ(g.notes[0].code, "no-overlap");
  // Ranks that drift apart: the first reduction waits 1.5 ms for the last one; the second follows it at once.
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,overlap:False,sync_wait_us:1500");
  const StepTimeForecast w = forecast_step_time(probes, o);
  ASSERT_EQ(w.buckets.size(), 2u);
  EXPECT_NEAR(w.buckets[0].start_ms, bwd_end + 1.5, 1e-9);
  EXPECT_NEAR(w.buckets[1].start_ms, bwd_end + 1.5 + ar, 1e-9);
  EXPECT_NEAR(w.exposed_comm_ms, 1.5 + 2 * ar, 1e-9);
  EXPECT_NEAR(w.step_ms, g.step_ms + 1.5, 1e-9);
  EXPECT_EQ(codes(w.notes), (std::vector<std::string>{"no-overlap", "sync-wait"}));
  // Drift rates instead: the lag grows with the compute since the ranks last met (the previous step's reduction),
  // 2 % of compute-bound and 10 % of memory-bound time. Net.a is memory-bound (10 %); Net.b half and half (6 %);
  // the optimizer memory-bound, the rest compute-bound.
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,overlap:False,sync_wait_us:1500,balance:4,"
                               "drift_compute:0.02,drift_memory:0.1");
  const StepTimeForecast d = forecast_step_time(probes, o);
  ASSERT_EQ(d.buckets.size(), 2u);
  const double a = d.per_layer[0].forward_ms + d.per_layer[0].backward_ms;
  const double b = d.per_layer[1].forward_ms + d.per_layer[1].backward_ms;
  const double rate = (a * 0.1 + b * 0.06 + d.optimizer_ms * 0.1 + d.other_ms * 0.02) /
                      (a + b + d.optimizer_ms + d.other_ms);
  EXPECT_NEAR(d.buckets[0].idle_ms, d.buckets[0].ready_ms + d.optimizer_ms, 1e-9);
  EXPECT_NEAR(d.buckets[0].start_ms, bwd_end + rate * d.buckets[0].idle_ms, 1e-9);
  EXPECT_NEAR(d.buckets[1].start_ms, d.buckets[0].end_ms, 1e-9);
  EXPECT_NEAR(d.step_ms, g.step_ms + rate * d.buckets[0].idle_ms, 1e-9);
  EXPECT_EQ(codes(d.notes), (std::vector<std::string>{"no-overlap", "rank-drift"}));  // drift rates, not the wait
  // With the buffers' broadcast at the forward's start, the ranks meet there: it waits for the drift over the
  // optimizer step, and the first bucket for the drift since the broadcast.
  o.parallel = ParallelConfig::parse("dp:2,buffer_bytes:4096");
  o.first_bucket_bytes = 500 << 10;
  const StepTimeForecast e = forecast_step_time(probes, o);
  ASSERT_EQ(e.comm.size(), 3u);
  EXPECT_EQ(e.comm[0].kind, "dp_broadcast_buffers");
  EXPECT_NEAR(e.comm[0].start_ms, e.optimizer_ms * 0.1, 1e-12);
  const double since = e.buckets[0].ready_ms - e.comm[0].end_ms;
  EXPECT_NEAR(e.buckets[0].idle_ms, since, 1e-9);
  EXPECT_NEAR(e.buckets[0].start_ms, e.comm[0].end_ms + e.other_ms + 20.0 + rate * since, 1e-9);
  EXPECT_EQ(test_util::user_error([] { Topology::parse("drift_memory:-0.1"); }),
            "link: 'drift_memory' should be a non-negative number, got '-0.1'");
}

TEST(StepTime, BadOptions) {
  std::vector<IterationTiming> probes = {iteration_timing(make_trace(1000), 2)};
  StepTimeOptions o;
  o.batch_size = 8;
  o.parallel.dp = 0;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "parallel: 'dp' should be an integer of at least 1, got 0");
  o.parallel.dp = 2;
  o.parallel.tp = -1;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "parallel: 'tp' should be an integer of at least 1, got -1");
  o.parallel.tp = 1;
  o.parallel.dp_mode = "zero9";
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "parallel: 'dp_mode' should be one of ddp|zero1|zero2|fsdp, got 'zero9'");
  o.parallel.dp_mode = "ddp";
  o.batch_size = 1;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "step time: batch_size 1 is smaller than dp x micro_batches = 2: every rank needs a sample in every "
            "micro-batch");
  EXPECT_EQ(err([&] { forecast_step_time({}, o); }), "step time: no probe iterations to forecast from");
  o.batch_size = 8;
  o.parallel.pp = 3;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "parallel: 'pp' 3 is more than the 2 layers the probes found: every stage needs a layer");
  o.parallel.pp = 1;
  o.time_scale = 0;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "step time: time_scale should be in (0, 10], got 0");
  o.time_scale = 0.5;  // every compute time halves
  o.parallel.dp = 1;
  const StepTimeForecast half = forecast_step_time(probes, o);
  o.time_scale = 1.0;
  EXPECT_NEAR(half.step_ms, forecast_step_time(probes, o).step_ms / 2, 1e-12);
  o.parallel.dp = 2;
  o.batch_size = 9;
  const StepTimeForecast f = forecast_step_time(probes, o);  // no link: compute only, said in a note
  EXPECT_EQ(codes(f.notes), (std::vector<std::string>{"batch-not-divisible", "no-link"}));
  EXPECT_EQ(f.per_rank_batch, 4);
  EXPECT_EQ(f.comm_ms, 0);
}

// Probes at 2, 4, 8 with k = 250 000 b ns: at a per-rank micro-batch of 8, Net.a runs 2 ms forward and 8 ms
// backward, Net.b 4 ms and 6 ms; each layer outputs 1 MiB at batch 8 and has 600 KiB of gradients.
std::vector<IterationTiming> probes_with_outputs() {
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) probes.push_back(iteration_timing(make_trace(250000 * b, (1 << 20) * b / 8), b));
  return probes;
}

TEST(StepTime, TensorParallelSplitsMatmulsAndAllReducesEachPair) {
  const auto probes = probes_with_outputs();
  EXPECT_EQ(probes.back().layers[1].kind, "matmul");
  EXPECT_EQ(probes.back().layers[1].out_bytes, 1 << 20);
  StepTimeOptions o;
  o.batch_size = 8;
  o.parallel = ParallelConfig::parse("tp:2");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast f = forecast_step_time(probes, o);
  // Net.a is the column-parallel layer, Net.b the row-parallel one: one all-reduce of Net.b's 1 MiB output in
  // forward and one in backward, 2(N-1)/N S/B + 2(N-1) alpha = 1048.576 + 20 us each.
  const double ar = (1048576.0 / 1000.0 + 20.0) / 1e3;
  EXPECT_NEAR(f.tp_comm_ms, 2 * ar, 1e-12);
  EXPECT_NEAR(f.per_layer[1].tp_comm_ms, 2 * ar, 1e-12);
  EXPECT_EQ(f.per_layer[0].tp_comm_ms, 0);
  EXPECT_NEAR(f.forward_ms, 3.0, 1e-9);
  EXPECT_NEAR(f.backward_ms, 7.0, 1e-9);
  EXPECT_NEAR(f.optimizer_ms, 250 / 1e6, 1e-15);  // half the parameters on each rank
  EXPECT_EQ(f.per_layer[0].grad_bytes, 300 << 10);
  EXPECT_NEAR(f.step_ms, 40 / 1e6 + 3.0 + 7.0 + 2 * ar + 250 / 1e6, 1e-9);
  EXPECT_NEAR(f.exposed_comm_ms, 2 * ar, 1e-12);
}

TEST(StepTime, ProbesTracedAsATensorParallelRankAreNotDividedAgain) {
  // The same probes taken as one tensor-parallel rank's (simulated ranks): the layers already ran on their shards,
  // so their times and gradients stand; the row-parallel layer's all-reduces are added as before.
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 8;
  o.parallel = ParallelConfig::parse("tp:2,traced_world:2");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast f = forecast_step_time(probes, o);
  const double ar = (1048576.0 / 1000.0 + 20.0) / 1e3;
  EXPECT_NEAR(f.tp_comm_ms, 2 * ar, 1e-12);
  EXPECT_NEAR(f.forward_ms, 6.0, 1e-9);
  EXPECT_NEAR(f.backward_ms, 14.0, 1e-9);
  EXPECT_NEAR(f.optimizer_ms, 500 / 1e6, 1e-15);  // the rank's own parameters, all of them
  EXPECT_EQ(f.per_layer[0].grad_bytes, 600 << 10);
  // A pipeline stage or a data-parallel rank traced alone: its step time is refused, naming why.
  for (const char* text : {"pp:2,traced_world:2", "dp:2,dp_mode:fsdp,traced_world:2"}) {
    o.parallel = ParallelConfig::parse(text);
    EXPECT_NE(err([&] { forecast_step_time(probes, o); }).find("is not forecast yet"), std::string::npos) << text;
  }
}

TEST(StepTime, LayerGraphEdgesCarryTheBytesPassed) {
  const auto probes = probes_with_outputs();
  const IterationTiming& it = probes.back();
  // Net.a's output feeds Net.b (1 MiB at batch 8); Net.a reads the previous iteration's output of Net.b, which
  // lies outside the iteration: no edge.
  ASSERT_EQ(it.edges.size(), 1u);
  EXPECT_EQ(it.edges[0].src, 0);
  EXPECT_EQ(it.edges[0].dst, 1);
  EXPECT_EQ(it.edges[0].bytes, 1 << 20);
  const IterationTiming back = iteration_timing_from_json(iteration_timing_to_json(it));
  ASSERT_EQ(back.edges.size(), 1u);
  EXPECT_EQ(back.edges[0].bytes, 1 << 20);
  EXPECT_EQ(back.layers[1].kind, "matmul");
  EXPECT_EQ(err([] { iteration_timing_from_json(R"({"batch":1,"wall_ns":1,"optimizer_ns":0,"other_ns":0,)"
                                                R"("clock":"cpu","layers":[],"edges":[[0,1,5]]})"); }),
            "iteration timing: edge 0 -> 1 names a layer that is not there (0 layers)");
}

TEST(StepTime, OpsCountedInAnEnclosingOpCountInItsUnit) {
  Trace t = make_trace(1000);
  const IterationTiming every = iteration_timing(t, 8);
  int64_t outermost = -1;  // the last iteration's first layer op
  for (const OpRecord& op : t.ops) {
    if (op.parent < 0 && op.phase == Phase::Forward && op.scope == Scope::Function && !op.module.empty() &&
        (outermost < 0 || t.ops[static_cast<size_t>(outermost)].module == op.module)) {
      outermost = op.id;
    }
  }
  ASSERT_GE(outermost, 0);
  t.ops[static_cast<size_t>(outermost)].nested = 5;  // a trace without nested ops counted five inside it
  const IterationTiming counted = iteration_timing(t, 8);
  EXPECT_EQ(counted.ops_total, every.ops_total + 5);
  int64_t fwd_every = 0, fwd_counted = 0;
  for (const LayerTiming& l : every.layers) fwd_every += l.forward_ops_all;
  for (const LayerTiming& l : counted.layers) fwd_counted += l.forward_ops_all;
  EXPECT_EQ(fwd_counted, fwd_every + 5);
  EXPECT_EQ(counted.optimizer_ops, every.optimizer_ops);
  EXPECT_EQ(counted.other_ops, every.other_ops);
}

TEST(StepTime, TimesFromALightTraceTakeTheStructureOfTheFullOne) {
  const IterationTiming full = iteration_timing(make_trace(1000, 1 << 20), 8);
  Trace light_trace = make_trace(3000);  // no shapes, no memory events
  light_trace.allocations.clear();
  IterationTiming light = iteration_timing(light_trace, 8);
  ASSERT_EQ(light.layers.size(), 2u);
  EXPECT_EQ(light.layers[0].grad_bytes, 0);
  EXPECT_EQ(light.layers[0].out_bytes, 0);
  EXPECT_TRUE(light.edges.empty());
  light.layers.push_back(LayerTiming{"Net.c", 70, 80});  // a layer the full trace does not have
  // The structure's layers in another order: the edge is mapped by name.
  IterationTiming structure = full;
  std::swap(structure.layers[0], structure.layers[1]);
  structure.edges = {{1, 0, 1 << 20}};
  structure.layers[0].flops = 123;
  structure.layers[0].bytes = 456;
  structure.layers[0].ops = 3;
  structure.layers[0].cost_kind = "matmul";
  structure.im2col_conv_ops = 2;  // seen in the full trace's nested ops, which a light trace may only count

  const IterationTiming m = with_structure(light, structure);
  EXPECT_EQ(m.im2col_conv_ops, 2);
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].layer, "Net.a");
  EXPECT_EQ(m.layers[1].layer, "Net.b");
  EXPECT_EQ(m.layers[0].forward_ns, 3000);  // times stay the light trace's
  EXPECT_EQ(m.layers[1].backward_ns, 9000);
  EXPECT_EQ(m.wall_ns, light.wall_ns);
  EXPECT_EQ(m.ops_total, light.ops_total);
  EXPECT_EQ(m.layers[0].grad_bytes, 600 << 10);  // the structure's
  EXPECT_EQ(m.layers[1].grad_bytes, 600 << 10);
  EXPECT_EQ(m.layers[1].out_bytes, full.layers[1].out_bytes);
  EXPECT_EQ(m.layers[1].out_bytes, 1 << 20);
  EXPECT_EQ(m.layers[1].flops, 123);
  EXPECT_EQ(m.layers[1].bytes, 456);
  EXPECT_EQ(m.layers[1].ops, 3);
  EXPECT_EQ(m.layers[1].cost_kind, "matmul");
  EXPECT_EQ(m.layers[2].grad_bytes, 0);  // Net.c: nothing to take
  EXPECT_EQ(m.layers[2].flops, 0);
  ASSERT_EQ(m.edges.size(), 1u);
  EXPECT_EQ(m.edges[0].src, 0);
  EXPECT_EQ(m.edges[0].dst, 1);
  EXPECT_EQ(m.edges[0].bytes, 1 << 20);
}

TEST(StepTime, SparseTimingPredictsTheUntimedLayers) {
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 8;
  o.time_fraction = 0.5;
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_EQ(f.timed_layers, 1);
  ASSERT_EQ(f.per_layer.size(), 2u);
  const int measured = (f.per_layer[0].source == "measured") + (f.per_layer[1].source == "measured");
  EXPECT_EQ(measured, 1);
  ASSERT_FALSE(f.notes.empty());
  EXPECT_EQ(f.notes[0].code, "sparse-timing");
  EXPECT_EQ(f.timed_layers, 1);
  // The probes' wall times anchor the total: at a probe's own batch the step is its measured iteration.
  EXPECT_NEAR(f.step_ms, probes.back().wall_ns / 1e6, 1e-6);
  o.time_fraction = 0;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "step time: time_fraction should be in (0, 1], got 0");
  o.time_fraction = 0.5;
  o.design = "best";
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "step time: design should be d-optimal or random, got 'best'");
}

// Net.b timed, Net.a untimed with the same work: the model prices Net.a as Net.b (about flat over the batch)
// while Net.a's time grows 400 ns per sample, so each probe's rest (wall - optimizer - timed layers) less the
// modelled Net.a falls below zero at batch 2 and rises above it at 4 and 8.
std::vector<IterationTiming> anchoring_probes() {
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) {
    IterationTiming it;
    it.batch = b;
    it.clock = "cpu";
    it.optimizer_ns = 500;
    for (const char* name : {"Net.a", "Net.b"}) {
      LayerTiming l;
      l.layer = name;
      l.cost_kind = "matmul";
      l.flops = 1e6 * static_cast<double>(b);
      l.bytes = 1e4 * static_cast<double>(b);
      l.ops = 1;
      l.forward_ops_all = l.backward_ops_all = 1;
      l.timed = std::string(name) == "Net.b";
      l.forward_ns = l.timed ? 1000 + 10 * b : 100 + 400 * b;
      l.backward_ns = l.forward_ns;
      it.layers.push_back(l);
    }
    it.wall_ns = it.optimizer_ns + 2 * (it.layers[0].forward_ns + it.layers[1].forward_ns);
    probes.push_back(it);
  }
  return probes;
}

TEST(StepTime, SparseTimingAnchorsTheStepOnTheProbesRest) {
  const std::vector<IterationTiming> probes = anchoring_probes();
  StepTimeOptions o;
  o.batch_size = 16;
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_EQ(f.timed_layers, 1);
  ASSERT_EQ(f.per_layer.size(), 2u);
  EXPECT_EQ(f.per_layer[1].source, "measured");
  EXPECT_NE(f.per_layer[0].source, "measured");
  // The rest, 2 (100 + 400 b) ns at every probe, fitted over the batch: 12,800 + 200 ns at 16; the timed layer
  // 2 (1000 + 160) ns; the optimizer 500 ns.
  std::vector<SizedValue> rest;
  for (const IterationTiming& p : probes) rest.push_back({static_cast<double>(p.batch), 0, 2.0 * (100 + 400 * p.batch)});
  EXPECT_NEAR(fit_size(rest, 16), 13000, 1e-6);
  EXPECT_NEAR(f.step_ms, (13000 + 2 * 1160 + 500) / 1e6, 1e-9);
  // The untimed layer and "other" share the rest.
  EXPECT_NEAR(f.per_layer[0].forward_ms + f.per_layer[0].backward_ms + f.other_ms, 13000 / 1e6, 1e-9);
  EXPECT_GE(f.other_ms, 0);
  // The tracer's correction scales every part once, the modelled layer's too.
  o.time_scale = 0.5;
  const StepTimeForecast half = forecast_step_time(probes, o);
  EXPECT_NEAR(half.step_ms, f.step_ms / 2, 1e-12);
  EXPECT_NEAR(half.per_layer[0].forward_ms, f.per_layer[0].forward_ms / 2, 1e-12);
  EXPECT_NEAR(half.per_layer[1].forward_ms, f.per_layer[1].forward_ms / 2, 1e-12);
}

TEST(StepTime, SparseTimingScalesModelledLayersDownToTheRest) {
  // Net.a takes less than its model says at every probe (40 ns + 4 ns per sample): the model's time at the target
  // is more than the rest, so the modelled layer is scaled down to the rest and "other" is 0.
  std::vector<IterationTiming> probes = anchoring_probes();
  for (IterationTiming& p : probes) {
    LayerTiming& a = p.layers[0];
    a.forward_ns = a.backward_ns = 40 + 4 * p.batch;
    p.wall_ns = p.optimizer_ns + 2 * (a.forward_ns + p.layers[1].forward_ns);
  }
  StepTimeOptions o;
  o.batch_size = 16;
  const StepTimeForecast f = forecast_step_time(probes, o);
  EXPECT_EQ(f.other_ms, 0);
  EXPECT_NEAR(f.per_layer[0].forward_ms + f.per_layer[0].backward_ms, 2 * (40 + 4 * 16) / 1e6, 1e-9);
  EXPECT_NEAR(f.step_ms, (2 * 104 + 2 * 1160 + 500) / 1e6, 1e-9);
  EXPECT_EQ(count_code(f.notes, "untimed-layers-scaled"), 1);
  // Device clocks: a probe's wall may be the host's (it launched the kernels slower than they ran), so the
  // modelled kernels keep their time; "other" is 0.
  for (IterationTiming& p : probes) p.clock = "device";
  const StepTimeForecast d = forecast_step_time(probes, o);
  EXPECT_EQ(d.other_ms, 0);
  EXPECT_NEAR(d.per_layer[0].forward_ms + d.per_layer[0].backward_ms, (d.step_ms - 0.0005) - 2 * 1160 / 1e6, 1e-9);
  EXPECT_GT(d.step_ms, f.step_ms);
  EXPECT_EQ(count_code(d.notes, "untimed-layers-scaled"), 0);
}

TEST(StepTime, ProbesTracedWithChosenLayersBringTheirChoice) {
  // Traced with Net.b alone timed: its times are used, Net.a's are predicted, whatever time_fraction says.
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4}) {
    Trace t = make_trace(1000 * b, 256 * b);
    t.timed_layers = {"Net.b"};
    probes.push_back(iteration_timing(t, b));
  }
  ASSERT_EQ(probes[0].layers.size(), 2u);
  EXPECT_FALSE(probes[0].layers[0].timed);
  EXPECT_TRUE(probes[0].layers[1].timed);
  EXPECT_FALSE(iteration_timing_from_json(iteration_timing_to_json(probes[0])).layers[0].timed);
  EXPECT_TRUE(iteration_timing_from_json(iteration_timing_to_json(probes[0])).layers[1].timed);
  StepTimeOptions o;
  o.batch_size = 8;
  for (double fraction : {1.0, 0.5}) {
    o.time_fraction = fraction;
    const StepTimeForecast f = forecast_step_time(probes, o);
    EXPECT_EQ(f.timed_layers, 1);
    ASSERT_EQ(f.per_layer.size(), 2u);
    EXPECT_NE(f.per_layer[0].source, "measured");
    EXPECT_EQ(f.per_layer[1].source, "measured");
    EXPECT_NEAR(f.per_layer[1].forward_ms, 2 * 8000 / 1e6, 1e-9);  // 2k ns at k = 1000 b
    ASSERT_FALSE(f.notes.empty());
    EXPECT_EQ(f.notes[0].code, "sparse-timing");
    EXPECT_EQ(f.timed_layers, 1);
  }
  // every_layer sets the choice aside where CPU clocks timed every op; device timers ran around the choice only.
  o.time_fraction = 1.0;
  o.every_layer = true;
  EXPECT_EQ(forecast_step_time(probes, o).timed_layers, -1);
  std::vector<IterationTiming> on_device = probes;
  for (IterationTiming& p : on_device) p.clock = "device";
  EXPECT_EQ(err([&] { forecast_step_time(on_device, o); }),
            "step time: every_layer asks for the times of every layer, but the probes were timed on the device for 1 "
            "of their 2 layers only; forecast again with time_fraction=1 to time them all");
  o.every_layer = false;
  // A choice that names none of the probes' layers leaves nothing to fit the models on.
  for (IterationTiming& p : probes) {
    for (LayerTiming& l : p.layers) l.timed = false;
  }
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "step time: the probes were traced with none of their layers timed");
}

TEST(StepTime, AnUntimedLayerWithoutABackwardPassIsPredictedWithoutOne) {
  // Net.b timed; Net.a untimed and, in the second set of probes, frozen: no backward op recorded for it.
  std::vector<IterationTiming> probes, frozen;
  for (int64_t b : {2, 4}) {
    Trace t = make_trace(1000 * b, 256 * b);
    t.timed_layers = {"Net.b"};
    probes.push_back(iteration_timing(t, b));
    frozen.push_back(probes.back());
    frozen.back().layers[0].backward_ns = 0;
    frozen.back().layers[0].backward_ops_all = 0;
  }
  ASSERT_EQ(probes[0].layers[0].layer, "Net.a");
  EXPECT_EQ(probes[0].layers[0].backward_ops_all, 1);
  StepTimeOptions o;
  o.batch_size = 8;
  const StepTimeForecast f = forecast_step_time(probes, o), g = forecast_step_time(frozen, o);
  ASSERT_EQ(g.per_layer.size(), 2u);
  EXPECT_NE(g.per_layer[0].source, "measured");
  EXPECT_GT(f.per_layer[0].backward_ms, 0);
  EXPECT_EQ(g.per_layer[0].backward_ms, 0);
  EXPECT_DOUBLE_EQ(g.per_layer[0].forward_ms, f.per_layer[0].forward_ms);
  EXPECT_DOUBLE_EQ(g.per_layer[1].backward_ms, f.per_layer[1].backward_ms);
}

TEST(StepTime, GradientsMadeOutsideANodeBelongToTheNodeBeforeThem) {
  // Autograd's engine reduces a broadcast bias's gradient (aten::sum) outside any node, right after the node that
  // produced it; AccumulateGrad, linked to no forward op, may copy a gradient. Both belong to Net.b's node.
  Trace t;
  auto add = [&](const char* name, Scope scope, Phase phase, const char* module, int64_t parent, int64_t node,
                 int64_t fwd) {
    OpRecord& o = push_op(t, name, scope, phase, module, parent, node, fwd);
    o.start_seq = 10 * static_cast<uint64_t>(o.id) + 1;
    o.end_seq = o.start_seq + (parent >= 0 || scope == Scope::BackwardFunction ? 8 : 1);
    o.start_ns = static_cast<int64_t>(o.start_seq) * 100;
    o.end_ns = static_cast<int64_t>(o.end_seq) * 100;
    return o.id;
  };
  auto grad = [&](int64_t op, int64_t bytes) {
    Allocation a;
    a.category = Category::Gradient;
    a.alloc_op = op;
    a.block_bytes = bytes;
    t.allocations.push_back(a);
  };
  const int64_t fa = add("aten::linear", Scope::Function, Phase::Forward, "Net.a", -1, -1, -1);
  const int64_t fb = add("aten::linear", Scope::Function, Phase::Forward, "Net.b", -1, -1, -1);
  const int64_t nb = add("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, "", -1, -1, fb);
  grad(add("aten::mm", Scope::Function, Phase::Backward, "", nb, nb, -1), 1000);
  const int64_t sum = add("aten::sum", Scope::Function, Phase::Backward, "", -1, -1, -1);
  grad(sum, 40);
  const int64_t acc = add("torch::autograd::AccumulateGrad", Scope::BackwardFunction, Phase::Backward, "", -1, -1, -1);
  grad(add("aten::clone", Scope::Function, Phase::Backward, "", acc, acc, -1), 64);
  const int64_t na = add("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, "", -1, -1, fa);
  grad(add("aten::mm", Scope::Function, Phase::Backward, "", na, na, -1), 100);
  add("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer, "", -1, -1, -1);
  EXPECT_EQ(gradient_node(t, t.ops[sum]), nb);
  EXPECT_EQ(gradient_node(t, t.ops[acc + 1]), nb);
  EXPECT_EQ(gradient_node(t, t.ops[na + 1]), na);
  EXPECT_EQ(gradient_node(t, t.ops[fb]), -1);  // a forward op keeps its own (none)
  const IterationTiming it = iteration_timing(t, 1);
  ASSERT_EQ(it.layers.size(), 3u);  // AccumulateGrad's own time: outside modules
  EXPECT_EQ(it.layers[0].layer, "Net.a");
  EXPECT_EQ(it.layers[0].grad_bytes, 100);
  EXPECT_EQ(it.layers[1].grad_bytes, 1000 + 40 + 64);
  EXPECT_EQ(it.layers[2].layer, "(outside modules)");
  EXPECT_EQ(it.layers[2].grad_bytes, 0);
}

// The autograd engine's record around each node, with the engine's own work after the node inside it: the
// reduction of a broadcast bias's gradient (aten::sum) belongs to the node's layer, in CPU and device clocks.
Trace engine_records_trace(bool device, int64_t sum_device_ns) {
  Trace t;
  auto add = [&](const char* name, Scope scope, Phase phase, const char* module, int64_t parent, int64_t node,
                 int64_t fwd, int64_t start, int64_t end, int64_t dev) {
    OpRecord& o = push_op(t, name, scope, phase, module, parent, node, fwd);
    o.start_ns = start;
    o.end_ns = end;
    o.start_seq = static_cast<uint64_t>(start);
    o.end_seq = static_cast<uint64_t>(end);
    o.device_ns = device ? dev : -1;
    return o.id;
  };
  constexpr const char* kWrap = "autograd::engine::evaluate_function: AddmmBackward0";
  const int64_t fa = add("aten::linear", Scope::Function, Phase::Forward, "Net.a", -1, -1, -1, 100, 200, 10);
  const int64_t fb = add("aten::linear", Scope::Function, Phase::Forward, "Net.b", -1, -1, -1, 300, 500, 20);
  const int64_t wb = add(kWrap, Scope::Function, Phase::Backward, "", -1, -1, -1, 600, 1400, 70);
  const int64_t nb = add("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, "", wb, -1, fb, 650, 1000, 50);
  add("aten::mm", Scope::Function, Phase::Backward, "", nb, nb, -1, 700, 900, 50);
  add("aten::sum", Scope::Function, Phase::Backward, "", wb, -1, -1, 1100, 1300, sum_device_ns);
  const int64_t wa = add(kWrap, Scope::Function, Phase::Backward, "", -1, -1, -1, 1500, 2000, 43);
  add("aten::mul", Scope::Function, Phase::Backward, "", wa, -1, -1, 1505, 1540, 3);  // before its node: not its
  add("AddmmBackward0", Scope::BackwardFunction, Phase::Backward, "", wa, -1, fa, 1550, 1900, 40);
  // AccumulateGrad (linked to no forward op) and a post hook of its (DDP's reducer copying the gradient into its
  // bucket): the rest of the step, not the layer of the node before.
  const int64_t wacc = add("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", Scope::Function,
                           Phase::Backward, "", -1, -1, -1, 2001, 2080, 7);
  add("torch::autograd::AccumulateGrad", Scope::BackwardFunction, Phase::Backward, "", wacc, -1, -1, 2005, 2020, 0);
  add("aten::copy_", Scope::Function, Phase::Backward, "", wacc, -1, -1, 2030, 2070, 7);
  add("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer, "", -1, -1, -1, 2100, 2200, 5);
  return t;
}

TEST(StepTime, TheEnginesWorkAfterANodeIsTheNodesLayers) {
  const IterationTiming cpu = iteration_timing(engine_records_trace(false, 0), 1);
  ASSERT_EQ(cpu.layers.size(), 3u);
  EXPECT_EQ(cpu.layers[1].layer, "Net.b");
  EXPECT_EQ(cpu.layers[1].backward_ns, 350 + 200);  // the node and the sum after it, not the engine's record
  EXPECT_EQ(cpu.layers[1].backward_ops_all, 3);     // the node, the mm inside it, the sum
  EXPECT_EQ(cpu.layers[0].backward_ns, 350);
  EXPECT_EQ(cpu.layers[0].backward_ops_all, 1);
  EXPECT_EQ(cpu.layers[2].layer, "(outside modules)");  // AccumulateGrad's own time, as before
  EXPECT_EQ(cpu.layers[2].backward_ns, 15);
  EXPECT_EQ(cpu.other_ops, 5);  // the engine's three records, the mul before a node, the copy after AccumulateGrad
  EXPECT_EQ(cpu.wall_ns, 2100);
  EXPECT_EQ(cpu.other_ns, 2100 - (100 + 200 + 550 + 350 + 15) - 100);
  const IterationTiming dev = iteration_timing(engine_records_trace(true, 20), 1);
  EXPECT_EQ(dev.clock, "device");
  EXPECT_EQ(dev.layers[1].backward_ns, 50 + 20);
  EXPECT_EQ(dev.layers[0].backward_ns, 40);
  EXPECT_EQ(dev.layers[2].backward_ns, 0);
  EXPECT_EQ(dev.optimizer_ns, 5);
  // A sparse trace that left the sum untimed: no time from the host's clock in a device-clock layer.
  const IterationTiming untimed = iteration_timing(engine_records_trace(true, -1), 1);
  EXPECT_EQ(untimed.layers[1].backward_ns, 50);
  EXPECT_EQ(untimed.layers[1].backward_ops_all, 3);
}

TEST(StepTime, TheTraceSummaryCountsTheEnginesWorkInTheNodesLayer) {
  Trace t = engine_records_trace(false, 0);
  for (OpRecord& op : t.ops) {  // as the tracer assembles them: a node and what runs in it take its forward's module
    if (op.scope == Scope::BackwardFunction && op.fwd_op >= 0) op.module = t.ops[op.fwd_op].module;
    if (op.name == "aten::mm") op.module = "Net.b";
  }
  EXPECT_EQ(engine_work_node(t, t.ops[5]), 3);   // the sum after Net.b's node
  EXPECT_EQ(engine_work_node(t, t.ops[7]), -1);  // the mul before Net.a's node
  EXPECT_EQ(engine_work_node(t, t.ops[11]), -1);  // the copy after AccumulateGrad
  EXPECT_EQ(engine_work_node(t, t.ops[4]), -1);  // inside a node
  std::map<std::string, LayerStat> by;
  for (const LayerStat& s : layer_stats(t, "cpu")) by[s.module] = s;
  EXPECT_EQ(by["Net.b"].time_ns, 200 + 350 + 200);  // forward, node, the sum
  EXPECT_EQ(by["Net.b"].ops, 4);
  EXPECT_EQ(by["Net.a"].time_ns, 100 + 350);
  EXPECT_EQ(by["<no module>"].time_ns, 35 + 15 + 40);
  EXPECT_EQ(by["<no module>"].ops, 3);
}

TEST(StepTime, ChoosesTheLayersToTimeByName) {
  const IterationTiming it = probes_with_outputs().back();
  ASSERT_EQ(it.layers.size(), 2u);
  const std::vector<std::string> one = choose_timed_layers(it, 0.5);
  ASSERT_EQ(one.size(), 1u);
  // The same layer forecast_step_time times for that fraction and design.
  StepTimeOptions o;
  o.batch_size = 8;
  o.time_fraction = 0.5;
  const StepTimeForecast f = forecast_step_time(probes_with_outputs(), o);
  for (const LayerForecast& l : f.per_layer) EXPECT_EQ(l.source == "measured", l.layer == one[0]) << l.layer;
  EXPECT_EQ(choose_timed_layers(it, 1.0), (std::vector<std::string>{"Net.a", "Net.b"}));
  EXPECT_EQ(choose_timed_layers(it, 0.5, "random", 3).size(), 1u);
  EXPECT_EQ(err([&] { choose_timed_layers(it, 1.5); }), "step time: time_fraction should be in (0, 1], got 1.5");
  EXPECT_EQ(err([&] { choose_timed_layers(it, 0.5, "all"); }),
            "step time: design should be d-optimal or random, got 'all'");
}

TEST(StepTime, ATimeBudgetBoundsTheTimedLayersShare) {
  // Four layers taking 10, 20, 30 and 40 % of the layer time.
  IterationTiming it;
  it.batch = 8;
  const char* kinds[] = {"matmul", "norm", "elementwise", "conv"};
  for (int i = 0; i < 4; ++i) {
    LayerTiming l{"L" + std::to_string(i), 1000.0 * (i + 1), 0.0};
    l.cost_kind = kinds[i];
    l.flops = 1e6 * (i + 1);
    l.bytes = 1e5 * (4 - i);
    l.ops = 1 + i;
    it.layers.push_back(l);
  }
  auto share = [&](const std::vector<std::string>& names) {
    double x = 0;
    for (const std::string& n : names) x += 1000.0 * (std::stoi(n.substr(1)) + 1);
    return x / 10000.0;
  };
  EXPECT_EQ(choose_timed_layers(it, 1.0), (std::vector<std::string>{"L0", "L1", "L2", "L3"}));
  for (const std::string design : {"d-optimal", "random"}) {
    for (double budget : {0.95, 0.6, 0.45, 0.3, 0.15}) {
      const std::vector<std::string> c = choose_timed_layers(it, 1.0, design, 1, budget);
      ASSERT_FALSE(c.empty());
      EXPECT_LE(share(c), budget + 1e-12) << design << " " << budget;
    }
    // Below every layer's share: the layer that takes least time, alone.
    EXPECT_EQ(choose_timed_layers(it, 1.0, design, 1, 0.05), (std::vector<std::string>{"L0"}));
  }
  // The budget can only take layers away from the fraction's design.
  EXPECT_EQ(choose_timed_layers(it, 0.5, "d-optimal", 0, 1.0).size(), 2u);
  EXPECT_LE(choose_timed_layers(it, 0.5, "d-optimal", 0, 0.3).size(), 2u);
  EXPECT_EQ(err([&] { choose_timed_layers(it, 1.0, "d-optimal", 0, 0.0); }),
            "step time: time_budget should be in (0, 1], got 0");
  // Through the forecast's own design path too.
  StepTimeOptions o;
  o.batch_size = 8;
  o.time_budget = 0.15;
  EXPECT_EQ(forecast_step_time({it}, o).timed_layers, 1);
}

TEST(StepTime, PipelineOneFOneB) {
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 32;
  o.parallel = ParallelConfig::parse("pp:2,micro_batches:4");  // micro-batches of 8
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast f = forecast_step_time(probes, o);
  ASSERT_EQ(f.per_layer.size(), 2u);
  EXPECT_EQ(f.per_layer[0].stage, 0);
  EXPECT_EQ(f.per_layer[1].stage, 1);
  // Stages of 10 ms each (forward 2 + backward 8, and 4 + 6); Net.a's 1 MiB output is sent forward, its gradient
  // back, c each. Stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, stage 1 F0 B0 F1 B1 F2 B2 F3 B3. The step's rest (40 ns a
  // micro-batch, 160 ns a step) is each stage's by its layer's ops (one forward and one backward op each: half),
  // 10 ns after each of its passes (r). Worked by hand: stage 0's B0 waits for 2 + c + 4 + 6 + c; it waits 2c more
  // before B2 (stage 1's F2 waited c for stage 0's F2 and c to send back) and again before B3: the step is
  // 50 + 4c, and ten passes with their rest lie on that path.
  const double c = (10.0 + 1048576.0 / 1000.0) / 1e3, r = 10 / 1e6;
  EXPECT_NEAR(f.step_ms, 50.0 + 4 * c + 10 * r + 250 / 1e6, 1e-9);
  // The slowest stage's rank (stage 0, the first of two equal ones): 4 x 10 ms of compute and 8 rests; it waits
  // the rest of the step.
  EXPECT_NEAR(f.compute_ms, 40.0 + 8 * r + 250 / 1e6, 1e-9);
  EXPECT_NEAR(f.bubble_ms, 10.0 + 4 * c + 2 * r, 1e-9);
  EXPECT_NEAR(f.step_ms, f.compute_ms + f.exposed_comm_ms + f.bubble_ms, 1e-9);
  EXPECT_NEAR(f.pp_comm_ms, 4 * c, 1e-12);  // either stage sends four times
  ASSERT_EQ(f.comm.size(), 8u);
  for (const CommForecast& x : f.comm) {
    EXPECT_EQ(x.kind, "pp_send");
    EXPECT_EQ(x.bytes, 1 << 20);
    EXPECT_NEAR(x.end_ms - x.start_ms, c, 1e-12);
  }
  EXPECT_NEAR(f.comm[0].start_ms, 2.0 + r, 1e-9);  // stage 0's first output, after its first pass and rest
  EXPECT_EQ(f.comm[0].stage, 0);
  // The timeline: per stage 4 forwards and 4 backwards of its one layer, each followed by its rest, and the
  // optimizer step.
  ASSERT_EQ(f.compute.size(), 2u * (8 + 8 + 1));
  std::vector<std::string> stage1;
  for (const ComputeSpan& x : f.compute) {
    if (x.stage == 1 && (x.kind == "forward" || x.kind == "backward")) {
      stage1.push_back(fmt::format("{}{}@{:.6f}", x.kind[0], x.micro_batch, x.start_ms));
    }
    if (x.kind == "other") EXPECT_NEAR(x.end_ms - x.start_ms, r, 1e-12);
  }
  EXPECT_EQ(stage1, (std::vector<std::string>{
                        fmt::format("f0@{:.6f}", 2 + c + r), fmt::format("b0@{:.6f}", 6 + c + 2 * r),
                        fmt::format("f1@{:.6f}", 12 + c + 3 * r), fmt::format("b1@{:.6f}", 16 + c + 4 * r),
                        fmt::format("f2@{:.6f}", 22 + 3 * c + 5 * r), fmt::format("b2@{:.6f}", 26 + 3 * c + 6 * r),
                        fmt::format("f3@{:.6f}", 32 + 3 * c + 7 * r), fmt::format("b3@{:.6f}", 36 + 3 * c + 8 * r)}));
  // One micro-batch: the forward chain and the backward chain, a send each way.
  o.parallel = ParallelConfig::parse("pp:2");
  o.batch_size = 8;
  const StepTimeForecast one = forecast_step_time(probes, o);
  EXPECT_NEAR(one.step_ms, 20.0 + 2 * c + 4 * r + 250 / 1e6, 1e-9);
  // Measured sends price the hop instead: 1 MiB between samples at 512 KiB (100 us) and 2 MiB (400 us).
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,send_samples:524288/100;2097152/400");
  const StepTimeForecast sent = forecast_step_time(probes, o);
  const double h = (100.0 + 300.0 * (1048576.0 - 524288.0) / (2097152.0 - 524288.0)) / 1e3;
  EXPECT_NEAR(sent.step_ms, 20.0 + 2 * h + 4 * r + 250 / 1e6, 1e-9);
  EXPECT_NEAR(sent.pp_comm_ms, h, 1e-12);
}

TEST(StepTime, TreeAllReducesWhereTheLinkSaysSo) {
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 32;
  o.parallel = ParallelConfig::parse("dp:4,tp:2");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast ring = forecast_step_time(probes, o);
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,algorithm:tree");
  const StepTimeForecast tree = forecast_step_time(probes, o);
  // The tensor-parallel all-reduces of Net.b's 1 MiB output (2 ranks: 2 log2(2) = 2 steps either way; S/B
  // against 2(N-1)/N S/B = S/B: the same), and the data-parallel buckets over 4 ranks: tree S/B + 4 alpha against
  // ring 1.5 S/B + 6 alpha.
  EXPECT_NEAR(tree.tp_comm_ms, ring.tp_comm_ms, 1e-12);
  ASSERT_EQ(tree.buckets.size(), ring.buckets.size());
  for (size_t k = 0; k < tree.buckets.size(); ++k) {
    const double bytes = static_cast<double>(tree.buckets[k].bytes);
    EXPECT_NEAR(tree.buckets[k].end_ms - tree.buckets[k].start_ms, (bytes / 1000.0 + 4 * 10.0) / 1e3, 1e-12);
    EXPECT_NEAR(ring.buckets[k].end_ms - ring.buckets[k].start_ms, (1.5 * bytes / 1000.0 + 6 * 10.0) / 1e3, 1e-12);
  }
}

TEST(StepTime, TimelineSpansFollowTheSchedule) {
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 32;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  // DDP with two micro-batches: other, Net.a and Net.b forward, their backward in reverse, twice; then the
  // optimizer after the reduction. Spans touch end to end on the compute stream.
  o.parallel = ParallelConfig::parse("dp:2,micro_batches:2");
  const StepTimeForecast d = forecast_step_time(probes, o);
  std::vector<std::string> names;
  for (const ComputeSpan& x : d.compute) names.push_back(fmt::format("{}:{}", x.micro_batch, x.name));
  EXPECT_EQ(names, (std::vector<std::string>{"0:other (loss, zero_grad, Python)", "0:Net.a forward", "0:Net.b forward",
                                             "0:Net.b backward", "0:Net.a backward",
                                             "1:other (loss, zero_grad, Python)", "1:Net.a forward", "1:Net.b forward",
                                             "1:Net.b backward", "1:Net.a backward", "1:optimizer step"}));
  for (size_t i = 1; i + 1 < d.compute.size(); ++i) EXPECT_NEAR(d.compute[i].start_ms, d.compute[i - 1].end_ms, 1e-12);
  EXPECT_NEAR(d.compute.back().end_ms, d.step_ms, 1e-9);
  EXPECT_NEAR(d.compute.back().start_ms, d.comm.back().end_ms, 1e-9);  // after the last bucket's all-reduce
  // Tensor parallelism: the row-parallel layer's all-reduces sit between the spans, on the communication stream.
  o.parallel = ParallelConfig::parse("tp:2");
  o.batch_size = 16;
  const StepTimeForecast t = forecast_step_time(probes, o);
  double tp_drawn = 0;
  for (const CommForecast& x : t.comm) {
    EXPECT_EQ(x.kind, "tp_allreduce");
    tp_drawn += x.end_ms - x.start_ms;
  }
  EXPECT_GT(t.comm.size(), 0u);
  EXPECT_NEAR(tp_drawn, t.tp_comm_ms, 1e-9);
  EXPECT_NEAR(t.compute.back().end_ms, t.step_ms, 1e-9);
  EXPECT_NEAR(t.step_ms, t.compute_ms + t.exposed_comm_ms, 1e-9);
  // FSDP with two micro-batches gathers every unit in every pass of both; only the last reduce-scatters.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,micro_batches:2");
  o.batch_size = 32;
  const StepTimeForecast s = forecast_step_time(probes, o);
  int gathers = 0, scatters = 0;
  for (const CommForecast& x : s.comm) gathers += x.kind == "fsdp_all_gather", scatters += x.kind == "fsdp_reduce_scatter";
  EXPECT_EQ(gathers, 2 * 2 * 2);
  EXPECT_EQ(scatters, 2);
  for (const ComputeSpan& x : s.compute) {
    if (x.kind != "forward" && x.kind != "backward") continue;
    // A unit computes once its parameters are gathered.
    bool after_gather = false;
    for (const CommForecast& g : s.comm) after_gather |= g.kind == "fsdp_all_gather" && g.end_ms <= x.start_ms + 1e-12;
    EXPECT_TRUE(after_gather) << x.name;
  }
  EXPECT_NEAR(s.compute.back().end_ms, s.step_ms, 1e-9);
  // Layers x micro-batches beyond 10,000: a span per pass, not per layer (2 layers x 6,000 micro-batches).
  o.parallel = ParallelConfig::parse("micro_batches:6000");
  o.batch_size = 6000 * 8;
  const StepTimeForecast many = forecast_step_time(probes, o);
  ASSERT_EQ(many.compute.size(), 3u * 6000 + 1);
  EXPECT_EQ(many.compute[1].name, "forward (micro-batch 0)");
  EXPECT_EQ(many.compute[2].name, "backward (micro-batch 0)");
  EXPECT_EQ(many.compute[3 * 5999 + 1].name, "forward (micro-batch 5999)");
  EXPECT_NEAR(many.compute[1].end_ms - many.compute[1].start_ms, many.forward_ms / 6000, 1e-9);
  EXPECT_NEAR(many.compute.back().end_ms, many.step_ms, 1e-6);
}

TEST(StepTime, FsdpGathersPerUnitWithPrefetch) {
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast f = forecast_step_time(probes, o);
  const double g = (0.5 * 614400 / 1000.0 + 10.0) / 1e3;  // all-gather or reduce-scatter of 600 KiB on 2 ranks
  const double t = 40 / 1e6;
  // Forward: gather a, compute a (2 ms) while b is gathered; backward: gather b after forward (not resharded in
  // this model), a prefetched while b computes, b's gradients reduce-scattered after its 6 ms, then a's after 8 ms.
  ASSERT_EQ(f.comm.size(), 6u);
  EXPECT_EQ(f.comm[0].kind, "fsdp_all_gather");
  EXPECT_NEAR(f.comm[1].start_ms, t + g, 1e-12);
  EXPECT_NEAR(f.comm[2].start_ms, t + g + 6.0, 1e-9);  // backward gather of b when forward ends
  EXPECT_EQ(f.comm[4].kind, "fsdp_reduce_scatter");
  const double end = t + g + 6.0 + g + 6.0 + 8.0 + g;
  EXPECT_NEAR(f.exposed_comm_ms, end - (t + 20.0), 1e-9);
  EXPECT_NEAR(f.optimizer_ms, 250 / 1e6, 1e-15);
  EXPECT_NEAR(f.step_ms, end + 250 / 1e6, 1e-9);
}

// Probes (batch 2 and 4, the same times: the fits keep them) of a model Net = emb, blk (lin, act), head, with
// each layer's parameter bytes, forward and backward ms; backward runs head, act, lin, emb.
std::vector<IterationTiming> fsdp_probes() {
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4}) {
    IterationTiming it;
    it.batch = b;
    auto layer = [](const char* name, int64_t bytes, double fw_ms, double bw_ms, int64_t order) {
      LayerTiming l{name, fw_ms * 1e6, bw_ms * 1e6, bytes};
      l.backward_order = order;
      l.forward_ops_all = l.backward_ops_all = l.ops = 1;
      return l;
    };
    it.layers = {layer("Net.emb", 102400, 1, 1, 3), layer("Net.blk.lin", 409600, 2, 4, 2),
                 layer("Net.blk.act", 0, 1, 1, 1), layer("Net.head", 204800, 1, 2, 0)};
    it.wall_ns = 13e6;
    probes.push_back(it);
  }
  return probes;
}

TEST(StepTime, FsdpUnitsGatherTheirLayersTogetherAndTheRootOnce) {
  const auto probes = fsdp_probes();
  StepTimeOptions o;
  o.batch_size = 8;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  auto g = [](double bytes) { return (0.5 * bytes / 1000.0 + 10.0) / 1e3; };  // all-gather / reduce-scatter, 2 ranks
  // blk a unit; emb and head the root's (300 KiB), gathered first in forward and kept for backward. Forward: the
  // root's gather, then blk's prefetched as emb starts (done before emb's 1 ms ends). Backward: blk gathered as
  // backward starts, while head runs (not regathered); blk's gradients reduce-scattered after lin, the root's
  // after emb, when backward is done.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net.blk");
  ASSERT_EQ(o.parallel.fsdp_units, std::vector<std::string>{"Net.blk"});
  const StepTimeForecast f = forecast_step_time(probes, o);
  std::vector<std::string> comm;
  for (const CommForecast& x : f.comm) comm.push_back(fmt::format("{} {} @{:.4f}", x.kind, x.bytes, x.start_ms));
  const double r = g(307200), b = g(409600);
  EXPECT_EQ(comm, (std::vector<std::string>{
                      fmt::format("fsdp_all_gather 307200 @{:.4f}", 0.0),
                      fmt::format("fsdp_all_gather 409600 @{:.4f}", r),
                      fmt::format("fsdp_all_gather 409600 @{:.4f}", r + 5),
                      fmt::format("fsdp_reduce_scatter 409600 @{:.4f}", r + 12),
                      fmt::format("fsdp_reduce_scatter 307200 @{:.4f}", r + 13)}));
  EXPECT_NEAR(f.step_ms, 13 + 2 * r, 1e-9);
  EXPECT_NEAR(f.exposed_comm_ms, 2 * r, 1e-9);
  EXPECT_NEAR(f.comm_ms, 2 * r + 3 * b, 1e-9);
  // reshard_after_forward as given to fully_shard: False keeps blk gathered for backward (no third gather); True
  // gathers the root again too, as backward starts.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net.blk,reshard_after_forward:False");
  std::vector<int64_t> kept;
  for (const CommForecast& x : forecast_step_time(probes, o).comm) kept.push_back(x.kind == "fsdp_all_gather" ? x.bytes : -x.bytes);
  EXPECT_EQ(kept, (std::vector<int64_t>{307200, 409600, -409600, -307200}));
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net.blk,reshard_after_forward:True");
  std::vector<int64_t> again;
  for (const CommForecast& x : forecast_step_time(probes, o).comm) again.push_back(x.kind == "fsdp_all_gather" ? x.bytes : -x.bytes);
  EXPECT_EQ(again, (std::vector<int64_t>{307200, 409600, 307200, 409600, -409600, -307200}));
  // Without units every layer with parameters is one, gathered in both passes: 3 + 3 gathers, 3 reduce-scatters.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp");
  const StepTimeForecast each = forecast_step_time(probes, o);
  int gathers = 0, scatters = 0;
  for (const CommForecast& x : each.comm) gathers += x.kind == "fsdp_all_gather", scatters += x.kind == "fsdp_reduce_scatter";
  EXPECT_EQ(gathers, 6);
  EXPECT_EQ(scatters, 3);
  // The root alone (the model wrapped whole): one gather of everything before forward, one reduce-scatter after
  // backward.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net");
  const StepTimeForecast whole = forecast_step_time(probes, o);
  ASSERT_EQ(whole.comm.size(), 2u);
  EXPECT_EQ(whole.comm[0].bytes, 716800);
  EXPECT_EQ(whole.comm[0].start_ms, 0);
  EXPECT_EQ(whole.comm[1].kind, "fsdp_reduce_scatter");
  EXPECT_NEAR(whole.comm[1].start_ms, g(716800) + 13, 1e-9);
  EXPECT_NEAR(whole.step_ms, 13 + 2 * g(716800), 1e-9);
  // Nested units: the innermost holds a layer.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net.blk|Net.blk.lin");
  const StepTimeForecast nested = forecast_step_time(probes, o);
  EXPECT_EQ(nested.comm[1].bytes, 409600);  // lin's unit (blk keeps no parameters: no gather of its own)
  EXPECT_EQ(nested.comm.size(), 5u);
  // FSDP's own work measured by calibrate(): per unit (2: blk and the root), layer with parameters (3) and MiB
  // (700 KiB), every micro-batch.
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net.blk");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000,fsdp_overhead_unit_us:100,fsdp_overhead_layer_us:10,"
                               "fsdp_overhead_mib_us:1000");
  const double own = (2 * 100 + 3 * 10 + 716800.0 / 1048576 * 1000) / 1e3;
  const StepTimeForecast busy = forecast_step_time(probes, o);
  EXPECT_NEAR(busy.other_ms, f.other_ms + own, 1e-9);
  EXPECT_NEAR(busy.compute_ms, f.compute_ms + own, 1e-9);
  EXPECT_NEAR(busy.step_ms, f.step_ms + own, 1e-9);
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,fsdp_units:Net.blk,micro_batches:2");
  o.batch_size = 16;
  EXPECT_EQ(count_code(forecast_step_time(probes, o).notes, "fsdp-overhead"), 1);
  EXPECT_EQ(err([] { Topology::parse("alpha_us:10,bytes_per_us:1000,fsdp_overhead_mib_us:-1"); }),
            "link: 'fsdp_overhead_mib_us' should be a non-negative number, got '-1'");
  o.batch_size = 8;
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  // A unit that holds no layer, and the root named by another name.
  for (const char* units : {"Net.body", "Model"}) {
    o.parallel = ParallelConfig::parse(fmt::format("dp:2,dp_mode:fsdp,fsdp_units:Net.blk|{}", units));
    EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
              fmt::format("parallel: option 'fsdp_units' names '{}', which holds no layer of the traced step (module "
                          "paths as the trace names them, such as 'Net.emb', 'Net.blk.lin', 'Net.blk.act', ...)",
                          units));
  }
}

TEST(StepTime, FsdpCollectivesFromTheirOwnSamples) {
  // gloo's reduce-scatter costs a whole all-reduce: measured all-gathers and reduce-scatters price FSDP's
  // collectives instead of half the all-reduce samples.
  Topology t = Topology::parse("alpha_us:10,bytes_per_us:1000,ranks:2,samples:1000/100;100000/300,"
                               "all_gather_samples:1000/70;100000/170,reduce_scatter_samples:1000/90;100000/290");
  EXPECT_NEAR(all_gather_us(50500, 2, t.intra), 120, 1e-9);
  EXPECT_NEAR(reduce_scatter_us(50500, 2, t.intra), 190, 1e-9);
  // Outside them the ring model's half all-reduce, shifted through the nearest sample: 0.5 * 100000 / 1000 = 50
  // us more per 100 kB.
  EXPECT_NEAR(all_gather_us(200000, 2, t.intra), 170 + 50, 1e-9);
  // Another rank count than measured, or no samples of their own: half the all-reduce.
  EXPECT_NEAR(all_gather_us(50500, 4, t.intra), 0.75 * 50500 / 1000 + 30, 1e-9);
  const Topology plain = Topology::parse("alpha_us:10,bytes_per_us:1000,ranks:2,samples:1000/100;100000/300");
  EXPECT_NEAR(reduce_scatter_us(50500, 2, plain.intra), 100, 1e-9);
  // The buffers' broadcast stays priced from the all-reduce (a collective of its own).
  EXPECT_NEAR(broadcast_us(50500, 2, t.intra), broadcast_us(50500, 2, plain.intra), 1e-12);
  EXPECT_EQ(err([] { Topology::parse("alpha_us:10,bytes_per_us:1000,all_gather_samples:1000/70;100000/170"); }),
            "link: 'all_gather_samples' go with the all-reduce 'samples' and 'ranks' they were measured beside "
            "(gpucast.calibrate() gives all of them)");
  EXPECT_EQ(err([] { Topology::parse("alpha_us:10,bytes_per_us:1000,ranks:2,samples:1000/100;100000/300,"
                                     "reduce_scatter_samples:1000/-1"); }),
            "link: 'reduce_scatter_samples' should be BYTES/MICROSECONDS pairs joined by ';' (positive numbers), got "
            "'1000/-1' in '1000/-1'");
}

TEST(StepTime, ZeroReduceScattersThenGathersParameters) {
  const auto probes = probes_with_outputs();
  StepTimeOptions o;
  o.batch_size = 16;
  o.parallel = ParallelConfig::parse("dp:2,dp_mode:zero2");
  o.topology = Topology::parse("alpha_us:10,bytes_per_us:1000");
  const StepTimeForecast f = forecast_step_time(probes, o);
  ASSERT_EQ(f.buckets.size(), 1u);
  const double rs = (0.5 * 1228800 / 1000.0 + 10.0) / 1e3;
  ASSERT_EQ(f.comm.size(), 2u);
  EXPECT_EQ(f.comm[0].kind, "dp_reduce_scatter");
  EXPECT_EQ(f.comm[1].kind, "dp_all_gather");
  EXPECT_NEAR(f.exposed_comm_ms, 2 * rs, 1e-9);
  EXPECT_NEAR(f.step_ms, 40 / 1e6 + 20.0 + rs + 250 / 1e6 + rs, 1e-9);
}

TEST(StepTime, TopologyPicksTheLinkOfEachGroup) {
  const Topology t = Topology::parse("intra:nvlink4,gpus_per_node:8,inter:ib-ndr");
  EXPECT_EQ(t.link_for(8, 1), &t.intra);
  EXPECT_EQ(t.link_for(4, 2), &t.intra);
  EXPECT_EQ(t.link_for(2, 8), &t.inter);  // dp across nodes when tp fills a node
  EXPECT_EQ(t.inter.bytes_per_us, 46000.0);
  EXPECT_EQ(Topology::parse("").link_for(2, 1), nullptr);
  // gpus_per_node 0: every rank in one node (the default, also when given).
  const Topology one = Topology::parse("intra:nvlink4,gpus_per_node:0,inter:ib-ndr");
  EXPECT_EQ(one.link_for(64, 8), &one.intra);
  EXPECT_EQ(err([] { Topology::parse("gpus_per_node:-8"); }),
            "link: option 'gpus_per_node' expects a non-negative integer, got '-8'");
  EXPECT_EQ(err([] { Topology::parse("intra:nvlink9"); }),
            "link: unknown interconnect 'nvlink9'; known: nvlink3, nvlink4, nvlink5, pcie3, pcie4, pcie5, ib-hdr, ib-ndr, "
            "eth-100g");
  EXPECT_EQ(err([] { Topology::parse("alpha_us:5"); }), "link: 'alpha_us' and 'bytes_per_us' go together; got only 'alpha_us'");
  EXPECT_EQ(err([] { Topology::parse("alpha_us:5,bytes_per_us:fast"); }),
            "link: 'bytes_per_us' should be a positive number, got 'fast'");
  EXPECT_EQ(find_interconnect("NVLink3").link.alpha_us, 9.0);
}

TEST(StepTime, FitSizeRecoversTokensAndPairsOfTokens) {
  // y = 3 + 2 b L + 0.5 b L^2 at the probe design forecast() uses (three batch sizes at the shortest length,
  // three lengths at the smallest batch, one cross point).
  auto y = [](double b, double L) { return 3 + 2 * b * L + 0.5 * b * L * L; };
  std::vector<SizedValue> pts;
  for (auto [b, L] : std::vector<std::pair<double, double>>{{2, 16}, {4, 16}, {8, 16}, {2, 32}, {2, 64}, {4, 64}}) {
    pts.push_back({b, L, y(b, L)});
  }
  EXPECT_NEAR(fit_size(pts, 16, 128), y(16, 128), 1e-6 * y(16, 128));
  // Without a target length: over the batch only (the points at other lengths then disagree; still a line).
  std::vector<SizedValue> one_length(pts.begin(), pts.begin() + 3);
  EXPECT_NEAR(fit_size(one_length, 16), 3 + 2 * 16 * 16 + 0.5 * 16 * 16 * 16, 1e-6);
  EXPECT_NEAR(fit_size(one_length, 16, 128), fit_size(one_length, 16), 1e-9);  // one length: by batch
  // A term that would come out negative is dropped: y falls with the tokens -> the best fit with a, c, d >= 0.
  std::vector<SizedValue> falling;
  for (const SizedValue& p : pts) falling.push_back({p.batch, p.seq, 100 - 0.01 * p.batch * p.seq});
  double mean = 0;
  for (const SizedValue& p : falling) mean += p.value / static_cast<double>(falling.size());
  EXPECT_NEAR(fit_size(falling, 16, 128), mean, 1e-9);
  // One point with a length: proportional to the tokens.
  EXPECT_DOUBLE_EQ(fit_size({{2, 16, 10}}, 4, 64), 80);
  EXPECT_EQ(fit_size({}, 4, 64), 0);
}

TEST(StepTime, ScalesBySequenceLengthFromProbesAtSeveralLengths) {
  // One layer whose forward takes 1000 + 10 b L + 0.1 b L^2 ns, backward twice that.
  auto probe_at = [](int64_t b, int64_t L) {
    IterationTiming it;
    it.batch = b;
    it.seq = L;
    const double fw = 1000 + 10.0 * static_cast<double>(b * L) + 0.1 * static_cast<double>(b * L * L);
    LayerTiming l;
    l.layer = "net.attn";
    l.forward_ns = fw;
    l.backward_ns = 2 * fw;
    it.layers = {l};
    it.wall_ns = 3 * fw;
    return it;
  };
  std::vector<IterationTiming> probes;
  for (auto [b, L] : std::vector<std::pair<int64_t, int64_t>>{{2, 16}, {4, 16}, {8, 16}, {2, 32}, {2, 64}, {4, 64}}) {
    probes.push_back(probe_at(b, L));
  }
  StepTimeOptions o;
  o.batch_size = 16;
  o.seq_len = 128;
  const StepTimeForecast f = forecast_step_time(probes, o);
  const double fw_ms = (1000 + 10.0 * 16 * 128 + 0.1 * 16 * 128 * 128) / 1e6;
  ASSERT_EQ(f.per_layer.size(), 1u);
  EXPECT_NEAR(f.per_layer[0].forward_ms, fw_ms, 1e-9);
  EXPECT_NEAR(f.per_layer[0].backward_ms, 2 * fw_ms, 1e-9);
  probes[3].seq = 0;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "step time: seq_len 128 asks for scaling by sequence length, but the probe at batch 2 has no sequence "
            "length recorded (forecast(..., seq_len=) records it)");
}

TEST(StepTime, TheMedianOfLightTracesTakesEachTimeApart) {
  IterationTiming a;
  a.batch = 8;
  a.wall_ns = 100;
  a.optimizer_ns = 10;
  a.other_ns = 20;
  a.ops_total = 7;
  a.layers = {LayerTiming{"Net.a", 30, 40}, LayerTiming{"Net.b", 1, 2}};
  IterationTiming b = a, c = a, d = a;
  b.wall_ns = 500;  // a pause in this run
  b.layers[0].forward_ns = 400;
  b.ops_total = 9;  // not a time: the first run's
  c.wall_ns = 90;
  c.optimizer_ns = 12;
  c.layers[1].backward_ns = 5;
  d.other_ns = 26;
  d.layers[0].backward_ns = 44;
  const IterationTiming m3 = median_timing({a, b, c});
  EXPECT_EQ(m3.wall_ns, 100);
  EXPECT_EQ(m3.optimizer_ns, 10);
  EXPECT_EQ(m3.other_ns, 20);
  EXPECT_EQ(m3.layers[0].forward_ns, 30);
  EXPECT_EQ(m3.layers[1].backward_ns, 2);
  EXPECT_EQ(m3.ops_total, 7);
  EXPECT_EQ(m3.batch, 8);
  // An even count: the mean of the middle two.
  const IterationTiming m4 = median_timing({a, b, c, d});
  EXPECT_EQ(m4.wall_ns, 100);          // 90, 100, 100, 500
  EXPECT_EQ(m4.optimizer_ns, 10);      // 10, 10, 10, 12
  EXPECT_EQ(m4.other_ns, 20);          // 20, 20, 20, 26
  EXPECT_EQ(m4.layers[0].forward_ns, 30);
  EXPECT_EQ(m4.layers[0].backward_ns, 40);  // 40, 40, 40, 44
  const IterationTiming m2 = median_timing({a, d});
  EXPECT_EQ(m2.other_ns, 23);
  EXPECT_EQ(m2.layers[0].backward_ns, 42);
  EXPECT_EQ(median_timing({b}).wall_ns, 500);
  EXPECT_EQ(m3.untraced_wall_ns, -1);  // light traces have none

  // Timing rounds of a probe: each has its untraced wall, and the combined one is their median; a run without
  // one leaves the combination without one (never the first run's alone).
  IterationTiming r1 = a, r2 = b, r3 = c;
  r1.untraced_wall_ns = 80;
  r2.untraced_wall_ns = 300;
  r3.untraced_wall_ns = 85;
  EXPECT_EQ(median_timing({r1, r2, r3}).untraced_wall_ns, 85);
  EXPECT_EQ(median_timing({r1, r3}).untraced_wall_ns, 82.5);
  EXPECT_EQ(median_timing({r1, r2, c}).untraced_wall_ns, -1);

  EXPECT_EQ(err([] { median_timing({}); }), "median timing: no runs");
  // Runs whose layers differ (a routed layer's expert that received no token is not run): the median is over the
  // runs that ran the layers most of them ran, the first such group on a tie.
  IterationTiming other = a;
  other.layers[1].layer = "Net.c";
  other.wall_ns = 1000;
  const IterationTiming most = median_timing({a, other, b});
  EXPECT_EQ(most.layers[1].layer, "Net.b");
  EXPECT_EQ(most.wall_ns, median_timing({a, b}).wall_ns);
  const IterationTiming fewer = median_timing({other, a, other, b, other});
  EXPECT_EQ(fewer.layers[1].layer, "Net.c");
  EXPECT_EQ(fewer.wall_ns, 1000);
  other.layers.pop_back();
  EXPECT_EQ(median_timing({other, a}).layers.size(), 1u);  // a tie: the first group
}

}  // namespace
}  // namespace gpucast
