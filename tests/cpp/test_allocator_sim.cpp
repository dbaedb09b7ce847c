// The caching-allocator model against hand-derived results (sizes from c10/cuda/CUDACachingAllocator.cpp).
#include <gtest/gtest.h>

#include "gpucast/allocator_sim.h"
#include "gpucast/error.h"

namespace gpucast {
namespace {

constexpr int64_t MiB = kMiB;

TEST(AllocatorConfig, RoundsRequests) {
  AllocatorConfig c;
  EXPECT_EQ(c.round_size(1), 512);
  EXPECT_EQ(c.round_size(512), 512);
  EXPECT_EQ(c.round_size(513), 1024);
  EXPECT_EQ(c.allocation_size(512), 2 * MiB);
  EXPECT_EQ(c.allocation_size(MiB), 2 * MiB);
  EXPECT_EQ(c.allocation_size(MiB + 512), 20 * MiB);
  EXPECT_EQ(c.allocation_size(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(c.allocation_size(10 * MiB), 10 * MiB);
  EXPECT_EQ(c.allocation_size(11 * MiB), 12 * MiB);
}

TEST(AllocatorConfig, RoundupPower2Divisions) {
  AllocatorConfig four = AllocatorConfig::parse("roundup_power2_divisions:4");
  EXPECT_EQ(four.round_size(1363149), 1572864);  // 1 MiB + 2 x 256 KiB
  EXPECT_EQ(four.round_size(2 * MiB), 2 * MiB);   // powers of two stay
  EXPECT_EQ(four.round_size(1000), 1024);         // below 512 x divisions: plain rounding
  AllocatorConfig list = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,>:4]");
  EXPECT_EQ(list.divisions_for(1363149), 1);
  EXPECT_EQ(list.round_size(1363149), 1363456);
  EXPECT_EQ(list.divisions_for(600 * MiB), 2);
  EXPECT_EQ(list.divisions_for(3000 * MiB), 4);
  EXPECT_EQ(list.round_size(600 * MiB + 1), 768 * MiB);  // 512 MiB + one 256 MiB division
}

TEST(AllocatorConfig, ParsesEveryKey) {
  AllocatorConfig c = AllocatorConfig::parse(
      "max_split_size_mb:64,max_non_split_rounding_mb:32,large_segment_size_mb:40,garbage_collection_threshold:0.6,"
      "expandable_segments:True,pinned_use_background_threads:True");
  EXPECT_EQ(c.max_split_size, 64 * MiB);
  EXPECT_EQ(c.max_non_split_rounding, 32 * MiB);
  EXPECT_EQ(c.large_segment_size, 40 * MiB);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.6);
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_TRUE(c.native_backend);
  EXPECT_FALSE(AllocatorConfig::parse("backend:cudaMallocAsync").native_backend);
}

std::string parse_error(const std::string& text) {
  try {
    AllocatorConfig::parse(text);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(AllocatorConfig, BadValuesNameKeyExpectedAndGiven) {
  // torch 2.14.1's bounds: max_split_size_mb and max_non_split_rounding_mb >= large_segment_size_mb as parsed so
  // far (20 by default), large_segment_size_mb > 10 (c10/core/AllocatorConfig.cpp, parseMaxSplitSize,
  // parseMaxNonSplitRoundingSize, parseLargeSegmentSize).
  EXPECT_EQ(parse_error("max_split_size_mb:10"),
            "PYTORCH_ALLOC_CONF: option 'max_split_size_mb' expects an integer number of MiB >= 20, got '10'");
  EXPECT_EQ(AllocatorConfig::parse("max_split_size_mb:20,max_non_split_rounding_mb:20").max_split_size, 20 * MiB);
  EXPECT_EQ(parse_error("max_non_split_rounding_mb:19"),
            "PYTORCH_ALLOC_CONF: option 'max_non_split_rounding_mb' expects an integer number of MiB >= 20, got '19'");
  EXPECT_EQ(parse_error("large_segment_size_mb:10"),
            "PYTORCH_ALLOC_CONF: option 'large_segment_size_mb' expects an integer number of MiB >= 11, got '10'");
  EXPECT_EQ(parse_error("large_segment_size_mb:32,max_split_size_mb:24"),
            "PYTORCH_ALLOC_CONF: option 'max_split_size_mb' expects an integer number of MiB >= 32, got '24'");
  EXPECT_EQ(AllocatorConfig::parse("max_split_size_mb:24,large_segment_size_mb:32").max_split_size, 24 * MiB);
  EXPECT_EQ(parse_error("expandable_segments:yes"),
            "PYTORCH_ALLOC_CONF: option 'expandable_segments' expects True or False, got 'yes'");
  EXPECT_EQ(parse_error("backend:cuda"),
            "PYTORCH_ALLOC_CONF: option 'backend' expects native or cudaMallocAsync, got 'cuda'");
  EXPECT_EQ(parse_error("garbage_collection_threshold:1.5"),
            "PYTORCH_ALLOC_CONF: option 'garbage_collection_threshold' expects a number in (0, 1), got '1.5'");
  EXPECT_EQ(parse_error("roundup_power2_divisions:3"),
            "PYTORCH_ALLOC_CONF: option 'roundup_power2_divisions' expects a power of two (or 0/1), got '3'");
  EXPECT_EQ(parse_error("max_split:64").rfind("PYTORCH_ALLOC_CONF: unknown option 'max_split'; valid options: ", 0), 0u);
}

TEST(AllocatorSim, SmallRequestsShareATwoMiBSegment) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, 1));
  ASSERT_TRUE(sim.malloc(2, 1000));
  EXPECT_EQ(sim.block_bytes(1), 512);
  EXPECT_EQ(sim.block_bytes(2), 1024);
  EXPECT_EQ(sim.address(2), sim.address(1) + 512);  // split from the same segment
  EXPECT_EQ(sim.stats().allocated, 1536);
  EXPECT_EQ(sim.stats().requested, 1001);
  EXPECT_EQ(sim.stats().reserved, 2 * MiB);
  EXPECT_EQ(sim.stats().segments, 1);
}

TEST(AllocatorSim, SmallPoolSplitsDownTo512Bytes) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, MiB));
  ASSERT_TRUE(sim.malloc(2, MiB));  // the other half of the first segment
  EXPECT_EQ(sim.stats().reserved, 2 * MiB);
  ASSERT_TRUE(sim.malloc(3, 512));
  EXPECT_EQ(sim.stats().reserved, 4 * MiB);
  EXPECT_EQ(sim.stats().segments, 2);
}

