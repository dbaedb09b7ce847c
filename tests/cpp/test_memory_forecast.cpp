// The memory forecast over hand-built probe traces: scaling, steady state, devices, parallel rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "gpucast/error.h"
#include "gpucast/memory_forecast.h"
#include "gpucast/trace_assembly.h"
#include "moe_routing.h"
#include "notes.h"
#include "user_error.h"

namespace gpucast {
namespace {

using test_util::codes;
using test_util::count_code;

// One training step, batch b: forward mm allocates an activation of 400 b bytes, backward allocates a
// 1000-byte gradient and frees the activation, the first optimizer step creates 1000 bytes of state.
// Held from the start: a 1000-byte parameter and a 100 b-byte input. `iterations` 1 or 2; `extra`
// adds an allocation to the forward (a different structure).
// One CPU thread's record, built in order: ops opened and closed, memory events, tags, each at the next sequence
// number.
struct Recorder {
  RawThread th;
  uint64_t seq = 1;
  std::string device = "cpu";  // of the memory events, tags and blocks held from the start
  Recorder() { th.thread = 1; }
  int64_t op(const char* name, Scope scope, Phase phase, int64_t parent = -1) {
    OpRecord o;
    o.name = name;
    o.scope = scope;
    o.phase = phase;
    o.parent = parent;
    o.start_seq = seq++;
    th.ops.push_back(o);
    return static_cast<int64_t>(th.ops.size() - 1);
  }
  void end(int64_t i) { th.ops[i].end_seq = seq++; }
  void ev(uint64_t ptr, int64_t bytes, int64_t o, Phase phase) {
    MemEvent e;
    e.seq = seq++;
    e.ptr = ptr;
    e.bytes = e.block_bytes = bytes;
    e.device = device;
    e.op = o;
    e.phase = phase;
    th.events.push_back(e);
  }
  void tag(uint64_t ptr, Category c) { th.tags.push_back(Tag{ptr, device, c, seq++}); }
  // The trace, with a parameter of 1000 bytes and an input of `input` bytes held from the start.
  // input_first: the blocks listed input first (a GPU probe lists them in address order, wherever the batch
  // landed).
  Trace finish(int64_t input, bool input_first = false) {
    AssemblyInput in;
    in.threads.push_back(th);
    in.baseline_blocks = {BaselineBlock{0x10, 1000, 1000, device}, BaselineBlock{0x20, input, input, device}};
    if (input_first) std::swap(in.baseline_blocks[0], in.baseline_blocks[1]);
    in.baseline[device] = DeviceBaseline{1000 + input, true};
    return assemble_trace(std::move(in));
  }
};

// extra: one more allocation (extra_bytes, freed at once) inside aten::mm, as another kernel would make;
// extra_op: one more top-level op (aten::relu) after it, as other control flow would run.
// chunks: that many 8-byte buffers per sample inside aten::mm, each freed at once, on threads that run no op (a
// parallel kernel's workers allocating per chunk of the batch).
// zero_grad: each iteration opens with an Optimizer.zero_grad scope (which frees the last gradient).
Trace probe(int64_t b, int iterations, bool extra = false, int64_t extra_bytes = 64, bool extra_op = false,
            int64_t chunks = 0, bool zero_grad = true) {
  Recorder r;
  r.tag(0x10, Category::Parameter);
  r.tag(0x20, Category::Input);
  for (int it = 0; it < iterations; ++it) {
    const uint64_t act = 0x100 + 0x10 * it, grad = 0x200 + 0x10 * it;
    if (zero_grad) {
      int64_t z = r.op("Optimizer.zero_grad#SGD.zero_grad", Scope::UserScope, Phase::Optimizer);
      if (it > 0) r.ev(0x200, -1000, z, Phase::Optimizer);
      r.end(z);
    }
    int64_t mm = r.op("aten::mm", Scope::Function, Phase::Forward);
    r.ev(act, 400 * b, mm, Phase::Forward);
    for (int64_t c = 0; c < chunks * b; ++c) {
      r.ev(0xA00, 8, -1, Phase::Forward);
      r.ev(0xA00, -8, -1, Phase::Forward);
    }
    if (extra) {
      r.ev(0x900, extra_bytes, mm, Phase::Forward);
      r.ev(0x900, -extra_bytes, mm, Phase::Forward);
    }
    r.end(mm);
    if (extra_op) {
      int64_t relu = r.op("aten::relu", Scope::Function, Phase::Forward);
      r.ev(0x900, 64, relu, Phase::Forward);
      r.ev(0x900, -64, relu, Phase::Forward);
      r.end(relu);
    }
    int64_t node = r.op("MmBackward0", Scope::BackwardFunction, Phase::Backward);
    r.ev(grad, 1000, node, Phase::Backward);
    r.ev(act, -400 * b, node, Phase::Backward);
    r.end(node);
    r.tag(grad, Category::Gradient);
    int64_t st = r.op("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer);
    if (it == 0) r.ev(0x300, 1000, st, Phase::Optimizer);
    r.end(st);
    r.tag(0x300, Category::OptimizerState);
  }
  return r.finish(100 * b);
}

MemoryForecast run(const std::vector<Trace>& traces, std::vector<int64_t> batches, int64_t target_batch,
                   const std::string& target = "cpu") {
  MemoryForecastInput in;
  for (const Trace& t : traces) in.probes.push_back(&t);
  in.probe_batch = std::move(batches);
  in.target_batch = target_batch;
  in.target = target;
  return forecast_memory(in);
}

TEST(MemoryForecast, ScalesTwoIterationProbesToTheTargetBatch) {
  std::vector<Trace> t = {probe(2, 2), probe(4, 2), probe(8, 2)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_TRUE(f.scaled);
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);  // param, state, new grad, input and activation
  EXPECT_EQ(f.peak_reserved_bytes, f.peak_allocated_bytes);
  EXPECT_EQ(f.first_iteration_peak_bytes, 2000 + 500 * 64);
  EXPECT_EQ(f.steady_peak_bytes, 3000 + 500 * 64);
  EXPECT_EQ(f.peak_iteration, 2);
  EXPECT_EQ(f.peak_phase, "backward");
  EXPECT_EQ(f.peak_op, "MmBackward0");
  EXPECT_EQ(f.nonlinear_allocations, 0);
  EXPECT_EQ(f.breakdown.at("activation"), 400 * 64);
  EXPECT_EQ(f.breakdown.at("input"), 100 * 64);
  EXPECT_EQ(f.breakdown.at("optimizer_state"), 1000);
}

TEST(MemoryForecast, DerivesTheSteadyIterationFromTheFirst) {
  std::vector<Trace> t = {probe(2, 1), probe(4, 1), probe(8, 1)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_EQ(f.first_iteration_peak_bytes, 2000 + 500 * 64);
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);
  EXPECT_EQ(f.peak_iteration, 2);
}

TEST(MemoryForecast, GradientsKeptWithoutAZeroGradAreSaidWithTheirBytes) {
  std::vector<Trace> without = {probe(2, 1, false, 64, false, 0, false), probe(4, 1, false, 64, false, 0, false)};
  MemoryForecast f = run(without, {2, 4}, 64);
  ASSERT_EQ(count_code(f.notes, "gradients-kept"), 1);
  for (const Note& n : f.notes) {
    if (n.code == "gradients-kept") EXPECT_NE(n.text.find("(1000 bytes)"), std::string::npos) << n.text;
  }
  // Kept into iteration 2's forward: parameter, input, state, gradient and the activation at once.
  EXPECT_EQ(f.peak_allocated_bytes, 1000 + 100 * 64 + 1000 + 1000 + 400 * 64);
  std::vector<Trace> with = {probe(2, 1), probe(4, 1)};
  EXPECT_EQ(count_code(run(with, {2, 4}, 64).notes, "gradients-kept"), 0);
  std::vector<Trace> two = {probe(2, 2, false, 64, false, 0, false), probe(4, 2, false, 64, false, 0, false)};
  EXPECT_EQ(count_code(run(two, {2, 4}, 64).notes, "gradients-kept"), 0);  // two iterations: nothing assumed
}

TEST(MemoryForecast, OneProbeScalesAllButModelStatesInProportion) {
  std::vector<Trace> t = {probe(8, 2)};
  MemoryForecast f = run(t, {8}, 64);
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);
}

TEST(MemoryForecast, ProbesThatRunOtherOpsAreNotScaled) {
  // Only the largest probe runs its ops: nothing to scale from.
  std::vector<Trace> t = {probe(2, 2, false, 64, /*extra_op=*/true), probe(4, 2, false, 64, /*extra_op=*/true),
                          probe(8, 2)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_FALSE(f.scaled);
  EXPECT_EQ(codes(f.warnings), (std::vector<std::string>{"probe-structure-differs", "probe-structure-differs"}));
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 8);
}

TEST(MemoryForecast, AProbeThatRunsOtherOpsIsLeftOutWhereTwoRunTheSame) {
  std::vector<Trace> t = {probe(2, 2), probe(4, 2, false, 64, /*extra_op=*/true), probe(8, 2)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_TRUE(f.scaled);
  EXPECT_TRUE(f.warnings.empty());
  EXPECT_EQ(count_code(f.notes, "probe-left-out"), 1);
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);  // the batch-2 and batch-8 probes' line
}

TEST(MemoryForecast, ProbesThatRunOtherKernelsAreMatchedOpByOp) {
  // Probe 4 allocates once more inside aten::mm in each iteration (another kernel's scratch): the same ops, so
  // its allocations are matched to the batch-8 probe's op by op and the forecast is the one without it.
  std::vector<Trace> t = {probe(2, 2), probe(4, 2, /*extra=*/true), probe(8, 2)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_TRUE(f.scaled);
  EXPECT_TRUE(f.warnings.empty());
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);
  ASSERT_FALSE(f.notes.empty());
  EXPECT_EQ(f.notes[0].code, "kernels-differ");
  EXPECT_NE(f.notes[0].text.find("5 of the batch-8 probe's 5 allocations matched op by op, 2 of the batch-4 probe's "
                                 "without a match"), std::string::npos);  // the counts have no field
}

TEST(MemoryForecast, AllocationsCountedByTheBatchAreMatchedWithinTheirOp) {
  // 300 buffers per sample inside aten::mm: 1200 more at batch 8 than at batch 4 in each iteration, 2400 in all,
  // beyond the 2048 unmatched allocations one matching may leave, but 1200 within each top-level op. Before, the
  // forecast gave up scaling and repeated the batch-8 probe.
  std::vector<Trace> t = {probe(2, 2, false, 64, false, 300), probe(4, 2, false, 64, false, 300),
                          probe(8, 2, false, 64, false, 300)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_TRUE(f.scaled);
  EXPECT_TRUE(f.warnings.empty());
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);
  ASSERT_GE(f.notes.size(), 2u);
  EXPECT_EQ(f.notes[0].code, "kernels-differ");
  EXPECT_NE(f.notes[0].text.find("1205 of the batch-8 probe's 4805 allocations matched op by op, 0 of the batch-2 "
                                 "probe's without a match"), std::string::npos);
  // 600 per sample: 3600 and 2400 more in each aten::mm at batch 8 than at batch 2 and 4, beyond 2048: those ops'
  // allocations in the batch-8 probe (its activation, 400 bytes per sample, among them) scale in proportion to
  // the batch, and the other ops' match.
  t = {probe(2, 2, false, 64, false, 600), probe(4, 2, false, 64, false, 600), probe(8, 2, false, 64, false, 600)};
  f = run(t, {2, 4, 8}, 64);
  EXPECT_TRUE(f.scaled);
  EXPECT_EQ(f.peak_allocated_bytes, 3000 + 500 * 64);
  ASSERT_EQ(f.notes.size(), 4u);
  EXPECT_EQ(f.notes[0].code, "kernels-differ");
  EXPECT_NE(f.notes[0].text.find("3 of the batch-8 probe's 9605 allocations matched op by op, 2402 of the batch-2 "
                                 "probe's without a match"), std::string::npos);
  EXPECT_EQ(f.notes[3].code, "ops-scaled-by-batch");
  EXPECT_NE(f.notes[3].text.find("2 top-level op(s)"), std::string::npos);
}

TEST(MemoryForecast, AnAllocationOnlyTheLargestProbeMakesScalesWithTheBatch) {
  // The batch-8 probe alone stages 40000 bytes through a buffer inside aten::mm: at batch 64 that is
  // 40000 / 8 * 64 = 320000 bytes, on top of what the second iteration's forward holds there: parameters 1000,
  // input 100 * 64, optimizer state 1000 and the activation 400 * 64 (the first iteration's gradient is freed
  // by zero_grad).
  std::vector<Trace> t = {probe(2, 2), probe(4, 2), probe(8, 2, /*extra=*/true, 40000)};
  MemoryForecast f = run(t, {2, 4, 8}, 64);
  EXPECT_TRUE(f.scaled);
  EXPECT_EQ(f.peak_allocated_bytes, 1000 + 6400 + 1000 + 25600 + 320000);
  EXPECT_EQ(f.peak_iteration, 2);
  EXPECT_EQ(f.peak_op, "aten::mm");
}

TEST(MemoryForecast, GpuTargetRoundsBlocksAndAddsTheCublasWorkspace) {
  std::vector<Trace> t = {probe(2, 2), probe(4, 2), probe(8, 2)};
  MemoryForecast f = run(t, {2, 4, 8}, 64, "H100-80GB");
  // 1024 (param) + 6656 (input 6400) + 1024 (state) + 25600 (activation) + 1024 (gradient) + 32 MiB workspace.
  EXPECT_EQ(f.peak_allocated_bytes, 1024 + 6656 + 1024 + 25600 + 1024 + 32 * kMiB);
  EXPECT_EQ(f.peak_reserved_bytes, 2 * kMiB + 32 * kMiB);  // one small segment, one 32 MiB segment
  EXPECT_EQ(f.capacity_bytes, 81559 * kMiB);
  EXPECT_EQ(f.outside_allocator_bytes, 560 * kMiB);
  EXPECT_GT(f.max_batch_size, 1000000);
}

TEST(MemoryForecast, TheLargestBatchFitsAndTheNextDoesNot) {
  // A device of 700 MiB: 90 % of it is 630 MiB, 560 MiB of that outside the allocator, 70 MiB for the run: the
  // 32 MiB cuBLAS workspace and blocks of 500 bytes per sample (input and activation), some 60,000 samples. With
  // 3 data-parallel ranks NCCL's buffers count outside the allocator too: 1000 MiB.
  std::vector<Trace> t = {probe(2, 2), probe(4, 2), probe(8, 2)};
  for (int64_t dp : {1, 3}) {
    auto at = [&](int64_t batch) {
      MemoryForecastInput in;
      for (const Trace& x : t) in.probes.push_back(&x);
      in.probe_batch = {2, 4, 8};
      in.target_batch = batch;
      in.target = "H100-80GB";
      in.capacity_bytes = (dp == 1 ? 700 : 1000) * kMiB;
      in.parallel.dp = dp;
      return forecast_memory(in);
    };
    const MemoryForecast f = at(64 * dp);
    const int64_t limit = static_cast<int64_t>((dp == 1 ? 700.0 : 1000.0) * kMiB * 0.9);
    ASSERT_GT(f.max_batch_size, 10000 * dp) << dp;
    EXPECT_EQ(f.max_batch_size % dp, 0);
    const MemoryForecast fit = at(f.max_batch_size), over = at(f.max_batch_size + dp);
    EXPECT_LE(fit.peak_reserved_bytes + fit.outside_allocator_bytes, limit) << dp;
    EXPECT_GT(over.peak_reserved_bytes + over.outside_allocator_bytes, limit) << dp;
  }
}

TEST(MemoryForecast, DataParallelRules) {
  std::vector<Trace> t = {probe(2, 2), probe(4, 2), probe(8, 2)};
  MemoryForecastInput in;
  for (const Trace& x : t) in.probes.push_back(&x);
  in.probe_batch = {2, 4, 8};
  in.target_batch = 128;
  in.parallel = ParallelConfig::parse("dp:2");
  MemoryForecast ddp = forecast_memory(in);
  EXPECT_EQ(ddp.per_rank_batch, 64);
  EXPECT_EQ(ddp.peak_allocated_bytes, 3000 + 500 * 64 + 1000);  // plus DDP's bucket copy of the gradients
  EXPECT_EQ(count_code(ddp.notes, "ddp-bucket-copy"), 1);
  // Buckets views: the buckets are still allocated, and autograd's gradients still made anew after set_to_none.
  in.parallel = ParallelConfig::parse("dp:2,gradient_as_bucket_view:True");
  MemoryForecast view = forecast_memory(in);
  EXPECT_EQ(view.peak_allocated_bytes, ddp.peak_allocated_bytes);
  EXPECT_EQ(count_code(view.notes, "ddp-bucket-view"), 1);
  EXPECT_EQ(count_code(view.notes, "ddp-bucket-copy"), 0);
  // ZeRO-1 (ZeroRedundancyOptimizer over DDP): DDP's buckets, and the optimizer state of the rank holding the most
  // parameters: with one parameter, one rank holds all of it.
  in.parallel = ParallelConfig::parse("dp:2,dp_mode:zero1");
  MemoryForecast zero1 = forecast_memory(in);
  EXPECT_EQ(zero1.peak_allocated_bytes, 1000 + 1000 + 1000 + 500 * 64 + 1000);
  // Per rank: rank 0 holds the parameter's state, rank 1 none of it.
  ASSERT_EQ(zero1.per_rank.size(), 2u);
  EXPECT_EQ(zero1.per_rank[0].ranks, std::vector<int64_t>{0});
  EXPECT_EQ(zero1.per_rank[0].peak_allocated_bytes, zero1.peak_allocated_bytes);
  EXPECT_EQ(zero1.per_rank[1].ranks, std::vector<int64_t>{1});
  EXPECT_EQ(zero1.per_rank[1].peak_allocated_bytes, zero1.peak_allocated_bytes - 1000);
  EXPECT_EQ(zero1.per_rank[1].breakdown.count("optimizer_state"), 0u);
  ASSERT_EQ(ddp.per_rank.size(), 1u);
  EXPECT_EQ(ddp.per_rank[0].ranks, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(ddp.per_rank[0].peak_allocated_bytes, ddp.peak_allocated_bytes);
  EXPECT_EQ(count_code(zero1.notes, "ddp-bucket-copy"), 1);
  EXPECT_FALSE(ddp.approximate);
  EXPECT_FALSE(zero1.approximate);
  EXPECT_EQ(count_code(zero1.warnings, "approximate-rule"), 0);
  in.parallel = ParallelConfig::parse("dp:2,dp_mode:zero2");
  MemoryForecast zero2 = forecast_memory(in);
  EXPECT_EQ(zero2.peak_allocated_bytes, 1000 + 500 + 500 + 500 * 64);
  // Rules not matched to an engine: approximate, with the reason, warned once whatever the batches searched.
  EXPECT_TRUE(zero2.approximate);
  EXPECT_EQ(zero2.approximate_reason.rfind("ZeRO-2: ", 0), 0u) << zero2.approximate_reason;
  EXPECT_EQ(count_code(zero2.warnings, "approximate-rule"), 1);
  in.parallel = ParallelConfig::parse("dp:2,dp_mode:fsdp,tp:2");
  MemoryForecast fsdp_tp = forecast_memory(in);
  EXPECT_TRUE(fsdp_tp.approximate);
  EXPECT_EQ(count_code(fsdp_tp.warnings, "approximate-rule"), 2);
  EXPECT_EQ(fsdp_tp.approximate_reason.rfind("tensor and pipeline parallelism: ", 0), 0u);
  EXPECT_NE(fsdp_tp.approximate_reason.find("; FSDP without fsdp_units: "), std::string::npos);
  in.parallel = ParallelConfig::parse("dp:2,micro_batches:4");
  EXPECT_EQ(forecast_memory(in).per_rank_batch, 16);
  // 1F1B's first stage: min(pp, micro_batches) = 2 micro-batches of 32 in flight, each saving the activations of
  // its half of the layers; model states halved.
  in.parallel = ParallelConfig::parse("pp:2,micro_batches:4");
  MemoryForecast pp = forecast_memory(in);
  EXPECT_EQ(pp.per_rank_batch, 32);
  EXPECT_EQ(pp.peak_allocated_bytes, 3000 / 2 + 500 * 32 * 2 / 2);
  EXPECT_EQ(count_code(pp.notes, "model-parallel-rule"), 1);
}

// Probes run as one rank of a job (gpucast.simulated_ranks): their memory is that rank's; no rule rewrites it, and
// per_rank names only the rank traced.
TEST(MemoryForecast, ProbesTracedAsOneRankAreThatRanksMemory) {
  std::vector<Trace> t = {probe(2, 2), probe(4, 2), probe(8, 2)};
  MemoryForecastInput in;
  for (const Trace& x : t) in.probes.push_back(&x);
  in.probe_batch = {2, 4, 8};
  in.target_batch = 128;
  in.parallel = ParallelConfig::parse("");
  const MemoryForecast single = forecast_memory(in);
  in.target_batch = 256;  // two data-parallel ranks of 128 each
  in.parallel = ParallelConfig::parse("dp:2,tp:2,dp_mode:fsdp,traced_world:4,traced_rank:3");
  const MemoryForecast traced = forecast_memory(in);
  EXPECT_EQ(traced.per_rank_batch, 128);
  EXPECT_EQ(traced.peak_allocated_bytes, single.peak_allocated_bytes);
  ASSERT_EQ(traced.per_rank.size(), 1u);
  EXPECT_EQ(traced.per_rank[0].ranks, std::vector<int64_t>{3});
  EXPECT_EQ(count_code(traced.notes, "rank-traced"), 1);
  EXPECT_EQ(count_code(traced.notes, "model-parallel-rule"), 0);
  EXPECT_FALSE(traced.approximate);
  // The same description without traced_world: the coarse tensor-parallel rule and FSDP without units, approximate.
  in.parallel = ParallelConfig::parse("dp:2,tp:2,dp_mode:fsdp");
  EXPECT_TRUE(forecast_memory(in).approximate);
}

TEST(MemoryForecast, TracedWorldMustBeTheDescribedOne) {
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("tp:2,traced_world:4"); }),
            "parallel: the probes ran as one rank of 4 (traced_world) but dp=1 x tp=2 x pp=1 is a world of 2: "
            "describe the job the ranks run");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("tp:2,traced_world:2,traced_rank:2"); }),
            "parallel: traced_rank 2 is not a rank of a world of 2");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("tp:2,traced_rank:1"); }),
            "parallel: traced_rank 1 without traced_world: the rank of which world?");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("pp:2,micro_batches:4,traced_world:2"); }),
            "parallel: micro_batches=4 with a pipeline stage traced as one rank: its schedule splits each step's batch "
            "into micro-batches itself; give them to the schedule, not to parallel");
  EXPECT_EQ(test_util::user_error([] { ParallelConfig::parse("dp:4294967296,tp:4294967296"); }),
            "parallel: dp=4294967296 x tp=4294967296 x pp=1 is more ranks than can be counted");
  const ParallelConfig p = ParallelConfig::parse("pp:2,traced_world:2,traced_rank:1");
  EXPECT_EQ(p.traced_world, 2);
  EXPECT_EQ(p.traced_rank, 1);
}

