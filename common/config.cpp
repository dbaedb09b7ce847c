#include "gpucast/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "gpucast/error.h"

namespace gpucast {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

std::string_view form_text(const ConfigKey& k) {
  switch (k.form) {
    case ConfigKey::Form::Bool: return "True or False";
    case ConfigKey::Form::PositiveInt: return "a positive integer";
    case ConfigKey::Form::NonNegativeInt: return "a non-negative integer";
    case ConfigKey::Form::Fraction: return "a number in (0, 1]";
    case ConfigKey::Form::Choice: return "one of the listed choices";
    case ConfigKey::Form::String: return "a non-empty string";
    case ConfigKey::Form::List: return "a list [a,b,...]";
  }
  return "";
}

std::string expected_text(const ConfigKey& k) {
  if (k.form == ConfigKey::Form::Fraction && k.min_fraction > 0) return fmt::format("a number in [{}, 1]", k.min_fraction);
  if (k.form != ConfigKey::Form::Choice) return std::string(form_text(k));
  std::string s = "one of ";
  for (size_t i = 0; i < k.choices.size(); ++i) s += fmt::format("{}{}", i ? "|" : "", k.choices[i]);
  return s;
}

std::string show(const ConfigValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) return x ? "True" : "False";
        else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          std::string s = "[";
          for (size_t i = 0; i < x.size(); ++i) s += (i ? "," : "") + x[i];
          return s + "]";
        } else if constexpr (std::is_same_v<T, std::string>) return x;
        else return fmt::format("{}", x);
      },
      v);
}

}  // namespace

std::vector<std::pair<std::string, std::string>> split_config(std::string_view text, std::string_view what) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    int depth = 0;
    while (i < text.size() && (depth > 0 || text[i] != ',')) {
      if (text[i] == '[') ++depth;
      if (text[i] == ']') --depth;
      ++i;
    }
    if (depth > 0) GPUCAST_USER_ERROR("{}: unclosed '[' in '{}' (at position {})", what, text.substr(start), start);
    std::string_view item = trim(text.substr(start, i - start));
    ++i;  // skip ','
    if (item.empty()) continue;
    size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      GPUCAST_USER_ERROR("{}: '{}' (at position {}) is not of the form key:value", what, item, start);
    }
    out.emplace_back(std::string(trim(item.substr(0, colon))), std::string(trim(item.substr(colon + 1))));
  }
  return out;
}

Config::Config(std::string what, std::vector<ConfigKey> keys) : what_(std::move(what)), keys_(std::move(keys)) {
  for (const ConfigKey& k : keys_) values_[k.name] = k.fallback;
}

const ConfigKey& Config::key(std::string_view name) const {
  for (const ConfigKey& k : keys_) {
    if (k.name == name) return k;
  }
  std::string valid;
  for (size_t i = 0; i < keys_.size(); ++i) valid += fmt::format("{}{}", i ? ", " : "", keys_[i].name);
  GPUCAST_USER_ERROR("{}: unknown option '{}'; valid options: {}", what_, name, valid);
}

void Config::set(const ConfigKey& k, std::string_view raw) {
  auto bad = [&]() {
    GPUCAST_USER_ERROR("{}: option '{}' expects {}, got '{}'", what_, k.name, expected_text(k), raw);
  };
  switch (k.form) {
    case ConfigKey::Form::Bool:
      if (raw == "True" || raw == "true" || raw == "1") values_[k.name] = true;
      else if (raw == "False" || raw == "false" || raw == "0") values_[k.name] = false;
      else bad();
      break;
    case ConfigKey::Form::PositiveInt:
    case ConfigKey::Form::NonNegativeInt: {
      int64_t v = 0;
      auto [p, ec] = std::from_chars(raw.data(), raw.data() + raw.size(), v);
      if (ec != std::errc() || p != raw.data() + raw.size() || v < (k.form == ConfigKey::Form::PositiveInt ? 1 : 0)) bad();
      if (v > k.max_int) {
        GPUCAST_USER_ERROR("{}: option '{}' expects at most {}, got '{}'", what_, k.name, k.max_int, raw);
      }
      values_[k.name] = v;
      break;
    }
    case ConfigKey::Form::Fraction: {
      const std::optional<double> v = parse_number(raw);
      if (!v || !(*v > 0.0 && *v >= k.min_fraction && *v <= 1.0)) bad();
      values_[k.name] = *v;
      break;
    }
    case ConfigKey::Form::Choice:
      if (std::find(k.choices.begin(), k.choices.end(), raw) == k.choices.end()) bad();
      values_[k.name] = std::string(raw);
      break;
    case ConfigKey::Form::String:
      if (raw.empty()) bad();
      values_[k.name] = std::string(raw);
      break;
    case ConfigKey::Form::List: {
      if (raw.size() < 2 || raw.front() != '[' || raw.back() != ']') bad();
      std::vector<std::string> items;
      std::string_view body = raw.substr(1, raw.size() - 2);
      size_t i = 0;
      while (i <= body.size() && !body.empty()) {
        size_t j = body.find(',', i);
        if (j == std::string_view::npos) j = body.size();
        std::string_view item = trim(body.substr(i, j - i));
        if (item.empty()) bad();
        items.emplace_back(item);
        i = j + 1;
      }
      values_[k.name] = std::move(items);
      break;
    }
  }
  set_[k.name] = true;
}

void Config::parse(std::string_view text) {
  for (const auto& [name, raw] : split_config(text, what_)) set(key(name), raw);
}

const ConfigValue& Config::value(std::string_view name) const {
  key(name);  // throws for unknown names
  return values_.find(name)->second;
}

bool Config::get_bool(std::string_view k) const { return std::get<bool>(value(k)); }
int64_t Config::get_int(std::string_view k) const { return std::get<int64_t>(value(k)); }
double Config::get_double(std::string_view k) const { return std::get<double>(value(k)); }
const std::string& Config::get_string(std::string_view k) const { return std::get<std::string>(value(k)); }
const std::vector<std::string>& Config::get_list(std::string_view k) const {
  return std::get<std::vector<std::string>>(value(k));
}
bool Config::was_set(std::string_view k) const {
  key(k);
  auto it = set_.find(k);
  return it != set_.end() && it->second;
}

std::string Config::describe() const {
  std::string out;
  for (const ConfigKey& k : keys_) {
    out += fmt::format("{:<16} {} (default {}): {}\n", k.name, expected_text(k), show(k.fallback), k.doc);
  }
  return out;
}

std::string ascii_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::optional<double> parse_number(std::string_view text) {
  if (text.empty()) return std::nullopt;
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE) return std::nullopt;
  return v;
}

}  // namespace gpucast