TEST(AllocatorSim, LargePoolSplitsOnlyAboveOneMiBRemainder) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, 11 * MiB));  // 12 MiB segment, 1 MiB remainder: not split
  EXPECT_EQ(sim.block_bytes(1), 12 * MiB);
  EXPECT_EQ(sim.stats().allocated, 12 * MiB);
  ASSERT_TRUE(sim.malloc(2, MiB + 1));  // 20 MiB segment, split
  EXPECT_EQ(sim.block_bytes(2), MiB + 512);
  ASSERT_TRUE(sim.malloc(3, 5 * MiB));  // fits the remainder
  EXPECT_EQ(sim.address(3), sim.address(2) + MiB + 512);
  EXPECT_EQ(sim.stats().reserved, 32 * MiB);
  EXPECT_EQ(sim.stats().allocated, 12 * MiB + MiB + 512 + 5 * MiB);
}

TEST(AllocatorSim, FreedNeighboursMerge) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, 4 * MiB));
  ASSERT_TRUE(sim.malloc(2, 4 * MiB));
  sim.free(1);
  sim.free(2);
  ASSERT_TRUE(sim.malloc(3, 18 * MiB));  // only the merged 20 MiB block holds it
  EXPECT_EQ(sim.stats().reserved, 20 * MiB);
  EXPECT_EQ(sim.stats().segments, 1);
  EXPECT_EQ(sim.block_bytes(3), 18 * MiB);
}

TEST(AllocatorSim, BestFitBySize) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, 14 * MiB));
  ASSERT_TRUE(sim.malloc(2, 12 * MiB));
  const int64_t twelve = sim.address(2);
  sim.free(1);
  sim.free(2);
  ASSERT_TRUE(sim.malloc(3, 11 * MiB + 1));  // 12 MiB fits better than 14 MiB
  EXPECT_EQ(sim.address(3), twelve);
  EXPECT_EQ(sim.stats().reserved, 26 * MiB);
}

