// The GPU rates table and a GPU's step priced from CPU probes' work (gpu_rates.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "gpucast/gpu_rates.h"
#include "notes.h"
#include "user_error.h"

namespace gpucast {
namespace {

using test_util::codes;
using test_util::count_code;

constexpr auto err = test_util::user_error;
using json = nlohmann::json;

// One GPU: 10 TFLOP/s float32, 20 TF32, 40 16-bit, 1 TB/s; every kind forward (0.5, 0.5, 10 us), backward
// (0.25, 0.5, 20 us).
json table_json() {
  json kinds = json::object();
  for (std::string_view k : kLayerCostKinds) {
    kinds[std::string(k)] = {{"source", "test"},
                             {"forward", {{"flop_eff", 0.5}, {"byte_eff", 0.5}, {"overhead_us", 10}}},
                             {"backward", {{"flop_eff", 0.25}, {"byte_eff", 0.5}, {"overhead_us", 20}}}};
  }
  return {{"format", "gpucast-gpu-rates"},
          {"version", 1},
          {"gpus", json::array({{{"name", "G1"}, {"fp32_tflops", 10}, {"tf32_tflops", 20}, {"half_tflops", 40},
                                 {"bandwidth_gbps", 1000}, {"fitted_on", "hand-made"}, {"kinds", kinds}}})}};
}

GpuRates table_gpu() { return parse_gpu_rates(table_json().dump(), "t.json").at(0); }

TEST(GpuRates, ParsesAndRoundTrips) {
  const auto table = parse_gpu_rates(table_json().dump(), "t.json");
  ASSERT_EQ(table.size(), 1u);
  EXPECT_EQ(table[0].name, "G1");
  EXPECT_DOUBLE_EQ(table[0].fp32_flops, 10e12);
  EXPECT_DOUBLE_EQ(table[0].bytes_per_s, 1e12);
  EXPECT_DOUBLE_EQ(table[0].kinds[0].backward.overhead_s, 20e-6);
  const auto again = parse_gpu_rates(gpu_rates_to_json(table), "again");
  EXPECT_EQ(again[0].fitted_on, "hand-made");
  EXPECT_DOUBLE_EQ(again[0].kinds[6].forward.flop_eff, 0.5);
  EXPECT_EQ(find_gpu_rates(table, "g1"), &table[0]);
  EXPECT_EQ(find_gpu_rates(table, "G2"), nullptr);
}

TEST(GpuRates, BadTablesNameTheKeyAndWhatWasGiven) {
  EXPECT_EQ(err([] { parse_gpu_rates("{", "t.json"); }).rfind("t.json: malformed JSON at byte 2: ", 0), 0u);
  EXPECT_EQ(err([] { parse_gpu_rates("{\"format\": \"x\"}", "t.json"); }),
            "t.json: not a gpucast GPU rates table: expected \"format\": \"gpucast-gpu-rates\"");
  json j = table_json();
  j["version"] = 2;
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: GPU rates table version 2, this gpucast reads version 1: regenerate it with bench/gpu_rates.py");
  j = table_json();
  j["gpus"][0]["kinds"].erase("pool");
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: gpus[0] ('G1'): kinds.pool: missing (every kind of op needs rates)");
  j = table_json();
  j["gpus"][0]["kinds"]["matmul"]["forward"]["flop_eff"] = 1.5;
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: gpus[0] ('G1'): kinds.matmul.forward: 'flop_eff' should be in (0, 1], got 1.5");
  j = table_json();
  j["gpus"][0]["bandwidth_gbps"] = "fast";
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: gpus[0] ('G1'): 'bandwidth_gbps' should be a number, got \"fast\"");
  j = table_json();
  j["gpus"][0]["fp32_tflops"] = 1.7976931348623157e308;  // finite, but infinite as FLOP/s (found by the fuzzer)
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: gpus[0] ('G1'): 'fp32_tflops' should be in (0, 1000000], got 1.7976931348623157e+308");
  j = table_json();
  j["gpus"][0]["overhead_scale"] = 11;
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: gpus[0] ('G1'): 'overhead_scale' should be in [0, 10], got 11");
  j["gpus"][0]["overhead_scale"] = 0.5;
  EXPECT_EQ(parse_gpu_rates(j.dump(), "t.json")[0].overhead_scale, 0.5);
  EXPECT_EQ(table_gpu().overhead_scale, 1.0);  // absent: 1
  j = table_json();
  j["host"] = {{"us_per_op", 2000}, {"source", "a test"}};
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }),
            "t.json: host: 'us_per_op' should be in [0, 1000], got 2000");
  j["host"] = {{"us_per_op", 12.5}};
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }), "t.json: host: missing key 'source'");
  j["host"]["source"] = "a test";
  const std::vector<GpuRates> hosted = parse_gpu_rates(j.dump(), "t.json");
  EXPECT_DOUBLE_EQ(hosted[0].host_ns_per_op, 12500);
  EXPECT_EQ(parse_gpu_rates(gpu_rates_to_json(hosted), "again")[0].host_source, "a test");
  EXPECT_EQ(table_gpu().host_ns_per_op, 0);  // absent: none
  j = table_json();
  j["gpus"].push_back(j["gpus"][0]);
  EXPECT_EQ(err([&] { parse_gpu_rates(j.dump(), "t.json"); }), "t.json: gpus[1] ('G1'): GPU 'G1' listed twice");
  // Loaded from a file, every error carries the code by which the caller falls back to the shipped table.
  EXPECT_EQ(err([] { load_gpu_rates("/nonexistent/rates.json"); }),
            "[gpucast:gpu-rates] GPU rates table '/nonexistent/rates.json' cannot be read (missing?): give a table "
            "written by bench/gpu_rates.py, or unset GPUCAST_GPU_RATES to use the shipped one");
  const std::string path = ::testing::TempDir() + "gpucast_rates_twice.json";
  std::ofstream(path) << j.dump();
  EXPECT_EQ(err([&] { load_gpu_rates(path); }),
            "[gpucast:gpu-rates] " + path + ": gpus[1] ('G1'): GPU 'G1' listed twice");
}

