// gpucast/json_input.h: reading JSON that came from outside (files, op arguments) safely. Every gpucast parser
// starts with parse_json_input; none calls nlohmann::json::parse on untrusted text itself.
//
// Invariants for what parse_json_input returns: nesting is at most kMaxJsonDepth deep (checked on the text before
// parsing, so no recursion -- nlohmann's dump() or a destructor -- ever meets an attacker's depth), and every error
// is a UserError naming the source, the byte and the reason, in valid UTF-8 (nlohmann's own messages may quote the
// raw bytes they choked on).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

namespace gpucast {

// Deeper than any document gpucast writes (a trace's tensor shapes sit 8 levels down).
inline constexpr int kMaxJsonDepth = 64;

nlohmann::json parse_json_input(std::string_view text, std::string_view source);
// The same, with nlohmann's parser callback (a reader that takes records as they are parsed and drops them).
nlohmann::json parse_json_input(std::string_view text, std::string_view source,
                                const nlohmann::json::parser_callback_t& callback);

// A JSON file read the same way without holding its text: checked in 1 MiB pieces, then parsed from the file.
nlohmann::json parse_json_file(const std::string& path, const nlohmann::json::parser_callback_t& callback);

// `v` as an integer in [lo, hi], or nothing: a float (1e300 cast to an integer is undefined), a number out of
// range (4294967297 read as an int would wrap), or not a number.
std::optional<int64_t> json_integer(const nlohmann::json& v, int64_t lo, int64_t hi);

// `v` as a finite number, or nothing.
std::optional<double> json_finite(const nlohmann::json& v);

// The fields of a parsed document, read checked: every access names the field's path in the document (e.g.
// "ops[3].inputs[1].value") and what was expected when it fails, as a UserError. The parsers of traces and of
// iteration timings read through it.
class JsonFields {
 public:
  explicit JsonFields(std::string_view source) : source_(source) {}
  const std::string& source() const { return source_; }

  const nlohmann::json& field(const nlohmann::json& obj, const char* key, const std::string& where) const {
    if (!obj.is_object()) fail(where, "an object", obj);
    auto it = obj.find(key);
    if (it == obj.end()) missing(where, key);
    return *it;
  }
  template <typename T>
  T get(const nlohmann::json& obj, const char* key, const std::string& where) const {
    return as<T>(field(obj, key, where), path_of(where, key));
  }
  template <typename T>
  T get_or(const nlohmann::json& obj, const char* key, const std::string& where, T fallback) const {
    if (!obj.is_object() || !obj.contains(key)) return fallback;
    return get<T>(obj, key, where);
  }
  // `v` as T, checked: integers in T's range (never a float cast to one), numbers finite, lists element by element.
  template <typename T>
  T as(const nlohmann::json& v, const std::string& path) const {
    if constexpr (std::is_same_v<T, bool>) {
      if (v.is_boolean()) return v.get<bool>();
    } else if constexpr (std::is_same_v<T, uint64_t>) {
      if (v.is_number_unsigned()) return v.get<uint64_t>();
      if (auto x = json_integer(v, 0, std::numeric_limits<int64_t>::max())) return static_cast<uint64_t>(*x);
    } else if constexpr (std::is_integral_v<T>) {
      if (auto x = json_integer(v, std::numeric_limits<T>::min(), std::numeric_limits<T>::max())) {
        return static_cast<T>(*x);
      }
    } else if constexpr (std::is_floating_point_v<T>) {
      if (auto d = json_finite(v)) return static_cast<T>(*d);
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (v.is_string()) return v.get<std::string>();
    } else {
      if (v.is_array()) {
        T out;
        out.reserve(v.size());
        for (size_t i = 0; i < v.size(); ++i) {
          out.push_back(as<typename T::value_type>(v[i], path + "[" + std::to_string(i) + "]"));
        }
        return out;
      }
    }
    fail(path, expected_name<T>(), v);
  }
  [[noreturn]] void fail(const std::string& where, std::string_view expected, const nlohmann::json& got) const;
  [[noreturn]] void missing(const std::string& where, const char* key) const;

 private:
  static std::string path_of(const std::string& where, const char* key) {
    return where.empty() ? std::string(key) : where + "." + key;
  }
  template <typename T>
  static std::string_view expected_name() {
    if constexpr (std::is_same_v<T, std::string>) return "a string";
    else if constexpr (std::is_same_v<T, bool>) return "a boolean";
    else if constexpr (std::is_floating_point_v<T>) return "a finite number";
    else if constexpr (std::is_integral_v<T>) return "an integer in range";
    else if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a list of strings";
    else return "a list of integers";
  }
  std::string source_;
};

// `v` shown in an error message: at most 200 characters of its compact dump (a document's subtree can be large).
std::string json_excerpt(const nlohmann::json& v);

}  // namespace gpucast