TEST(AllocatorSim, FreedBlocksAreReusedOnlyBySameStream) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, 4 * MiB, 0));
  sim.free(1);
  ASSERT_TRUE(sim.malloc(2, 4 * MiB, 1));
  EXPECT_EQ(sim.stats().reserved, 40 * MiB);
  ASSERT_TRUE(sim.malloc(3, 4 * MiB, 0));
  EXPECT_EQ(sim.stats().reserved, 40 * MiB);
}

TEST(AllocatorSim, OversizeBlocksServeOnlyOversizeRequests) {
  AllocatorSim sim(AllocatorConfig::parse("max_split_size_mb:32"));
  ASSERT_TRUE(sim.malloc(1, 40 * MiB));
  sim.free(1);
  ASSERT_TRUE(sim.malloc(2, 8 * MiB));  // may not take the cached 40 MiB block
  EXPECT_EQ(sim.stats().reserved, 60 * MiB);
  ASSERT_TRUE(sim.malloc(3, 36 * MiB));  // oversize, within 20 MiB of the cached block: reused whole
  EXPECT_EQ(sim.block_bytes(3), 40 * MiB);
  EXPECT_EQ(sim.stats().reserved, 60 * MiB);
  EXPECT_EQ(sim.stats().oversize_allocations, 2);
  sim.free(3);
  ASSERT_TRUE(sim.malloc(4, 34 * MiB - 512 * 1024));  // 40 < 33.5 + 20: reused whole
  EXPECT_EQ(sim.block_bytes(4), 40 * MiB);
  sim.free(4);
  AllocatorSim tight(AllocatorConfig::parse("max_split_size_mb:32,max_non_split_rounding_mb:21"));
  ASSERT_TRUE(tight.malloc(1, 60 * MiB));
  tight.free(1);
  ASSERT_TRUE(tight.malloc(2, 34 * MiB));  // 60 >= 34 + 21: not reused
  EXPECT_EQ(tight.stats().reserved, 94 * MiB);
}

TEST(AllocatorSim, FullDeviceReleasesCachedSegmentsAndRetries) {
  SimOptions opt;
  opt.capacity_bytes = 24 * MiB;
  AllocatorSim sim({}, opt);
  ASSERT_TRUE(sim.malloc(1, 1000));
  sim.free(1);
  ASSERT_TRUE(sim.malloc(2, 12 * MiB));
  sim.free(2);
  EXPECT_EQ(sim.stats().reserved, 14 * MiB);
  ASSERT_TRUE(sim.malloc(3, 22 * MiB));
  EXPECT_EQ(sim.stats().alloc_retries, 1);
  EXPECT_EQ(sim.stats().reserved, 22 * MiB);
  EXPECT_EQ(sim.stats().released_segments, 2);
  EXPECT_EQ(sim.stats().peak_reserved, 22 * MiB);
}

TEST(AllocatorSim, OutOfMemoryChangesNothing) {
  SimOptions opt;
  opt.capacity_bytes = 10 * MiB;
  AllocatorSim sim({}, opt);
  ASSERT_TRUE(sim.malloc(1, 1000));
  EXPECT_FALSE(sim.malloc(2, 12 * MiB));
  EXPECT_EQ(sim.stats().ooms, 1);
  EXPECT_EQ(sim.stats().allocated, 1024);
}

TEST(AllocatorSim, OversizeCachedBlocksReleasedFirstWhenFull) {
  SimOptions opt;
  opt.capacity_bytes = 100 * MiB;
  AllocatorSim sim(AllocatorConfig::parse("max_split_size_mb:32"), opt);
  ASSERT_TRUE(sim.malloc(1, 40 * MiB));
  ASSERT_TRUE(sim.malloc(2, 50 * MiB));
  sim.free(1);
  // 70 MiB needs a new segment; 90 + 70 > 100: release the cached oversize 40 MiB block, then fits? 50 + 70 > 100:
  // no; release all unsplit cached blocks (none left) and fail.
  EXPECT_FALSE(sim.malloc(3, 70 * MiB));
  EXPECT_EQ(sim.stats().reserved, 50 * MiB);
  ASSERT_TRUE(sim.malloc(4, 44 * MiB));
  EXPECT_EQ(sim.stats().reserved, 94 * MiB);
}

