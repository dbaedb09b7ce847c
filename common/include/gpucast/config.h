// gpucast/config.h (common): one grammar for every setting, PyTorch's allocator grammar:
//   key:value,key:value,key:[a,b]      booleans True/False
// Each key is declared once in a registry with its form, default and documentation; an unknown key or
// a bad value is an error naming the key, the expected form and what was given.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace gpucast {

using ConfigValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>>;

// 2^40: a chosen bound on an integer setting, far inside int64_t's range.
inline constexpr int64_t kMaxConfigInt = int64_t{1} << 40;

struct ConfigKey {
  enum class Form { Bool, PositiveInt, NonNegativeInt, Fraction, Choice, String, List };
  std::string name;
  Form form;
  ConfigValue fallback;                // default
  std::vector<std::string> choices;    // for Choice
  std::string doc;
  // For the integer forms: the largest value accepted. 2^40 by default: above every count or size gpucast reads
  // (a MiB count times 2^20 stays below 2^63), so no product of one overflows.
  int64_t max_int = kMaxConfigInt;
  // For Fraction: the smallest value accepted (0: any above 0).
  double min_fraction = 0.0;
};

class Config {
 public:
  // `what` names the configuration in errors, e.g. "GPUCAST_CONF" or "gpucast.trace() options".
  Config(std::string what, std::vector<ConfigKey> keys);

  // Parses `text` over the defaults; throws UserError on the first bad item.
  void parse(std::string_view text);

  bool get_bool(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  double get_double(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const std::vector<std::string>& get_list(std::string_view key) const;
  bool was_set(std::string_view key) const;
  const std::vector<ConfigKey>& keys() const { return keys_; }
  // Every key with its form, default and documentation, one per line.
  std::string describe() const;

 private:
  const ConfigKey& key(std::string_view name) const;
  const ConfigValue& value(std::string_view name) const;
  void set(const ConfigKey& key, std::string_view raw);

  std::string what_;
  std::vector<ConfigKey> keys_;
  std::map<std::string, ConfigValue, std::less<>> values_;
  std::map<std::string, bool, std::less<>> set_;
};

// Tokenizer, exposed for tests: "a:1,b:[x,y]" -> {{"a","1"},{"b","[x,y]"}}. Throws UserError
// (naming `what` and the position) for an item without ':' or an unclosed '['.
std::vector<std::pair<std::string, std::string>> split_config(std::string_view text, std::string_view what);

// `text` as a number when all of it is one (strtod's forms) and in double's range; nullopt otherwise. Callers
// check the sign and finiteness they need and word their own errors.
std::optional<double> parse_number(std::string_view text);

// `s` with its ASCII letters lower-cased (names compared without regard to case: devices, GPUs, links).
std::string ascii_lower(std::string s);

}  // namespace gpucast