// Parameters of 700, 500, 400 and 300 bytes over two ranks, largest first to the emptier rank: {700, 300} and
// {500, 400}, so the largest rank holds 1000 of 1900 bytes, and that share of the optimizer state.
TEST(MemoryForecast, ZeroOneStateFollowsTheParametersPartition) {
  Recorder r;
  const std::vector<int64_t> params = {700, 500, 400, 300};
  for (size_t i = 0; i < params.size(); ++i) r.tag(0x1000 + 0x100 * i, Category::Parameter);
  int64_t st = r.op("Optimizer.step#Adam.step", Scope::UserScope, Phase::Optimizer);
  r.ev(0x5000, 3800, st, Phase::Optimizer);  // Adam's two tensors per parameter, one block here
  r.end(st);
  r.tag(0x5000, Category::OptimizerState);
  AssemblyInput in;
  in.threads.push_back(r.th);
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    in.baseline_blocks.push_back(BaselineBlock{0x1000 + 0x100 * i, params[i], params[i], "cpu"});
    total += params[i];
  }
  in.baseline["cpu"] = DeviceBaseline{total, true};
  const Trace t = assemble_trace(std::move(in));
  MemoryForecastInput f;
  f.probes = {&t};
  f.probe_batch = {2};
  f.target_batch = 2;
  f.parallel = ParallelConfig::parse("dp:2,dp_mode:zero1,gradient_as_bucket_view:True");
  const MemoryForecast zero1 = forecast_memory(f);
  // Parameters, DDP's buckets (sized by the parameters: no gradients here), 1000/1900 of the state, and the rank's
  // largest parameter (700) held through the step, for its step temporaries in the partition's order.
  EXPECT_EQ(zero1.peak_allocated_bytes, 1900 + 1900 + 2000 + 700);
  EXPECT_EQ(count_code(zero1.notes, "zero1-step-order"), 1);
  // Rank 1 holds {500, 400}: 900/1900 of the state, its largest parameter 500.
  ASSERT_EQ(zero1.per_rank.size(), 2u);
  EXPECT_EQ(zero1.per_rank[1].ranks, std::vector<int64_t>{1});
  EXPECT_EQ(zero1.per_rank[1].peak_allocated_bytes, 1900 + 1900 + 1800 + 500);
  f.parallel = ParallelConfig::parse("dp:2,dp_mode:zero2");
  EXPECT_EQ(forecast_memory(f).peak_allocated_bytes, 1900 + 1900);  // every tensor halved
}