TEST(GpuRates, TheShippedTableLoadsAndCoversTheDeviceTablesDatacenterGpus) {
  const auto table = load_gpu_rates(std::string(GPUCAST_SOURCE_DIR) + "/predictor/weights/gpu_rates.json");
  for (const char* name : {"H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB", "L4", "V100-32GB"}) {
    EXPECT_NE(find_gpu_rates(table, name), nullptr) << name;
  }
}

TEST(GpuRates, DefaultPathFollowsTheEnvironment) {
  setenv("GPUCAST_GPU_RATES", "/tmp/my_rates.json", 1);
  EXPECT_EQ(default_gpu_rates_path(), "/tmp/my_rates.json");
  const std::string shipped = shipped_gpu_rates_path();  // the shipped table whatever the environment says
  unsetenv("GPUCAST_GPU_RATES");
  EXPECT_NE(default_gpu_rates_path(), "/tmp/my_rates.json");
  EXPECT_EQ(shipped, default_gpu_rates_path());
}

TEST(GpuRates, PricesAPartOnItsPrecisionsPeak) {
  const GpuRates g = table_gpu();
  // 2e12 FLOPs at 0.5 x 10 TFLOP/s = 0.4 s; 1e9 bytes at 0.5 TB/s = 2 ms; 2 kernels x 10 us.
  const CostPart mm{"matmul", false, 2e12, 1e9, 2};
  EXPECT_DOUBLE_EQ(gpu_part_ns(mm, g, Phase::Forward), 0.4e9 + 20e3);
  // Backward: twice the FLOPs at 0.25 x peak, 2 x 20 us.
  EXPECT_DOUBLE_EQ(gpu_part_ns(mm, g, Phase::Backward), 1.6e9 + 40e3);
  EXPECT_DOUBLE_EQ(gpu_part_ns(mm, g, Phase::Forward, GpuPrecision{true, true}), 0.2e9 + 20e3);  // TF32
  CostPart half = mm;
  half.half = true;
  EXPECT_DOUBLE_EQ(gpu_part_ns(half, g, Phase::Forward), 0.1e9 + 20e3);
  const CostPart conv{"conv", false, 2e12, 1e9, 1};
  EXPECT_DOUBLE_EQ(gpu_part_ns(conv, g, Phase::Forward), 0.2e9 + 10e3);  // cuDNN's TF32 by default
  EXPECT_DOUBLE_EQ(gpu_part_ns(conv, g, Phase::Forward, GpuPrecision{false, false}), 0.4e9 + 10e3);
  const CostPart ew{"elementwise", false, 1e6, 1e9, 1};  // memory-bound: 1e9 B at 0.5 TB/s
  EXPECT_DOUBLE_EQ(gpu_part_ns(ew, g, Phase::Forward), 2e6 + 10e3);
  GpuRates scaled = g;  // overheads as they weigh in a whole iteration
  scaled.overhead_scale = 2.5;
  EXPECT_DOUBLE_EQ(gpu_part_ns(mm, scaled, Phase::Forward), 0.4e9 + 2.5 * 20e3);
}

