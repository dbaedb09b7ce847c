// The configuration grammar: key:value,key:[a,b], one registry, errors naming key, form and value.
#include <fmt/format.h>
#include <gtest/gtest.h>

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
            "module_paths, nested_ops, max_ops, max_events, device_timing, external_profiler");
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

}  // namespace
}  // namespace gpucast
