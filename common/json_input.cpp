// Safe reading of outside JSON (gpucast/json_input.h).
#include "gpucast/json_input.h"

#include <cmath>
#include <limits>

#include "gpucast/error.h"

namespace gpucast {
namespace {

using nlohmann::json;

// The deepest nesting of [ and { outside strings, stopping at the first byte past `limit`; -1 past it.
// (byte offset of the first too-deep bracket in *at)
int nesting_depth(std::string_view text, int limit, size_t* at) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) {
        *at = i;
        return -1;
      }
      deepest = std::max(deepest, depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// nlohmann's message without its "[json.exception.x.n] " prefix.
std::string reason(const json::exception& e) {
  std::string w = e.what();
  const size_t close = w.find("] ");
  return close == std::string::npos ? w : w.substr(close + 2);
}

}  // namespace

json parse_json_input(std::string_view text, std::string_view source) {
  return parse_json_input(text, source, nullptr);
}

json parse_json_input(std::string_view text, std::string_view source, const json::parser_callback_t& callback) {
  size_t at = 0;
  if (nesting_depth(text, kMaxJsonDepth, &at) < 0) {
    GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: nested more than {} levels deep", source, at + 1,
                       kMaxJsonDepth);
  }
  // JSON text is UTF-8 (RFC 8259, section 8.1); strings with other bytes could not be shown or returned to Python.
  if (const size_t bad = invalid_utf8_at(text); bad != std::string_view::npos) {
    GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: not UTF-8 (byte 0x{:02X})", source, bad + 1,
                       static_cast<unsigned char>(text[bad]));
  }
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::parse_error& e) {
    GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: {}", source, e.byte, valid_utf8(reason(e)));
  } catch (const json::exception& e) {  // out_of_range.406: a number too large for a double (1e400)
    GPUCAST_USER_ERROR("{}: malformed JSON: {}", source, valid_utf8(reason(e)));
  }
}

std::optional<int64_t> json_integer(const json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    const auto s = static_cast<int64_t>(u);
    return s >= lo && s <= hi ? std::optional<int64_t>(s) : std::nullopt;
  }
  if (v.is_number_integer()) {
    const int64_t s = v.get<int64_t>();
    return s >= lo && s <= hi ? std::optional<int64_t>(s) : std::nullopt;
  }
  return std::nullopt;
}

std::optional<double> json_finite(const json& v) {
  if (!v.is_number()) return std::nullopt;
  const double d = v.get<double>();
  return std::isfinite(d) ? std::optional<double>(d) : std::nullopt;
}

std::string json_excerpt(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 200) s = s.substr(0, 197) + "...";
  return valid_utf8(s);
}

}  // namespace gpucast
