// Memory timeline and summary over hand-built traces: peaks recomputed to the byte.
#include <gtest/gtest.h>

#include <map>

#include "gpucast/memory_timeline.h"
#include "gpucast/trace_assembly.h"
#include "gpucast/trace_json.h"
#include "gpucast/trace_summary.h"

namespace gpucast {
namespace {

class TimelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AssemblyInput in;
    RawThread th;
    th.thread = 1;
    OpRecord a;
    a.name = "aten::mm";
    a.module = "Net.fc1";
    a.start_seq = 1;
    a.end_seq = 4;
    a.start_ns = 0;
    a.end_ns = 3000;
    OpRecord b = a;
    b.name = "aten::relu";
    b.module = "Net.act";
    b.start_seq = 5;
    b.end_seq = 9;
    b.start_ns = 3000;
    b.end_ns = 4000;
    th.ops = {a, b};
    auto ev = [](uint64_t seq, uint64_t ptr, int64_t bytes, int64_t op, const char* dev) {
      MemEvent e;
      e.seq = seq;
      e.ptr = ptr;
      e.bytes = bytes;
      e.block_bytes = bytes;
      e.device = dev;
      e.op = op;
      return e;
    };
    th.events = {ev(2, 0x10, 1000, 0, "cpu"), ev(3, 0x20, 500, 0, "cpu"), ev(6, 0x10, -1000, 1, "cpu"),
                 ev(7, 0x30, 300, 1, "cpu"), ev(8, 0x40, 2048, 1, "cuda:0")};
    in.threads.push_back(th);
    in.baseline_blocks.push_back(BaselineBlock{0x90, 4096, 4096, "cpu"});
    in.baseline["cpu"] = DeviceBaseline{4096, true};
    in.start_ns = 0;
    in.end_ns = 4000;
    trace = assemble_trace(std::move(in));
  }
  Trace trace;
};

TEST_F(TimelineTest, PeakPerDeviceFromTheWindowStart) {
  std::vector<DeviceMemory> mem = analyze_memory(trace);
  ASSERT_EQ(mem.size(), 2u);
  EXPECT_EQ(mem[0].device, "cpu");
  EXPECT_EQ(mem[0].peak_bytes, 1500);
  EXPECT_EQ(mem[0].peak_event, 1);
  EXPECT_EQ(mem[0].peak_op, 0);
  EXPECT_EQ(mem[0].baseline_bytes, 4096);
  EXPECT_EQ(mem[0].absolute_peak_bytes, 5596);
  EXPECT_EQ(mem[0].end_bytes, 800);
  EXPECT_EQ(mem[1].device, "cuda:0");
  EXPECT_EQ(mem[1].peak_bytes, 2048);
  EXPECT_EQ(window_peak_bytes(trace, "cpu"), 1500);
  EXPECT_EQ(window_peak_bytes(trace, "cuda:1"), 0);
}

TEST_F(TimelineTest, CategoriesAtPeakIncludeTheBaseline) {
  DeviceMemory cpu = analyze_memory(trace)[0];
  int64_t total = 0;
  for (int64_t b : cpu.at_peak) total += b;
  EXPECT_EQ(total, 5596);
  int64_t end_total = 0;
  for (int64_t b : cpu.at_end) end_total += b;
  EXPECT_EQ(end_total, 4096 + 800);
}

TEST_F(TimelineTest, LayersByMemoryAtPeakAndByTime) {
  std::vector<LayerStat> layers = layer_stats(trace, "cpu");
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[1].module, "Net.fc1");
  EXPECT_EQ(layers[1].bytes_at_peak, 1500);
  EXPECT_EQ(layers[1].time_ns, 3000);
  EXPECT_EQ(layers[0].module, "Net.act");
  EXPECT_EQ(layers[0].bytes_at_peak, 0);
  EXPECT_EQ(layers[0].time_ns, 1000);
}