TEST(AllocatorSim, GarbageCollectionActsOnlyWithAMemoryFraction) {
  SimOptions opt;
  opt.capacity_bytes = 100 * MiB;
  opt.memory_fraction = 0.5;
  AllocatorSim gc(AllocatorConfig::parse("garbage_collection_threshold:0.5"), opt);
  ASSERT_TRUE(gc.malloc(1, 30 * MiB));
  gc.free(1);
  ASSERT_TRUE(gc.malloc(2, 12 * MiB, 1));  // misses on stream 1; 30 > 25 MiB: the cached block goes
  EXPECT_EQ(gc.stats().reserved, 12 * MiB);
  SimOptions no_fraction;
  no_fraction.capacity_bytes = 100 * MiB;
  AllocatorSim plain(AllocatorConfig::parse("garbage_collection_threshold:0.5"), no_fraction);
  ASSERT_TRUE(plain.malloc(1, 30 * MiB));
  plain.free(1);
  ASSERT_TRUE(plain.malloc(2, 12 * MiB, 1));
  EXPECT_EQ(plain.stats().reserved, 42 * MiB);
}

TEST(AllocatorSim, ExpandableSegmentsGrowInPages) {
  AllocatorSim sim(AllocatorConfig::parse("expandable_segments:True"));
  ASSERT_TRUE(sim.malloc(1, MiB + 1));
  EXPECT_EQ(sim.stats().reserved, 20 * MiB);
  ASSERT_TRUE(sim.malloc(2, 25 * MiB));  // the free tail (20 MiB - 1 MiB - 512) grows by one 20 MiB page
  EXPECT_EQ(sim.stats().reserved, 40 * MiB);
  EXPECT_EQ(sim.stats().allocated, MiB + 512 + 25 * MiB);
  EXPECT_EQ(sim.address(2), sim.address(1) + MiB + 512);
  AllocatorSim classic;
  ASSERT_TRUE(classic.malloc(1, MiB + 1));
  ASSERT_TRUE(classic.malloc(2, 25 * MiB));
  EXPECT_EQ(classic.stats().reserved, 46 * MiB);
  sim.free(2);
  sim.empty_cache();
  EXPECT_EQ(sim.stats().reserved, 20 * MiB);  // the free pages at the end are unmapped
}

TEST(AllocatorSim, EmptyCacheKeepsSegmentsWithLiveBlocks) {
  AllocatorSim sim;
  ASSERT_TRUE(sim.malloc(1, 4 * MiB));
  ASSERT_TRUE(sim.malloc(2, 12 * MiB));
  sim.free(2);
  sim.empty_cache();
  EXPECT_EQ(sim.stats().reserved, 20 * MiB);
  sim.free(1);
  sim.empty_cache();
  EXPECT_EQ(sim.stats().reserved, 0);
  EXPECT_EQ(sim.stats().peak_reserved, 20 * MiB);
}

TEST(AllocatorSim, LargestCachedRequestPerStream) {
  AllocatorSim sim;
  EXPECT_EQ(sim.largest_cached_request(), 0);
  ASSERT_TRUE(sim.malloc(1, 5 * MiB));  // a 20 MiB segment, split: 15 MiB stays cached
  EXPECT_EQ(sim.largest_cached_request(), 15 * MiB);
  ASSERT_TRUE(sim.malloc(2, 4096));  // a 2 MiB small segment: its free blocks serve requests up to 1 MiB
  sim.free(1);
  EXPECT_EQ(sim.largest_cached_request(), 20 * MiB);
  EXPECT_EQ(sim.largest_cached_request(1), 0);  // freed blocks serve their own stream only
  ASSERT_TRUE(sim.malloc(3, 20 * MiB));
  EXPECT_EQ(sim.largest_cached_request(), MiB);
}

