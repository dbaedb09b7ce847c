// Step-time forecast over hand-built traces: per-layer times, fits over probe batches, DDP buckets.
#include <gtest/gtest.h>

#include <functional>

#include "gpucast/error.h"
#include "user_error.h"
#include "gpucast/step_time.h"

namespace gpucast {
namespace {

constexpr auto err = test_util::user_error;

// Two iterations; in each: forward ops in Net.a (k ns) and Net.b (2k ns), backward nodes for b then a (3k, 4k),
// a gradient of 600 KiB for each layer, then the optimizer step (500 ns). Times in ns, k scales with the batch.
Trace make_trace(int64_t k) {
  Trace t;
  uint64_t seq = 1;
  int64_t now = 0;
  auto op = [&](const char* name, Scope scope, Phase phase, const char* module, int64_t dur, int64_t fwd = -1) {
    OpRecord o;
    o.id = static_cast<int64_t>(t.ops.size());
    o.name = name;
    o.scope = scope;
    o.phase = phase;
    o.module = module;
    o.start_ns = now;
    o.end_ns = now + dur;
    o.start_seq = seq++;
    o.end_seq = seq++;
    o.fwd_op = fwd;
    now += dur + 10;  // 10 ns between ops: "other"
    t.ops.push_back(o);
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

TEST(StepTime, DdpBucketsOverlapBackward) {
  std::vector<IterationTiming> probes;
  for (int64_t b : {2, 4, 8}) probes.push_back(iteration_timing(make_trace(250000 * b), b));
  StepTimeOptions o;
  o.batch_size = 16;  // 8 per rank: k = 2 ms
  o.dp = 2;
  o.have_link = true;
  o.link = {10.0, 1000.0};  // 10 us per step, 1000 B/us
  const StepTimeForecast f = forecast_step_time(probes, o);
  // Backward order: Net.b (6 ms) then Net.a (8 ms). Each layer's 600 KiB fills no 1 MiB bucket alone: one bucket of
  // 1200 KiB ready when Net.a's backward ends.
  ASSERT_EQ(f.buckets.size(), 1u);
  EXPECT_EQ(f.buckets[0].bytes, 1200 << 10);
  const double other = 40 / 1e6, fwd = 6.0, bwd_end = other + fwd + 14.0;
  EXPECT_NEAR(f.buckets[0].ready_ms, bwd_end, 1e-9);
  const double ar_ms = allreduce_us(1200 << 10, 2, o.link) / 1e3;  // 2(N-1)/N S/B + 2(N-1) alpha
  EXPECT_NEAR(ar_ms, (1228800.0 / 1000.0 + 20.0) / 1e3, 1e-12);
  EXPECT_NEAR(f.comm_ms, ar_ms, 1e-12);
  EXPECT_NEAR(f.exposed_comm_ms, ar_ms, 1e-9);
  EXPECT_NEAR(f.step_ms, f.compute_ms + ar_ms, 1e-9);
  // With a 500 KiB first bucket, Net.b's gradients go alone, hidden behind Net.a's backward: two buckets.
  o.first_bucket_bytes = 500 << 10;
  const StepTimeForecast g = forecast_step_time(probes, o);
  ASSERT_EQ(g.buckets.size(), 2u);
  EXPECT_NEAR(g.buckets[0].ready_ms, other + fwd + 6.0, 1e-9);
  EXPECT_NEAR(g.exposed_comm_ms, allreduce_us(600 << 10, 2, o.link) / 1e3, 1e-9);
}

TEST(StepTime, BadOptions) {
  std::vector<IterationTiming> probes = {iteration_timing(make_trace(1000), 2)};
  StepTimeOptions o;
  o.batch_size = 8;
  o.dp = 0;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "parallel: 'dp' should be an integer of at least 1, got 0");
  o.dp = 2;
  o.dp_mode = "zero9";
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "parallel: 'dp_mode' should be one of ddp|zero1|zero2|fsdp, got 'zero9'");
  o.dp_mode = "ddp";
  o.batch_size = 1;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }),
            "step time: batch_size 1 is smaller than dp 2: every rank needs a sample");
  EXPECT_EQ(err([&] { forecast_step_time({}, o); }), "step time: no probe iterations to forecast from");
  o.batch_size = 8;
  o.time_scale = 0;
  EXPECT_EQ(err([&] { forecast_step_time(probes, o); }), "step time: time_scale should be in (0, 10], got 0");
  o.time_scale = 0.5;  // every compute time halves
  o.dp = 1;
  const StepTimeForecast half = forecast_step_time(probes, o);
  o.time_scale = 1.0;
  EXPECT_NEAR(half.step_ms, forecast_step_time(probes, o).step_ms / 2, 1e-12);
  o.dp = 2;
  o.batch_size = 8;
  const StepTimeForecast f = forecast_step_time(probes, o);  // no link: compute only, said in a note
  ASSERT_EQ(f.notes.size(), 1u);
  EXPECT_EQ(f.notes[0], "no all-reduce link given (gpucast.calibrate() or a device table): communication not counted");
}

}  // namespace
}  // namespace gpucast