TEST_F(TimelineTest, OpsOutsideModulesSplitIntoTheOptimizerStepAndTheRest) {
  // The relu's module cleared: outside modules, in forward; then the same op in the optimizer phase.
  trace.ops[1].module.clear();
  std::map<std::string, LayerStat> by;
  for (const LayerStat& l : layer_stats(trace, "cpu")) by[l.module] = l;
  ASSERT_EQ(by.count("<no module>"), 1u);
  EXPECT_EQ(by["<no module>"].time_ns, 1000);
  EXPECT_EQ(by.count("<optimizer step>"), 0u);
  trace.ops[1].phase = Phase::Optimizer;
  by.clear();
  for (const LayerStat& l : layer_stats(trace, "cpu")) by[l.module] = l;
  EXPECT_EQ(by.count("<no module>"), 0u);
  ASSERT_EQ(by.count("<optimizer step>"), 1u);
  EXPECT_EQ(by["<optimizer step>"].time_ns, 1000);
  EXPECT_EQ(by["<optimizer step>"].ops, 1);
  EXPECT_EQ(by["<optimizer step>"].bytes_at_peak, 0);  // its 300 bytes come after the peak
  EXPECT_EQ(by["Net.fc1"].bytes_at_peak, 1500);
  EXPECT_NE(summarize_trace(trace).find("    <optimizer step>                                     0.001 ms       1 ops"),
            std::string::npos)
      << summarize_trace(trace);
}

TEST_F(TimelineTest, WithDeviceTimesTheSummaryRanksLayersByThem) {
  trace.ops[0].device_ns = 200;   // Net.fc1: 3 us on the host, 0.2 on the device
  trace.ops[1].device_ns = 1500;  // Net.act: 1 us on the host, 1.5 on the device
  std::map<std::string, LayerStat> by;
  for (const LayerStat& l : layer_stats(trace, "")) by[l.module] = l;
  EXPECT_EQ(by["Net.fc1"].device_ns, 200);
  EXPECT_EQ(by["Net.fc1"].time_ns, 3000);
  const std::string s = summarize_trace(trace);
  const std::string head = "top layers by device time (forward + linked backward; 2 of 2 with a device time):\n"
                           "    Net.act                                              0.002 ms       1 ops\n"
                           "    Net.fc1                                              0.000 ms       1 ops\n";
  EXPECT_NE(s.find(head), std::string::npos) << s;
  // A sparse trace: a layer without a device time is not ranked by its host time.
  trace.ops[0].device_ns = -1;
  const std::string sparse = summarize_trace(trace);
  EXPECT_NE(sparse.find("top layers by device time (forward + linked backward; 1 of 2 with a device time):\n"
                        "    Net.act                                              0.002 ms       1 ops\n"),
            std::string::npos)
      << sparse;
  EXPECT_EQ(sparse.find("Net.fc1", sparse.find("top layers by device time")), std::string::npos) << sparse;
}

TEST_F(TimelineTest, SummaryIsReadable) {
  std::string s = summarize_trace(trace);
  EXPECT_NE(s.find("gpucast trace: 2 ops (2 aten) - forward 2, backward 0, optimizer 0"), std::string::npos) << s;
  EXPECT_NE(s.find("cpu memory: baseline 4.00 KiB, window peak 1.46 KiB (absolute 5.46 KiB) at op #0 aten::mm (forward, Net.fc1)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("Net.fc1"), std::string::npos);
}

TEST_F(TimelineTest, ReplayedTraceGivesTheSamePeak) {
  Trace back = trace_from_json(trace_to_json(trace));
  EXPECT_EQ(analyze_memory(back)[0].peak_bytes, 1500);
}

TEST(FormatBytes, BinaryUnits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3 * 1024 * 1024), "3.00 MiB");
  EXPECT_EQ(format_bytes(-2048), "-2.00 KiB");
}

}  // namespace
}  // namespace gpucast