IterationTiming probe(int64_t batch) {
  IterationTiming it;
  it.batch = batch;
  it.wall_ns = 1e9;
  it.optimizer_ns = 5e8;
  it.other_ns = 1e8;
  LayerTiming a;
  a.layer = "net.fc";
  a.forward_ns = a.backward_ns = 1e8;
  a.grad_bytes = 1000;
  a.cost_kind = "matmul";
  // A weight read once (1e9 B) and 1e11 FLOPs per sample.
  a.parts = {CostPart{"matmul", false, 1e11 * static_cast<double>(batch), 1e9 + 1e6 * static_cast<double>(batch), 1}};
  a.flops = a.parts[0].flops;
  a.bytes = a.parts[0].bytes;
  a.out_bytes = 4000 * batch;
  LayerTiming b;  // recorded without parts (no shapes): priced as one part of its cost kind
  b.layer = "net.act";
  b.cost_kind = "elementwise";
  b.bytes = 1e6 * static_cast<double>(batch);
  b.ops = 1;
  b.backward_order = 1;
  it.layers = {a, b};
  return it;
}

TEST(GpuRates, PricesAProbesIteration) {
  const GpuRates g = table_gpu();
  const IterationTiming p = price_on_gpu(probe(2), g);
  EXPECT_EQ(p.clock, "gpu-table");
  // fc: max(2e11 / 5e12, 1.002e9 / 5e11) = 40 ms + 10 us forward; backward max(4e11 / 2.5e12, ...) = 160 ms + 20 us.
  EXPECT_DOUBLE_EQ(p.layers[0].forward_ns, 40e6 + 10e3);
  EXPECT_DOUBLE_EQ(p.layers[0].backward_ns, 160e6 + 20e3);
  EXPECT_DOUBLE_EQ(p.layers[1].forward_ns, 2e6 / 5e11 * 1e9 + 10e3);
  EXPECT_DOUBLE_EQ(p.layers[1].forward_fixed_ns, 10e3);  // recorded without parts: its one kernel all the same
  // Optimizer without recorded bytes: 7 x 1000 gradient bytes at the elementwise rate (0.5 TB/s).
  EXPECT_DOUBLE_EQ(p.optimizer_ns, 7000 / 5e11 * 1e9);
  EXPECT_EQ(p.other_ns, 0);
  EXPECT_DOUBLE_EQ(p.wall_ns, p.layers[0].forward_ns + p.layers[0].backward_ns + p.layers[1].forward_ns +
                                  p.layers[1].backward_ns + p.optimizer_ns);
  IterationTiming with_bytes = probe(2);
  with_bytes.optimizer_bytes = 1e9;
  EXPECT_DOUBLE_EQ(price_on_gpu(with_bytes, g).optimizer_ns, 2e6);
}

TEST(GpuRates, RecomputedForwardOpsArePricedInTheBackwardPass) {
  // net.fc checkpointed: its forward runs again in backward, at the forward's rates (40 ms + 10 us), and its
  // kernel launches with it.
  IterationTiming checkpointed = probe(2);
  checkpointed.clock = "cpu";
  checkpointed.layers[0].recompute = checkpointed.layers[0].parts;
  const IterationTiming p = price_on_gpu(checkpointed, table_gpu());
  const IterationTiming q = price_on_gpu(probe(2), table_gpu());
  EXPECT_DOUBLE_EQ(p.layers[0].forward_ns, q.layers[0].forward_ns);
  EXPECT_DOUBLE_EQ(p.layers[0].backward_ns, 160e6 + 20e3 + 40e6 + 10e3);
  EXPECT_DOUBLE_EQ(p.layers[0].backward_fixed_ns, q.layers[0].backward_fixed_ns + 10e3);
  EXPECT_DOUBLE_EQ(p.wall_ns - q.wall_ns, 40e6 + 10e3);
  // The timing's JSON carries it; one without recomputation writes no key for it (older readers unchanged).
  const IterationTiming back = iteration_timing_from_json(iteration_timing_to_json(checkpointed));
  EXPECT_EQ(back.layers[0].recompute, checkpointed.layers[0].recompute);
  EXPECT_EQ(iteration_timing_to_json(probe(2)).find("recompute"), std::string::npos);
}

TEST(GpuRates, ALayerWithoutABackwardPassCostsNothingThere) {
  // net.act recorded no backward op where net.fc recorded some: frozen, it runs no backward.
  IterationTiming frozen = probe(2);
  frozen.layers[0].backward_ops_all = 3;
  const IterationTiming p = price_on_gpu(frozen, table_gpu());
  EXPECT_DOUBLE_EQ(p.layers[0].backward_ns, 160e6 + 20e3);
  EXPECT_EQ(p.layers[1].backward_ns, 0);
  EXPECT_EQ(p.layers[1].backward_fixed_ns, 0);
  EXPECT_DOUBLE_EQ(p.layers[1].forward_fixed_ns, 10e3);
  EXPECT_FALSE(layer_runs_backward(frozen, frozen.layers[1]));
  EXPECT_TRUE(layer_runs_backward(frozen, frozen.layers[0]));
  // No backward op recorded for any layer (a trace without forward/backward links): every layer runs one.
  EXPECT_TRUE(layer_runs_backward(probe(2), probe(2).layers[1]));
  EXPECT_GT(price_on_gpu(probe(2), table_gpu()).layers[1].backward_ns, 0);
}

