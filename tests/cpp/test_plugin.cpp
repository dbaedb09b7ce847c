// The configuration grammar: key:value,key:[a,b], one registry, errors naming key, form and value.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "auto_settings.h"
#include "config_keys.h"
#include "gpucast/config.h"
#include "gpucast/error.h"

namespace gpucast {
namespace {

class ConfigTest : public ::testing::Test {
 protected:
  Config cfg{"gpucast.trace() options", trace_config_keys()};

  std::string error_of(const std::string& text) {
    try {
      Config c{"gpucast.trace() options", trace_config_keys()};
      c.parse(text);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(ConfigTest, Defaults) {
  EXPECT_TRUE(cfg.get_bool("record_shapes"));
  EXPECT_TRUE(cfg.get_bool("memory"));
  EXPECT_EQ(cfg.get_int("max_ops"), 2000000);
  EXPECT_FALSE(cfg.was_set("max_ops"));
}

TEST_F(ConfigTest, ParsesValues) {
  cfg.parse("record_shapes:False, max_ops:100,memory:True");
  EXPECT_FALSE(cfg.get_bool("record_shapes"));
  EXPECT_EQ(cfg.get_int("max_ops"), 100);
  EXPECT_TRUE(cfg.was_set("max_ops"));
  EXPECT_FALSE(cfg.was_set("max_events"));
}

TEST_F(ConfigTest, UnknownKeyListsValidOnes) {
  EXPECT_EQ(error_of("record_shape:True"),
            "gpucast.trace() options: unknown option 'record_shape'; valid options: record_shapes, memory, "
            "module_paths, nested_ops, max_ops, max_events, device_timing, external_profiler, autograd_tags");
}

TEST_F(ConfigTest, WrongTypesNameExpectedAndGiven) {
  EXPECT_EQ(error_of("max_ops:abc"), "gpucast.trace() options: option 'max_ops' expects a positive integer, got 'abc'");
  EXPECT_EQ(error_of("max_ops:0"), "gpucast.trace() options: option 'max_ops' expects a positive integer, got '0'");
  EXPECT_EQ(error_of("memory:yes"), "gpucast.trace() options: option 'memory' expects True or False, got 'yes'");
}

TEST_F(ConfigTest, MalformedItems) {
  EXPECT_EQ(error_of("max_ops"), "gpucast.trace() options: 'max_ops' (at position 0) is not of the form key:value");
  EXPECT_EQ(error_of("memory:True,x:[a,b"), "gpucast.trace() options: unclosed '[' in 'x:[a,b' (at position 12)");
}

TEST(SplitConfig, ListsKeepTheirCommas) {
  auto items = split_config("a:1,b:[x,y],c: z ", "test");
  ASSERT_EQ(items.size(), 3u);
  EXPECT_EQ(items[1].first, "b");
  EXPECT_EQ(items[1].second, "[x,y]");
  EXPECT_EQ(items[2].second, "z");
}

TEST(ConfigForms, ListChoiceAndFraction) {
  using F = ConfigKey::Form;
  Config c("T", {{"l", F::List, std::vector<std::string>{}, {}, ""},
                 {"mode", F::Choice, std::string("warn"), {"warn", "raise"}, ""},
                 {"frac", F::Fraction, 0.9, {}, ""}});
  c.parse("l:[a, b],mode:raise,frac:0.5");
  EXPECT_EQ(c.get_list("l"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.get_string("mode"), "raise");
  EXPECT_DOUBLE_EQ(c.get_double("frac"), 0.5);
  try {
    c.parse("mode:stop");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "T: option 'mode' expects one of warn|raise, got 'stop'");
  }
  try {
    c.parse("frac:1.5");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "T: option 'frac' expects a number in (0, 1], got '1.5'");
  }
}

TEST(ConfigForms, NonNegativeIntTakesZero) {
  Config c("T", {{"n", ConfigKey::Form::NonNegativeInt, int64_t{5}, {}, ""}});
  c.parse("n:0");
  EXPECT_EQ(c.get_int("n"), 0);
  for (const char* bad : {"n:-1", "n:1.5", "n:"}) {
    try {
      c.parse(bad);
      FAIL() << bad;
    } catch (const UserError& e) {
      EXPECT_EQ(std::string(e.what()), fmt::format("T: option 'n' expects a non-negative integer, got '{}'",
                                                   std::string(bad).substr(2)));
    }
  }
  // The auto mode's capacity_mb: 0 is its default (the device table's capacity), so it may be given.
  Config a("GPUCAST_CONF", auto_config_keys());
  a.parse("capacity_mb:0");
  EXPECT_EQ(a.get_int("capacity_mb"), 0);
}

// --- Auto mode's decisions (auto_settings.h) ---------------------------------------------------------------------

std::string auto_error(const std::string& text) {
  try {
    read_auto_settings(text);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(AutoSettings, DefaultsAndTargets) {
  const AutoSettings d = read_auto_settings("");
  EXPECT_FALSE(d.enabled);
  EXPECT_EQ(d.target, "auto");
  EXPECT_EQ(d.warn_fraction, 0.9);
  EXPECT_FALSE(d.raise);
  EXPECT_EQ(d.max_iteration_ops, 1000000);
  EXPECT_EQ(d.max_iteration_s, 600);
  EXPECT_EQ(read_auto_settings("target:h100-80gb").target, "H100-80GB");  // the table's spelling
  EXPECT_EQ(read_auto_settings("target:CPU").target, "cpu");
  EXPECT_EQ(read_auto_settings("target:MyGPU,capacity_mb:4096").target, "MyGPU");
  const AutoSettings s = read_auto_settings("enabled:True,on_risk:raise,verbose:True,iteration_scope:train_step");
  EXPECT_TRUE(s.enabled && s.raise && s.verbose);
  EXPECT_EQ(s.iteration_scope, "train_step");
}

TEST(AutoSettings, BadValuesAreRefusedWhenRead) {
  EXPECT_EQ(auto_error("target:H100"),
            "[gpucast:auto-config] GPUCAST_CONF: option 'target' expects auto, cpu or a device table name (cpu, "
            "A100-40GB, A100-80GB, H100-80GB, H200-141GB, L4, V100-32GB, RTX-4090), or any name with capacity_mb, "
            "got 'H100'");
  EXPECT_EQ(auto_error("capacity_mb:9223372036854775807"),
            "[gpucast:auto-config] GPUCAST_CONF: option 'capacity_mb' expects at most 16777216, got "
            "'9223372036854775807'");
  EXPECT_EQ(auto_error("warn_fraction:1e-300"),
            "[gpucast:auto-config] GPUCAST_CONF: option 'warn_fraction' expects a number in [0.01, 1], got '1e-300'");
  EXPECT_EQ(auto_error("warn_fraction:0.01"), "");
  EXPECT_EQ(auto_error("on_risk:stop"),
            "[gpucast:auto-config] GPUCAST_CONF: option 'on_risk' expects one of warn|raise, got 'stop'");
  EXPECT_EQ(auto_error("max_iteration_ops:0"),
            "[gpucast:auto-config] GPUCAST_CONF: option 'max_iteration_ops' expects a positive integer, got '0'");
}

MemoryForecast forecast_of(int64_t reserved, int64_t outside, int64_t capacity, int64_t max_batch) {
  MemoryForecast f;
  f.target = "H100-80GB";
  f.batch_size = 64;
  f.peak_allocated_bytes = f.peak_reserved_bytes = reserved;
  f.outside_allocator_bytes = outside;
  f.capacity_bytes = capacity;
  f.max_batch_size = max_batch;
  return f;
}

TEST(AutoSettings, JudgementAndItsMessages) {
  constexpr int64_t MiB = int64_t{1} << 20;
  AutoSettings s;
  AutoVerdict v = judge_forecast(forecast_of(900 * MiB, 100 * MiB, 1000 * MiB, 48), s);
  EXPECT_TRUE(v.judged && v.risk);
  EXPECT_EQ(v.need_bytes, 1000 * MiB);
  EXPECT_EQ(v.message,
            "gpucast: out-of-memory risk on H100-80GB: the run needs 1,000 MiB (reserved 900 MiB + 100 MiB outside "
            "the allocator) at batch 64, above 90% of 1,000 MiB; the largest batch that fits is 48");
  v = judge_forecast(forecast_of(800 * MiB, 100 * MiB, 1000 * MiB, 70), s);  // exactly 90%: fits
  EXPECT_FALSE(v.risk);
  EXPECT_EQ(v.message, "gpucast: fits: peak reserved 800 MiB of 1,000 MiB on H100-80GB; largest batch 70");
  s.capacity_mb = 500;  // the settings' capacity overrides the table's
  v = judge_forecast(forecast_of(800 * MiB, 100 * MiB, 1000 * MiB, 0), s);
  EXPECT_TRUE(v.risk);
  EXPECT_EQ(v.capacity_bytes, 500 * MiB);
  EXPECT_NE(v.message.find("above 90% of 500 MiB; no batch size fits"), std::string::npos);
  v = judge_forecast(forecast_of(8 * MiB, 0, 0, 0), AutoSettings{});  // cpu without a capacity: nothing to judge
  EXPECT_FALSE(v.judged || v.risk);
}

TEST(AutoSettings, TheLogRecord) {
  constexpr int64_t MiB = int64_t{1} << 20;
  AutoRecordContext c;
  c.time = 12.5;
  c.rank = 3;
  c.world_size = 8;
  c.notes.push_back(Note{"interrupted-iteration", "text"});
  const nlohmann::json r = auto_record(judge_forecast(forecast_of(450 * MiB, 0, 1000 * MiB, 9), AutoSettings{}), c);
  EXPECT_EQ(r["schema_version"], 1);
  EXPECT_EQ(r["mode"], "auto");
  EXPECT_EQ(r["rank"], 3);
  EXPECT_EQ(r["world_size"], 8);
  EXPECT_EQ(r["fits"], true);
  EXPECT_EQ(r["capacity_fraction"], 0.45);
  EXPECT_EQ(r["memory"]["peak_reserved_bytes"], 450 * MiB);
  EXPECT_EQ(r["notes"][0]["code"], "interrupted-iteration");
  const nlohmann::json none = auto_record(judge_forecast(forecast_of(MiB, 0, 0, 0), AutoSettings{}), {});
  EXPECT_TRUE(none["fits"].is_null() && none["capacity_fraction"].is_null());
  EXPECT_FALSE(none.contains("rank"));
}

TEST(AutoSettings, AutoTargetFromTheDeviceName) {
  EXPECT_EQ(resolve_auto_target("NVIDIA H100 80GB HBM3", int64_t{80} << 30), "H100-80GB");
  EXPECT_EQ(resolve_auto_target("NVIDIA H200", int64_t{141} << 30), "H200-141GB");
  EXPECT_EQ(resolve_auto_target("NVIDIA A100-SXM4-40GB", int64_t{40} << 30), "A100-40GB");
  EXPECT_EQ(resolve_auto_target("NVIDIA A100-SXM4-80GB", int64_t{80} << 30), "A100-80GB");
  EXPECT_EQ(resolve_auto_target("NVIDIA GeForce RTX 4090", int64_t{24} << 30), "RTX-4090");
  EXPECT_EQ(resolve_auto_target("Some Other GPU", int64_t{24} << 30), "cpu");
  EXPECT_EQ(resolve_auto_target("", 0), "cpu");
}

TEST(AutoSettings, AForecastToJudgeIsReadFieldByField) {
  EXPECT_EQ(memory_forecast_for_judging(R"({"target": "L4", "batch_size": 8, "peak_reserved_bytes": 5,
      "outside_allocator_bytes": 1, "capacity_bytes": 10, "max_batch_size": 2})").peak_reserved_bytes, 5);
  try {
    memory_forecast_for_judging(R"({"target": "L4", "batch_size": 8})");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("peak_reserved_bytes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gpucast