TEST(MemoryForecast, BadInput) {
  std::vector<Trace> t = {probe(2, 1)};
  EXPECT_THROW(run(t, {2}, 0), UserError);
  {
    MemoryForecastInput in;
    in.probes = {&t[0]};
    in.probe_batch = {2};
    in.target_batch = 30;
    in.parallel = ParallelConfig::parse("dp:4");
    EXPECT_EQ(test_util::user_error([&] { forecast_memory(in); }),
              "parallel: dp=4 x micro_batches=1 does not divide batch_size 30: give a batch_size that is a multiple "
              "of 4");
  }
  try {
    run(t, {2}, 8, "H100");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "unknown target 'H100'; known targets: cpu, A100-40GB, A100-80GB, H100-80GB, H200-141GB, L4, "
                 "V100-32GB, RTX-4090 (or give a capacity for another GPU)");
  }
  try {
    ParallelConfig::parse("dp:2,dp_mode:zero3");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "parallel: option 'dp_mode' expects one of ddp|zero1|zero2|fsdp, got 'zero3'");
  }
}

TEST(CublasWorkspace, DefaultsAndOverride) {
  EXPECT_EQ(cublas_workspace_bytes(90, ""), 32 * kMiB);
  EXPECT_EQ(cublas_workspace_bytes(80, ""), 8 * kMiB + 128 * 1024);
  EXPECT_EQ(cublas_workspace_bytes(90, ":4096:8"), 32 * kMiB);
  EXPECT_EQ(cublas_workspace_bytes(80, ":4096:2:16:8"), 8 * kMiB + 128 * 1024);
  EXPECT_THROW(cublas_workspace_bytes(80, "4096:8"), UserError);
}

}  // namespace
}  // namespace gpucast