TEST(AllocatorConfig, LargestRequestInANewSegment) {
  AllocatorConfig c;
  EXPECT_EQ(c.largest_request_in_segment(0), 0);
  EXPECT_EQ(c.largest_request_in_segment(2 * MiB - 1), 0);
  EXPECT_EQ(c.largest_request_in_segment(2 * MiB), MiB);       // a small segment
  EXPECT_EQ(c.largest_request_in_segment(9 * MiB), MiB);       // 1-10 MiB requests need a 20 MiB segment
  EXPECT_EQ(c.largest_request_in_segment(15 * MiB), 14 * MiB);  // from 10 MiB: the request rounded to 2 MiB
  EXPECT_EQ(c.largest_request_in_segment(20 * MiB), 20 * MiB);
  AllocatorConfig small = AllocatorConfig::parse("large_segment_size_mb:12");
  EXPECT_EQ(small.largest_request_in_segment(12 * MiB), 12 * MiB);
  AllocatorConfig exp = AllocatorConfig::parse("expandable_segments:True");
  EXPECT_EQ(exp.largest_request_in_segment(45 * MiB), 40 * MiB);  // whole 20 MiB pages
}

TEST(Simulate, ReportsPeaksWhereTheyFallAndFragmentation) {
  std::vector<SimRequest> reqs = {{1, 4 * MiB}, {2, 4 * MiB}, {1, 0}, {3, 16 * MiB}, {2, 0}, {3, 0}};
  SimResult r = simulate(reqs);
  EXPECT_EQ(r.stats.peak_allocated, 20 * MiB);
  EXPECT_EQ(r.peak_allocated_index, 3);
  EXPECT_EQ(r.stats.peak_reserved, 36 * MiB);
  EXPECT_EQ(r.peak_reserved_index, 3);
  EXPECT_NEAR(r.fragmentation, 1.0 - 20.0 / 36.0, 1e-12);
  EXPECT_EQ(r.oom_index, -1);
  EXPECT_TRUE(r.reserved_modelled);
  EXPECT_FALSE(simulate(reqs, AllocatorConfig::parse("backend:cudaMallocAsync")).reserved_modelled);
}

TEST(Simulate, OutOfMemoryIsReportedAndItsFreeSkipped) {
  SimOptions opt;
  opt.capacity_bytes = 30 * MiB;
  SimResult r = simulate({{1, 12 * MiB}, {2, 24 * MiB}, {2, 0}, {1, 0}}, {}, opt);
  EXPECT_EQ(r.oom_index, 1);
  EXPECT_EQ(r.stats.ooms, 1);
  EXPECT_EQ(r.stats.peak_allocated, 12 * MiB);
}

}  // namespace
}  // namespace gpucast

// Real allocator histories recorded on a GPU (bench/gpu/record_histories.py) replayed through the model:
// the simulated peaks must equal what torch.cuda.max_memory_allocated() / max_memory_reserved() reported.
#include <filesystem>
#include <map>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace gpucast {
namespace {

std::vector<std::filesystem::path> histories() {
  std::vector<std::filesystem::path> out;
  const std::filesystem::path dir(GPUCAST_TEST_DATA);
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("alloc_history_", 0) == 0 && name.size() > 5 && name.substr(name.size() - 5) == ".json") {
      out.push_back(e.path());
    }
  }
  return out;
}

TEST(AllocatorHistory, RecordedRunsReplayToTheirRealPeaks) {
  const auto files = histories();
  if (files.empty()) GTEST_SKIP() << "no allocator histories recorded on a GPU yet (bench/gpu/run.sh records them)";
  for (const auto& path : files) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    const auto doc = nlohmann::json::parse(ss.str());
    AllocatorConfig cfg = AllocatorConfig::parse(doc.value("alloc_conf", std::string()));
    std::vector<SimRequest> reqs;
    std::map<int64_t, int> streams;  // CUDA stream handles -> small ids
    for (const auto& e : doc["events"]) {
      const bool alloc = e[0].get<std::string>() == "a";
      const int stream = streams.emplace(e[3].get<int64_t>(), static_cast<int>(streams.size())).first->second;
      reqs.push_back(SimRequest{e[1].get<int64_t>(), alloc ? e[2].get<int64_t>() : 0, stream});
    }
    const SimResult r = simulate(reqs, cfg);
    EXPECT_EQ(r.stats.peak_allocated, doc["max_memory_allocated"].get<int64_t>()) << path;
    EXPECT_EQ(r.stats.peak_reserved, doc["max_memory_reserved"].get<int64_t>()) << path;
  }
}

}  // namespace
}  // namespace gpucast