TEST(GpuRates, ExtrapolatesTheWorkThenPricesIt) {
  const IterationTiming w = work_at_batch({probe(1), probe(2)}, 64);
  EXPECT_EQ(w.batch, 64);
  EXPECT_DOUBLE_EQ(w.layers[0].parts[0].flops, 64e11);
  EXPECT_DOUBLE_EQ(w.layers[0].parts[0].bytes, 1e9 + 64e6);
  EXPECT_EQ(w.layers[0].out_bytes, 4000 * 64);
  EXPECT_DOUBLE_EQ(w.layers[1].bytes, 64e6);
  // At batch 64 the matmul is compute-bound (6.4e12 FLOPs at 5e12 FLOP/s: 1.28 s); at the probes it was bound by
  // reading its weight (2 ms), which a fit of the probes' prices over the batch would carry to the target.
  const GpuRates g = table_gpu();
  StepTimeOptions o;
  o.batch_size = 64;
  const StepTimeForecast f = forecast_step_time_on_gpu({probe(1), probe(2)}, o, g);
  const double fc_fw = 6.4e12 / 5e12 * 1e3 + 0.01;  // ms
  ASSERT_EQ(f.per_layer.size(), 2u);
  EXPECT_NEAR(f.per_layer[0].forward_ms, fc_fw, 1e-9);
  EXPECT_NEAR(f.per_layer[0].backward_ms, 2 * 6.4e12 / 2.5e12 * 1e3 + 0.02, 1e-9);
  EXPECT_EQ(f.per_layer[0].source, "gpu-table");
  EXPECT_EQ(f.per_layer[1].source, "gpu-table");
  ASSERT_FALSE(f.notes.empty());
  EXPECT_EQ(f.notes[0].code, "gpu-table-pricing");
  EXPECT_EQ(f.other_ms, 0);
}

TEST(GpuRates, TheHostBoundsAStepOfShortKernels) {
  // The probes launch 3 ops; at 100 ms of host time per op (set here, to match these probes' slow kernels) the
  // host takes 300 ms per step. At batch 1 the kernels take 100 ms, reading the weight: the host bounds the step.
  // At batch 64 they take 3.9 s.
  GpuRates g = table_gpu();
  g.host_ns_per_op = 1e8;
  std::vector<IterationTiming> probes = {probe(1), probe(2)};
  EXPECT_EQ(price_on_gpu(probes[0], g).host_ns, -1);  // launching ops not known: no host term
  for (IterationTiming& p : probes) p.launch_ops = 3;
  EXPECT_DOUBLE_EQ(price_on_gpu(probes[0], g).host_ns, 3e8);
  StepTimeOptions o;
  o.batch_size = 1;
  StepTimeForecast f = forecast_step_time_on_gpu(probes, o, g);
  const double kernels = f.forward_ms + f.backward_ms + f.optimizer_ms;
  EXPECT_LT(kernels, 300.0);
  EXPECT_NEAR(f.other_ms, 300.0 - kernels, 1e-9);
  EXPECT_NEAR(f.step_ms, 300.0, 1e-9);
  o.batch_size = 64;
  f = forecast_step_time_on_gpu(probes, o, g);
  EXPECT_EQ(f.other_ms, 0);
  EXPECT_NEAR(f.step_ms, f.forward_ms + f.backward_ms + f.optimizer_ms, 1e-9);
  EXPECT_GT(f.step_ms, 300.0);
}

TEST(GpuRates, TensorParallelismDividesTheWorkNotTheLaunches) {
  std::vector<IterationTiming> probes = {probe(1), probe(2)};
  for (IterationTiming& p : probes) p.layers[0].kind = "matmul";  // a column-parallel matmul with parameters
  const IterationTiming priced = price_on_gpu(work_at_batch(probes, 64), table_gpu());
  EXPECT_DOUBLE_EQ(priced.layers[0].forward_fixed_ns, 10e3);  // one kernel's 10 us
  EXPECT_DOUBLE_EQ(priced.layers[0].backward_fixed_ns, 20e3);
  StepTimeOptions o;
  o.batch_size = 64;
  o.parallel.tp = 2;
  const StepTimeForecast f = forecast_step_time_on_gpu(probes, o, table_gpu());
  const double fw_ms = 6.4e12 / 5e12 * 1e3, bw_ms = 2 * 6.4e12 / 2.5e12 * 1e3;
  EXPECT_NEAR(f.per_layer[0].forward_ms, 0.01 + fw_ms / 2, 1e-9);
  EXPECT_NEAR(f.per_layer[0].backward_ms, 0.02 + bw_ms / 2, 1e-9);
}

}  // namespace
}  // namespace gpucast