namespace gpucast {
namespace {

// Probe (b, L): an activation of 10 b L + 3 b L^2 bytes (attention weights grow with L^2), a 64 L-byte
// position buffer, and a 1000-byte parameter held from the start.
Trace seq_probe(int64_t b, int64_t l) {
  AssemblyInput in;
  RawThread th;
  th.thread = 1;
  OpRecord fwd;
  fwd.name = "aten::bmm";
  fwd.start_seq = 1;
  fwd.end_seq = 6;
  OpRecord step;
  step.name = "Optimizer.step#SGD.step";
  step.scope = Scope::UserScope;
  step.phase = Phase::Optimizer;
  step.start_seq = 7;
  step.end_seq = 8;
  th.ops = {fwd, step};
  auto ev = [](uint64_t seq, uint64_t ptr, int64_t bytes) {
    MemEvent e;
    e.seq = seq;
    e.ptr = ptr;
    e.bytes = e.block_bytes = bytes;
    e.device = "cpu";
    e.op = 0;
    return e;
  };
  th.events = {ev(2, 0x100, 64 * l), ev(3, 0x200, 10 * b * l + 3 * b * l * l),
               ev(4, 0x200, -(10 * b * l + 3 * b * l * l)), ev(5, 0x100, -64 * l)};
  th.tags.push_back(Tag{0x10, "cpu", Category::Parameter, 1});
  in.threads.push_back(th);
  in.baseline_blocks = {BaselineBlock{0x10, 1000, 1000, "cpu"}};
  return assemble_trace(std::move(in));
}

TEST(MemoryForecast, ScalesBySequenceLength) {
  const std::vector<std::pair<int64_t, int64_t>> design = {{2, 8}, {4, 8}, {8, 8}, {2, 16}, {2, 24}, {4, 24}};
  std::vector<Trace> traces;
  for (auto [b, l] : design) traces.push_back(seq_probe(b, l));
  MemoryForecastInput in;
  for (size_t i = 0; i < design.size(); ++i) {
    in.probes.push_back(&traces[i]);
    in.probe_batch.push_back(design[i].first);
    in.probe_seq.push_back(design[i].second);
  }
  in.target_batch = 64;
  in.target_seq = 100;
  MemoryForecast f = forecast_memory(in);
  EXPECT_TRUE(f.scaled);
  EXPECT_EQ(f.nonlinear_allocations, 0);
  EXPECT_EQ(f.seq_len, 100);
  EXPECT_EQ(f.peak_allocated_bytes, 1000 + 64 * 100 + 10 * 64 * 100 + 3 * 64 * 100 * 100);
  in.probes.resize(4);
  in.probe_batch.resize(4);
  in.probe_seq.resize(4);
  try {
    forecast_memory(in);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "forecast: scaling by sequence length needs at least 5 probes, got 4");
  }
}

}  // namespace
}  // namespace gpucast

namespace gpucast {
namespace {

// The end of conv_probe's and mm_probe's step: the backward node frees the activation (2048 b bytes at 0x100),
// the gradient at 0x200 is tagged, the first SGD step creates 1024 bytes of state.
Trace end_backward_and_step(Recorder& r, int64_t node, int64_t b, bool input_first = false) {
  r.ev(0x100, -2048 * b, node, Phase::Backward);
  r.end(node);
  r.tag(0x200, Category::Gradient);
  const int64_t st = r.op("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer);
  r.ev(0x300, 1024, st, Phase::Optimizer);
  r.end(st);
  r.tag(0x300, Category::OptimizerState);
  return r.finish(100 * b, input_first);
}

// A convolution step, batch b, probed on the CPU: aten::conv2d > aten::mkldnn_convolution allocates the
// activation (2048 b bytes) and a scratch buffer it frees before returning (1024 b); the backward node's
// aten::convolution_backward allocates the weight's gradient (1024) and scratch of 3072 b, freed inside;
// the node then frees the activation; the first SGD step creates 1024 bytes of state. Held from the start:
// a 1000-byte parameter and a 100 b-byte input.
// gpu: the same step probed on the GPU: aten::cudnn_convolution instead, the scratch being cuDNN's workspaces,
// in module Net.conv, on cuda:0 (input_first: Recorder::finish).
Trace conv_probe(int64_t b, bool gpu = false, bool input_first = false) {
  Recorder r;
  if (gpu) r.device = "cuda:0";
  r.tag(0x10, Category::Parameter);
  r.tag(0x20, Category::Input);
  r.end(r.op("Optimizer.zero_grad#SGD.zero_grad", Scope::UserScope, Phase::Optimizer));
  const int64_t conv = r.op("aten::conv2d", Scope::Function, Phase::Forward);
  const int64_t inner =
      r.op(gpu ? "aten::cudnn_convolution" : "aten::mkldnn_convolution", Scope::Function, Phase::Forward, conv);
  r.ev(0x100, 2048 * b, inner, Phase::Forward);
  r.ev(0x800, 1024 * b, inner, Phase::Forward);
  r.ev(0x800, -1024 * b, inner, Phase::Forward);
  r.end(inner);
  r.end(conv);
  const int64_t node = r.op("ConvolutionBackward0", Scope::BackwardFunction, Phase::Backward);
  const int64_t bwd = r.op("aten::convolution_backward", Scope::Function, Phase::Backward, node);
  if (gpu) r.th.ops[conv].module = r.th.ops[inner].module = r.th.ops[bwd].module = "Net.conv";
  r.ev(0x200, 1024, bwd, Phase::Backward);
  r.ev(0x900, 3072 * b, bwd, Phase::Backward);
  r.ev(0x900, -3072 * b, bwd, Phase::Backward);
  r.end(bwd);
  return end_backward_and_step(r, node, b, input_first);
}

Trace gpu_conv_probe(int64_t b, bool input_first = false) { return conv_probe(b, true, input_first); }

MemoryForecast run_conv(const std::string& target, int64_t workspace = -1, const std::string& wscap = "") {
  static const std::vector<Trace> t = {conv_probe(2), conv_probe(4), conv_probe(8)};
  MemoryForecastInput in;
  for (const Trace& x : t) in.probes.push_back(&x);
  in.probe_batch = {2, 4, 8};
  in.target_batch = 64;
  in.target = target;
  in.conv_workspace_bytes = workspace;
  in.cudnn_conv_wscap = wscap;
  return forecast_memory(in);
}

TEST(MemoryForecast, CpuTargetKeepsTheCpuConvolutionScratch) {
  MemoryForecast f = run_conv("cpu");
  // Iteration 2, inside convolution_backward: parameter, input, state, activation, gradient and its scratch.
  EXPECT_EQ(f.peak_allocated_bytes, 1000 + 6400 + 1024 + 2048 * 64 + 1024 + 3072 * 64);
  EXPECT_EQ(f.conv_calls, 0);
  EXPECT_EQ(f.conv_workspace_headroom_allocated_bytes, -1);
}

TEST(MemoryForecast, GpuTargetReplacesCpuConvolutionScratchByTheWorkspaceHeadroom) {
  MemoryForecast f = run_conv("H100-80GB");
  // Blocks: parameter 1024, input 6656 (6400 rounded), state 1024, activation 131072, gradient 1024; the CPU
  // scratch is left out. Iteration 2's backward holds them all at once.
  EXPECT_EQ(f.peak_allocated_bytes, 1024 + 6656 + 1024 + 131072 + 1024);
  EXPECT_EQ(f.peak_reserved_bytes, 2 * kMiB);  // one small-pool segment
  EXPECT_EQ(f.peak_op, "aten::convolution_backward");
  EXPECT_EQ(f.conv_calls, 2);
  EXPECT_EQ(f.conv_workspace_bytes, -1);
  // The last backward convolution runs at the allocated peak: any workspace raises it. Under the reserved
  // peak, a workspace fits in the small segment's free remainder, whose blocks serve requests up to 1 MiB.
  EXPECT_EQ(f.conv_workspace_headroom_allocated_bytes, 0);
  EXPECT_EQ(f.conv_workspace_headroom_reserved_bytes, kMiB);
  ASSERT_FALSE(f.notes.empty());
  EXPECT_EQ(f.notes.back().code, "conv-workspace-unmodelled");
}

TEST(MemoryForecast, GpuTargetModelsAGivenConvolutionWorkspace) {
  MemoryForecast f = run_conv("H100-80GB", 4096);
  EXPECT_EQ(f.peak_allocated_bytes, 1024 + 6656 + 1024 + 131072 + 1024 + 4096);
  EXPECT_EQ(f.peak_reserved_bytes, 2 * kMiB);
  EXPECT_EQ(f.conv_workspace_bytes, 4096);
  EXPECT_EQ(f.conv_workspace_headroom_allocated_bytes, -1);
  EXPECT_EQ(count_code(f.notes, "conv-workspace-modelled"), 1);
  // CUDNN_CONV_WSCAP_DBG's cap, in MiB, stands for an unknown workspace (an upper bound); 3 MiB needs a
  // large-pool segment of 20 MiB.
  MemoryForecast c = run_conv("H100-80GB", -1, "3");
  EXPECT_EQ(c.peak_allocated_bytes, 1024 + 6656 + 1024 + 131072 + 1024 + 3 * kMiB);
  EXPECT_EQ(c.peak_reserved_bytes, 2 * kMiB + 20 * kMiB);
  EXPECT_EQ(c.conv_workspace_bytes, 3 * kMiB);
  EXPECT_EQ(run_conv("H100-80GB", 4096, "3").conv_workspace_bytes, 4096);  // conv_workspace wins
}

// conv_probe's step as a linear layer: aten::addmm inside aten::linear, aten::mm inside AddmmBackward0, each with
// its scratch (1024 b and 3072 b bytes, allocated and freed inside the call).
Trace mm_probe(int64_t b) {
  Recorder r;
  r.tag(0x10, Category::Parameter);
  r.tag(0x20, Category::Input);
  r.end(r.op("Optimizer.zero_grad#SGD.zero_grad", Scope::UserScope, Phase::Optimizer));
  const int64_t linear = r.op("aten::linear", Scope::Function, Phase::Forward);
  const int64_t addmm = r.op("aten::addmm", Scope::Function, Phase::Forward, linear);
  r.ev(0x100, 2048 * b, addmm, Phase::Forward);
  r.ev(0x800, 1024 * b, addmm, Phase::Forward);
  r.ev(0x800, -1024 * b, addmm, Phase::Forward);
  r.end(addmm);
  r.end(linear);
  const int64_t node = r.op("AddmmBackward0", Scope::BackwardFunction, Phase::Backward);
  const int64_t mm = r.op("aten::mm", Scope::Function, Phase::Backward, node);
  r.ev(0x900, 3072 * b, mm, Phase::Backward);  // scratch before the output, freed before it returns
  r.ev(0x900, -3072 * b, mm, Phase::Backward);
  r.ev(0x200, 1024, mm, Phase::Backward);
  r.end(mm);
  return end_backward_and_step(r, node, b);
}

TEST(MemoryForecast, CpuTargetTakesTheMatrixMultipliesScratchMeasuredAtTheTargetBatch) {
  static const std::vector<Trace> t = {mm_probe(2), mm_probe(4), mm_probe(8)};
  MemoryForecastInput in;
  for (const Trace& x : t) in.probes.push_back(&x);
  in.probe_batch = {2, 4, 8};
  in.target_batch = 64;
  in.target = "cpu";
  const Trace& ref = t.back();
  auto index_of = [&](const std::string& name) {
    for (size_t i = 0; i < ref.ops.size(); ++i) {
      if (ref.ops[i].name == name) return static_cast<int64_t>(i);
    }
    return int64_t{-1};
  };
  // The probes' scratch, scaled: the backward multiply's 3072 x 64 before its 1024-byte output, in iteration 2
  // with the parameter, the input, the optimizer state and the activation held.
  const int64_t held = 1000 + 6400 + 1024 + 2048 * 64;
  EXPECT_EQ(forecast_memory(in).peak_allocated_bytes, held + 3072 * 64);
  // Measured at batch 64: none in the forward call, 5000 bytes in the backward one, over its output.
  in.op_workspaces = {{index_of("aten::addmm"), 0}, {index_of("aten::mm"), 5000}};
  in.op_workspace_batch = 64;
  const MemoryForecast f = forecast_memory(in);
  EXPECT_EQ(f.peak_allocated_bytes, held + 1024 + 5000);
  EXPECT_EQ(f.peak_op, "aten::mm");
  EXPECT_EQ(count_code(f.notes, "op-workspace-measured"), 1);
  // Measured at another batch: the probes' scratch is kept.
  in.op_workspace_batch = 32;
  EXPECT_EQ(forecast_memory(in).peak_allocated_bytes, held + 3072 * 64);
}

// The forecast input for three probes on cuda:0 at batch 2, 4, 8, for an H100 at batch 64.
MemoryForecastInput gpu_input(const std::vector<Trace>& t) {
  MemoryForecastInput in;
  for (const Trace& x : t) in.probes.push_back(&x);
  in.probe_batch = {2, 4, 8};
  in.target_batch = 64;
  in.target = "H100-80GB";
  in.probe_device = "cuda:0";
  return in;
}

MemoryForecast run_gpu_conv(const std::map<std::string, int64_t>& measured) {
  static const std::vector<Trace> t = {gpu_conv_probe(2), gpu_conv_probe(4), gpu_conv_probe(8)};
  MemoryForecastInput in = gpu_input(t);
  in.conv_workspaces = measured;
  return forecast_memory(in);
}

TEST(MemoryForecast, GpuProbesKeepTheirWorkspacesAndReportTheHeadroom) {
  MemoryForecast f = run_gpu_conv({});
  // Blocks at iteration 2's backward convolution: parameter 1024, input 6656, state 1024, activation 131072,
  // gradient 1024, and the workspace fitted over the probes: 3072 * 64 = 196608.
  EXPECT_EQ(f.peak_allocated_bytes, 1024 + 6656 + 1024 + 131072 + 1024 + 196608);
  EXPECT_EQ(f.conv_calls, 2);
  EXPECT_EQ(f.conv_calls_measured, 0);
  EXPECT_EQ(f.conv_workspace_headroom_allocated_bytes, 196608);  // the backward's own workspace fits under it
  EXPECT_EQ(count_code(f.notes, "conv-workspace-headroom"), 1);
}

TEST(MemoryForecast, GpuProbesMatchTheBlocksHeldAtTheStartByCategory) {
  // The batch-4 probe lists its input before the parameter (its batch landed at a lower address): matched by
  // category, the forecast is the one of probes that list them alike, and the parameter stays a parameter.
  const std::vector<Trace> t = {gpu_conv_probe(2), gpu_conv_probe(4, /*input_first=*/true), gpu_conv_probe(8)};
  MemoryForecastInput in = gpu_input(t);
  const MemoryForecast f = forecast_memory(in);
  EXPECT_EQ(f.peak_allocated_bytes, run_gpu_conv({}).peak_allocated_bytes);
  EXPECT_EQ(f.breakdown.at("parameter"), 1024);
  EXPECT_EQ(f.breakdown.at("input"), 6656);
  // Under a parallel strategy too: FSDP's rules see the same parameter as with probes that list them alike.
  in.parallel.dp = 2;
  in.parallel.dp_mode = "fsdp";
  in.target_batch = 128;
  const std::vector<Trace> alike = {gpu_conv_probe(2), gpu_conv_probe(4), gpu_conv_probe(8)};
  MemoryForecastInput same = in;
  same.probes.clear();
  for (const Trace& x : alike) same.probes.push_back(&x);
  const MemoryForecast g = forecast_memory(in), h = forecast_memory(same);
  EXPECT_EQ(g.peak_allocated_bytes, h.peak_allocated_bytes);
  EXPECT_EQ(g.breakdown, h.breakdown);
}

// A CUDA probe holding two 600 KiB parameters and a batch-sized input from the start, listed in address order
// (the batch-4 probe's input first); its step allocates 4 KiB per sample and frees it.
Trace gpu_blocks_probe(int64_t b) {
  Recorder r;
  r.device = "cuda:0";
  r.tag(0x10, Category::Parameter);
  r.tag(0x20, Category::Parameter);
  r.tag(0x30, Category::Input);
  int64_t mm = r.op("aten::mm", Scope::Function, Phase::Forward);
  r.ev(0x100, 4096 * b, mm, Phase::Forward);
  r.ev(0x100, -4096 * b, mm, Phase::Forward);
  r.end(mm);
  int64_t st = r.op("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer);
  r.end(st);
  AssemblyInput in;
  in.threads.push_back(r.th);
  const int64_t p = 600 * 1024;
  in.baseline_blocks = {BaselineBlock{0x10, p, p, "cuda:0"}, BaselineBlock{0x20, p, p, "cuda:0"},
                        BaselineBlock{0x30, 512 * b, 512 * b, "cuda:0"}};
  if (b == 4) std::rotate(in.baseline_blocks.begin(), in.baseline_blocks.begin() + 2, in.baseline_blocks.end());
  in.baseline["cuda:0"] = DeviceBaseline{2 * p + 512 * b, true};
  return assemble_trace(std::move(in));
}

TEST(MemoryForecast, GpuProbesPlaceTheBlocksHeldAtTheStartOneByOne) {
  // Each parameter is a small-pool request (at most 1 MiB): one 2 MiB segment holds both, the input (batch 64:
  // 32 KiB) and the step's 256 KiB. Summed per category, the parameters would be one 1.17 MiB large-pool request
  // in a 20 MiB segment.
  const std::vector<Trace> t = {gpu_blocks_probe(2), gpu_blocks_probe(4), gpu_blocks_probe(8)};
  MemoryForecastInput in = gpu_input(t);
  const MemoryForecast f = forecast_memory(in);
  EXPECT_TRUE(f.scaled);
  EXPECT_TRUE(f.warnings.empty());
  EXPECT_EQ(f.peak_allocated_bytes, 2 * 600 * 1024 + 512 * 64 + 4096 * 64);
  EXPECT_EQ(f.peak_reserved_bytes, 2 * kMiB);
  EXPECT_EQ(f.breakdown.at("parameter"), 2 * 600 * 1024);
  EXPECT_EQ(f.breakdown.at("input"), 512 * 64);
}

TEST(MemoryForecast, GpuProbesTakeWorkspacesMeasuredAtTheTargetBatch) {
  // cuDNN took another algorithm at batch 64: 4 MiB in the backward call, none in the forward one. They replace
  // what the probes' calls took inside; the 4 MiB request takes a 20 MiB large-pool segment beside the 2 MiB
  // small-pool one.
  MemoryForecast f = run_gpu_conv({{"Net.conv|forward", 0}, {"Net.conv|backward", 4 * kMiB}});
  EXPECT_EQ(f.peak_allocated_bytes, 1024 + 6656 + 1024 + 131072 + 1024 + 4 * kMiB);
  EXPECT_EQ(f.peak_reserved_bytes, 2 * kMiB + 20 * kMiB);
  EXPECT_EQ(f.peak_op, "aten::convolution_backward");
  EXPECT_EQ(f.conv_calls, 2);
  EXPECT_EQ(f.conv_calls_measured, 2);
  EXPECT_EQ(f.conv_workspace_headroom_allocated_bytes, -1);
  EXPECT_EQ(count_code(f.notes, "conv-workspace-measured"), 1);
  // A call without a measurement keeps the probes' workspace, and the headroom is reported for it alone.
  MemoryForecast g = run_gpu_conv({{"Net.conv|forward", 0}});
  EXPECT_EQ(g.conv_calls_measured, 1);
  EXPECT_EQ(g.peak_allocated_bytes, f.peak_allocated_bytes - 4 * kMiB + 196608);
  EXPECT_GE(g.conv_workspace_headroom_allocated_bytes, 0);
}

// A step, batch b, on `device`: aten::native_batch_norm allocates its output (512 b bytes) and 256 b bytes of
// scratch through a nested aten::empty, freed before it returns; then, with the output held, a composite
// (aten::dropout) wraps a double scalar as a tensor (a wrapped number: 8 bytes on the CPU) for the aten::mul inside
// it, where TensorIterator casts it into a 4-byte temporary (aten::to), each freed by the op that made it; the backward node frees the output; an SGD step creates 1024 bytes of
// state and a step count: 64 bytes of state held on the CPU whatever `device` is (as a meta job's is).
// scratch false: the step without the scratch, the wrapped scalar and the cast.
Trace kernel_probe(int64_t b, const std::string& device, bool scratch = true) {
  Recorder r;
  r.device = device;
  r.tag(0x10, Category::Parameter);
  r.tag(0x20, Category::Input);
  r.end(r.op("Optimizer.zero_grad#SGD.zero_grad", Scope::UserScope, Phase::Optimizer));
  const int64_t bn = r.op("aten::native_batch_norm", Scope::Function, Phase::Forward);
  r.ev(0x100, 512 * b, bn, Phase::Forward);
  if (scratch) {
    const int64_t empty = r.op("aten::empty", Scope::Function, Phase::Forward, bn);
    r.ev(0x800, 256 * b, empty, Phase::Forward);
    r.end(empty);
    r.ev(0x800, -256 * b, bn, Phase::Forward);
  }
  r.end(bn);
  if (scratch) {
    r.device = "cpu";
    const int64_t composite = r.op("aten::dropout", Scope::Function, Phase::Forward);
    r.ev(0x900, 8, composite, Phase::Forward);  // the wrapped scalar, made by the composite around aten::mul
    const int64_t mul = r.op("aten::mul", Scope::Function, Phase::Forward, composite);
    const int64_t to = r.op("aten::to", Scope::Function, Phase::Forward, mul);
    r.ev(0xa00, 4, to, Phase::Forward);
    r.end(to);
    r.ev(0xa00, -4, mul, Phase::Forward);
    r.end(mul);
    r.ev(0x900, -8, composite, Phase::Forward);
    r.end(composite);
    r.device = device;
  }
  const int64_t node = r.op("NativeBatchNormBackward0", Scope::BackwardFunction, Phase::Backward);
  r.ev(0x100, -512 * b, node, Phase::Backward);
  r.end(node);
  const int64_t st = r.op("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer);
  r.ev(0x300, 1024, st, Phase::Optimizer);
  r.tag(0x300, Category::OptimizerState);
  r.device = "cpu";
  r.ev(0x310, 64, st, Phase::Optimizer);
  r.tag(0x310, Category::OptimizerState);
  r.device = device;
  r.end(st);
  return r.finish(100 * b);
}

MemoryForecast run_kernel(const std::string& target, const std::string& device, bool scratch = true) {
  std::vector<Trace> t;
  for (int64_t b : {2, 4, 8}) t.push_back(kernel_probe(b, device, scratch));
  MemoryForecastInput in;
  for (const Trace& x : t) in.probes.push_back(&x);
  in.probe_batch = {2, 4, 8};
  in.target_batch = 64;
  in.target = target;
  in.probe_device = device;
  return forecast_memory(in);
}

TEST(MemoryForecast, GpuTargetFromHostProbesLeavesOutTheCpuKernelsOwnScratch) {
  // The CPU target keeps what its kernels allocate: parameter, input, state, step count, output and scratch.
  EXPECT_EQ(run_kernel("cpu", "cpu").peak_allocated_bytes, 1000 + 6400 + 1024 + 64 + 512 * 64 + 256 * 64);
  // A GPU target holds neither the batch norm's scratch nor the wrapped scalar and its cast (each would be a
  // 512-byte block beside the output, at the peak).
  const MemoryForecast gpu = run_kernel("H100-80GB", "cpu");
  EXPECT_EQ(gpu.peak_allocated_bytes, 1024 + 6656 + 1024 + 512 + 512 * 64);
  EXPECT_EQ(gpu.peak_allocated_bytes, run_kernel("H100-80GB", "cpu", false).peak_allocated_bytes);
  EXPECT_EQ(gpu.peak_reserved_bytes, run_kernel("H100-80GB", "cpu", false).peak_reserved_bytes);
}

TEST(MemoryForecast, MetaProbesAreReadAsHostProbesWithTheirCpuBlocks) {
  // A meta job's blocks are meta but its step count is a CPU tensor: the stream holds both (without the step
  // count, 512 bytes less), and forecasts as CPU probes of the same step do.
  const MemoryForecast meta = run_kernel("H100-80GB", "meta");
  const MemoryForecast cpu = run_kernel("H100-80GB", "cpu");
  EXPECT_EQ(meta.peak_allocated_bytes, cpu.peak_allocated_bytes);
  EXPECT_EQ(meta.peak_reserved_bytes, cpu.peak_reserved_bytes);
  EXPECT_EQ(meta.max_batch_size, cpu.max_batch_size);
  try {
    run_kernel("cpu", "meta");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "forecast: probes on the meta device forecast a GPU target (target='H100-80GB', ...); "
                           "target 'cpu' is forecast from probes on the CPU");
  }
}

TEST(MemoryForecast, BadConvolutionWorkspace) {
  try {
    run_conv("H100-80GB", -1, "256MB");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "CUDNN_CONV_WSCAP_DBG: expected a whole number of MiB such as '256', got '256MB'");
  }
  try {
    run_conv("H100-80GB", -5);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "forecast: conv_workspace must be a number of bytes of at least 0, got -5");
  }
  EXPECT_EQ(cudnn_conv_wscap_bytes(""), -1);
  EXPECT_EQ(cudnn_conv_wscap_bytes("0"), 0);
}

}  // namespace
}  // namespace gpucast

namespace gpucast {
namespace {

// A routed layer (mixture of experts) over 4 b tokens of 8 features, top-2 of 4 experts, the loads hand-made (their
// sum 8 b; an expert of load 0 is not run, as transformers' Mixtral loops over the experts hit). Per iteration: the
// router's logits (16 bytes a token, freed in backward); per expert: the rows picked for it (32 bytes a row, freed
// once the expert ran), its output (64 a row, saved for backward), the output weighed (16 a row, scratch of the
// weighing); backward: each expert's gradient (64 a row, scratch) and its output freed; SGD state at the first step.
Trace moe_probe(int64_t b, const std::vector<int64_t>& loads, int iterations = 2) {
  Recorder r;
  r.tag(0x10, Category::Parameter);
  r.tag(0x20, Category::Input);
  auto tensor = [](std::vector<int64_t> shape) {
    Value v;
    v.kind = Value::Kind::Tensor;
    v.tensors.push_back(TensorMeta{std::move(shape), {}, "float32", "cpu", 0});
    return v;
  };
  const int64_t tokens = 4 * b;
  for (int it = 0; it < iterations; ++it) {
    const uint64_t base = 0x1000 * static_cast<uint64_t>(it + 1);
    const int64_t gate = r.op("aten::linear", Scope::Function, Phase::Forward);
    r.th.ops[static_cast<size_t>(gate)].module = "Net.moe.gate";
    r.th.ops[static_cast<size_t>(gate)].inputs = {tensor({tokens, 8})};
    r.ev(base, 16 * tokens, gate, Phase::Forward);
    r.end(gate);
    for (size_t e = 0; e < loads.size(); ++e) {
      const int64_t n = loads[e];
      if (n == 0) continue;
      const int64_t pick = r.op("aten::index", Scope::Function, Phase::Forward);
      r.th.ops[static_cast<size_t>(pick)].module = "Net.moe";
      r.th.ops[static_cast<size_t>(pick)].inputs = {tensor({tokens, 8})};
      r.ev(base + 0x10 + e, 32 * n, pick, Phase::Forward);
      r.end(pick);
      const int64_t expert = r.op("aten::linear", Scope::Function, Phase::Forward);
      OpRecord& op = r.th.ops[static_cast<size_t>(expert)];
      op.module = "Net.moe.experts." + std::to_string(e);
      op.inputs = {tensor({n, 8})};
      op.seq_nr = 100 * it + static_cast<int64_t>(e);
      r.ev(base + 0x20 + e, 64 * n, expert, Phase::Forward);
      r.ev(base + 0x10 + e, -32 * n, expert, Phase::Forward);
      r.end(expert);
      const int64_t weigh = r.op("aten::mul", Scope::Function, Phase::Forward);
      r.th.ops[static_cast<size_t>(weigh)].module = "Net.moe";
      r.th.ops[static_cast<size_t>(weigh)].inputs = {tensor({n, 8})};
      r.ev(base + 0x30 + e, 16 * n, weigh, Phase::Forward);
      r.ev(base + 0x30 + e, -16 * n, weigh, Phase::Forward);
      r.end(weigh);
    }
    for (size_t e = loads.size(); e-- > 0;) {
      const int64_t n = loads[e];
      if (n == 0) continue;
      const int64_t node = r.op("LinearBackward0", Scope::BackwardFunction, Phase::Backward);
      r.th.ops[static_cast<size_t>(node)].seq_nr = 100 * it + static_cast<int64_t>(e);
      r.th.ops[static_cast<size_t>(node)].fwd_thread = 1;
      r.ev(base + 0x40 + e, 64 * n, node, Phase::Backward);
      r.ev(base + 0x40 + e, -64 * n, node, Phase::Backward);
      r.ev(base + 0x20 + e, -64 * n, node, Phase::Backward);
      r.end(node);
    }
    const int64_t gate_node = r.op("AddmmBackward0", Scope::BackwardFunction, Phase::Backward);
    r.ev(base, -16 * tokens, gate_node, Phase::Backward);
    r.end(gate_node);
    const int64_t st = r.op("Optimizer.step#SGD.step", Scope::UserScope, Phase::Optimizer);
    if (it == 0) r.ev(0x300, 1000, st, Phase::Optimizer);
    r.end(st);
    r.tag(0x300, Category::OptimizerState);
  }
  return r.finish(32 * b);
}

// The probes' hand-made routings: uneven, the sum 8 b.
std::vector<Trace> moe_probes() {
  return {moe_probe(2, {5, 3, 6, 2}), moe_probe(4, {9, 7, 10, 6}), moe_probe(8, {20, 12, 17, 15})};
}

MemoryForecast run_moe(const std::vector<Trace>& probes, int64_t target, double skew = 1.0) {
  MemoryForecastInput in;
  for (const Trace& t : probes) in.probes.push_back(&t);
  in.probe_batch = {2, 4, 8};
  in.target_batch = target;
  in.moe_skew = skew;
  return forecast_memory(in);
}

// A trace's own peak: the forecast at its batch from it alone.
int64_t peak_of(const Trace& t, int64_t b) { return run({t}, {b}, b).peak_allocated_bytes; }

TEST(MoeRouting, RoutedCallsAreFoundWithTheirLoadsAndTokens) {
  const Trace t = moe_probe(2, {5, 3, 6, 2});
  const std::vector<detail::RoutedCall> calls = detail::find_routed_calls(t);
  ASSERT_EQ(calls.size(), 2u);  // one per iteration
  EXPECT_EQ(calls[0].container, "Net.moe.experts");
  EXPECT_EQ(calls[0].tokens, 8);
  ASSERT_EQ(calls[0].units.size(), 4u);
  EXPECT_EQ(calls[0].units[2].path, "Net.moe.experts.2");
  EXPECT_EQ(calls[0].units[2].load, 6);
  EXPECT_EQ(calls[0].top_k(), 2);
  // An op inside expert 1 belongs to it; the weighing after expert 1 lies between experts 1 and 2; its backward
  // node belongs where its forward op ran; the router before every expert, to none before expert 0.
  int64_t expert1 = -1, weigh1 = -1, node1 = -1, gate = -1;
  for (const OpRecord& op : t.ops) {
    if (op.module == "Net.moe.experts.1" && op.phase == Phase::Forward && expert1 < 0) expert1 = op.id;
    if (op.name == "aten::mul" && expert1 >= 0 && weigh1 < 0) weigh1 = op.id;
    if (op.name == "LinearBackward0" && op.fwd_op == expert1 && expert1 >= 0) node1 = op.id;
    if (op.module == "Net.moe.gate" && gate < 0) gate = op.id;
  }
  const detail::RoutedPlace in = detail::routed_place(t, calls, expert1);
  EXPECT_EQ(in.call, 0);
  EXPECT_EQ(in.before, 1);
  EXPECT_EQ(in.after, 1);
  const detail::RoutedPlace between = detail::routed_place(t, calls, weigh1);
  EXPECT_EQ(between.before, 1);
  EXPECT_EQ(between.after, 2);
  const detail::RoutedPlace back = detail::routed_place(t, calls, node1);
  EXPECT_EQ(back.before, 1);
  EXPECT_EQ(back.after, 1);
  const detail::RoutedPlace router = detail::routed_place(t, calls, gate);
  EXPECT_EQ(router.call, 0);
  EXPECT_EQ(router.before, -1);
  EXPECT_EQ(router.after, 0);
  // Experts with the same load are no routed layer (a dense ModuleList of layers gets the same input in each).
  EXPECT_TRUE(detail::find_routed_calls(moe_probe(2, {4, 4, 4, 4})).empty());
}

// Blocks of a ModuleList whose first ops take the inputs `shapes` (one a block), inside a parent "Net.blocks" call.
Trace blocks_trace(const std::vector<std::vector<int64_t>>& shapes) {
  Recorder r;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t op = r.op("aten::linear", Scope::Function, Phase::Forward);
    r.th.ops[static_cast<size_t>(op)].module = "Net.blocks." + std::to_string(i);
    Value v;
    v.kind = Value::Kind::Tensor;
    v.tensors.push_back(TensorMeta{shapes[i], {}, "float32", "cpu", 0});
    r.th.ops[static_cast<size_t>(op)].inputs = {v};
    r.ev(0x100 + i, 64, op, Phase::Forward);
    r.ev(0x100 + i, -64, op, Phase::Forward);
    r.end(op);
  }
  return r.finish(64);
}

TEST(MoeRouting, OtherModuleListsAreNotRouted) {
  // A token-pruning transformer's blocks: [B, N_i, D], fewer tokens each block.
  EXPECT_TRUE(detail::find_routed_calls(blocks_trace({{4, 64, 32}, {4, 48, 32}, {4, 32, 32}})).empty());
  // Scalars (no rows) and a mix of ranks: none, and no fault reading them.
  EXPECT_TRUE(detail::find_routed_calls(blocks_trace({{}, {}, {}})).empty());
  EXPECT_TRUE(detail::find_routed_calls(blocks_trace({{3, 8}, {}, {5, 8}})).empty());
  EXPECT_TRUE(detail::find_routed_calls(blocks_trace({{}, {3, 8}, {5, 8}})).empty());
}

TEST(MoeRouting, LoadsSpreadEvenlyOrSkewed) {
  const std::vector<detail::RoutedCall> calls = detail::find_routed_calls(moe_probe(8, {20, 12, 17, 15}));
  ASSERT_FALSE(calls.empty());
  const detail::RoutedCall& c = calls[0];  // 32 tokens, 64 sent
  EXPECT_EQ(detail::expected_loads(c, 4.0), (std::vector<int64_t>{64, 64, 64, 64}));
  // Each of the 2 heaviest receives every token (128 at 4x); the rest nothing.
  EXPECT_EQ(detail::skewed_loads(c, 4.0, 1.0, true), (std::vector<int64_t>{128, 128, 0, 0}));
  EXPECT_EQ(detail::skewed_loads(c, 4.0, 1.0, false), (std::vector<int64_t>{0, 0, 128, 128}));
  // Three quarters of the tokens each: 96 and 96, the remaining 64 over the other two.
  EXPECT_EQ(detail::skewed_loads(c, 4.0, 0.75, true), (std::vector<int64_t>{96, 96, 32, 32}));
  // Below the even share: the even share.
  EXPECT_EQ(detail::skewed_loads(c, 4.0, 0.25, true), (std::vector<int64_t>{64, 64, 64, 64}));
}

TEST(MoeRouting, ExpectedAndBoundPeaksAreThoseOfTheirRoutings) {
  const std::vector<Trace> probes = moe_probes();
  const MemoryForecast f = run_moe(probes, 32);
  ASSERT_TRUE(f.moe.has_value());
  EXPECT_EQ(f.moe->routed_calls, 2);
  EXPECT_EQ(f.moe->experts, 4);
  EXPECT_EQ(f.moe->top_k, 2);
  EXPECT_EQ(f.moe->unexplained_allocations, 0);
  // Every expert's pick, output, weighing and gradient, in both iterations: 4 x 4 x 2.
  EXPECT_EQ(f.moe->routed_allocations, 32);
  // Expected: the peak of the step whose 128 tokens' 256 choices spread evenly; bound: the higher of the two
  // placements of every token on two experts; the forecast's peak is the bound.
  EXPECT_EQ(f.moe->expected_peak_allocated_bytes, peak_of(moe_probe(32, {64, 64, 64, 64}), 32));
  const int64_t bound = std::max(peak_of(moe_probe(32, {128, 128, 0, 0}), 32), peak_of(moe_probe(32, {0, 0, 128, 128}), 32));
  EXPECT_EQ(f.moe->bound_peak_allocated_bytes, bound);
  EXPECT_EQ(f.peak_allocated_bytes, bound);
  EXPECT_GT(bound, f.moe->expected_peak_allocated_bytes);
  EXPECT_EQ(count_code(f.notes, "moe-routing"), 1);
  // A skew at the even share: the bound is the expected peak.
  const MemoryForecast even = run_moe(probes, 32, 0.25);
  EXPECT_EQ(even.peak_allocated_bytes, f.moe->expected_peak_allocated_bytes);
  ASSERT_TRUE(even.moe.has_value());
  EXPECT_EQ(even.moe->skew, 0.25);
}

TEST(MoeRouting, ProbesThatRanOtherExpertsAreMatchedOpByOp) {
  // At batch 2 expert 3 received no token, so it did not run.
  const std::vector<Trace> probes = {moe_probe(2, {5, 3, 8, 0}), moe_probe(4, {9, 7, 10, 6}),
                                     moe_probe(8, {20, 12, 17, 15})};
  const MemoryForecast f = run_moe(probes, 32);
  EXPECT_TRUE(f.scaled);
  EXPECT_EQ(count_code(f.notes, "moe-experts-differ"), 1);
  ASSERT_TRUE(f.moe.has_value());
  EXPECT_EQ(f.moe->expected_peak_allocated_bytes, peak_of(moe_probe(32, {64, 64, 64, 64}), 32));
}

TEST(MoeRouting, BadSkew) {
  const std::vector<Trace> probes = moe_probes();
  for (double skew : {0.0, 1.5}) {
    try {
      run_moe(probes, 32, skew);
      FAIL();
    } catch (const UserError& e) {
      EXPECT_EQ(std::string(e.what()), fmt::format("forecast: moe_skew must be in (0, 1], got {}", skew));
    }
  }
}

}  // namespace
}  // namespace gpucast
