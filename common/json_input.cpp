// Safe reading of outside JSON (gpucast/json_input.h).
#include "gpucast/json_input.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "gpucast/error.h"

namespace gpucast {
namespace {

using nlohmann::json;

// What parse_json_input checks before parsing, fed the text in pieces: nesting of [ and { outside strings at most
// kMaxJsonDepth, and well-formed UTF-8 (a sequence may straddle two pieces). The first failure is kept.
class Precheck {
 public:
  explicit Precheck(std::string_view source) : source_(source) {}
  void feed(std::string_view piece) {
    std::string joined;
    if (!carry_.empty()) {  // an incomplete UTF-8 sequence from the previous piece
      joined = carry_ + std::string(piece);
      piece = joined;
      offset_ -= carry_.size();
      carry_.clear();
    }
    const size_t bad = invalid_utf8_at(piece);
    size_t usable = piece.size();
    if (bad != std::string_view::npos) {
      // At most 3 bytes at the end may be the start of a sequence that the next piece completes.
      if (piece.size() - bad <= 3 && starts_sequence(piece.substr(bad))) {
        carry_ = std::string(piece.substr(bad));
        usable = bad;
      } else {
        GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: not UTF-8 (byte 0x{:02X})", source_, offset_ + bad + 1,
                           static_cast<unsigned char>(piece[bad]));
      }
    }
    for (size_t i = 0; i < usable; ++i) {
      const char c = piece[i];
      if (in_string_) {
        if (escaped_) escaped_ = false;
        else if (c == '\\') escaped_ = true;
        else if (c == '"') in_string_ = false;
      } else if (c == '"') {
        in_string_ = true;
      } else if (c == '[' || c == '{') {
        if (++depth_ > kMaxJsonDepth) {
          GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: nested more than {} levels deep", source_,
                             offset_ + i + 1, kMaxJsonDepth);
        }
      } else if (c == ']' || c == '}') {
        --depth_;
      }
    }
    offset_ += piece.size();
  }
  void finish() {
    if (!carry_.empty()) {
      GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: not UTF-8 (byte 0x{:02X})", source_,
                         offset_ - carry_.size() + 1, static_cast<unsigned char>(carry_[0]));
    }
  }

 private:
  // `tail` (1 to 3 bytes) is a UTF-8 lead byte followed by continuation bytes only: a sequence cut short.
  static bool starts_sequence(std::string_view tail) {
    const auto b = static_cast<unsigned char>(tail[0]);
    if (b < 0xC2 || b > 0xF4) return false;
    for (size_t k = 1; k < tail.size(); ++k) {
      if ((static_cast<unsigned char>(tail[k]) & 0xC0) != 0x80) return false;
    }
    return true;
  }
  std::string source_, carry_;
  size_t offset_ = 0;
  int depth_ = 0;
  bool in_string_ = false, escaped_ = false;
};

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
  Precheck check(source);
  check.feed(text);
  check.finish();
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::parse_error& e) {
    GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: {}", source, e.byte, valid_utf8(reason(e)));
  } catch (const json::exception& e) {  // out_of_range.406: a number too large for a double (1e400)
    GPUCAST_USER_ERROR("{}: malformed JSON: {}", source, valid_utf8(reason(e)));
  }
}

json parse_json_file(const std::string& path, const json::parser_callback_t& callback) {
  // Checked in pieces, then parsed from the file: the text is never held whole (a trace file can be gigabytes).
  std::ifstream in(path, std::ios::binary);
  if (!in) GPUCAST_USER_ERROR("cannot read '{}': {}", path, std::strerror(errno));
  Precheck check(path);
  // 1 MiB pieces: a chosen size, not measured.
  std::string piece(size_t{1} << 20, '\0');
  while (in) {
    in.read(piece.data(), static_cast<std::streamsize>(piece.size()));
    check.feed(std::string_view(piece.data(), static_cast<size_t>(in.gcount())));
  }
  if (in.bad()) GPUCAST_USER_ERROR("cannot read '{}': {}", path, std::strerror(errno));
  check.finish();
  in.clear();
  in.seekg(0);
  try {
    return json::parse(in, callback);
  } catch (const json::parse_error& e) {
    GPUCAST_USER_ERROR("{}: malformed JSON at byte {}: {}", path, e.byte, valid_utf8(reason(e)));
  } catch (const json::exception& e) {
    GPUCAST_USER_ERROR("{}: malformed JSON: {}", path, valid_utf8(reason(e)));
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
  // 200 characters: a chosen length for an error message's excerpt (197 and "...").
  if (s.size() > 200) s = s.substr(0, 197) + "...";
  return valid_utf8(s);
}

void JsonFields::fail(const std::string& where, std::string_view expected, const json& got) const {
  GPUCAST_USER_ERROR("{}: field '{}' should be {}, got {}", source_, where, expected, json_excerpt(got));
}

void JsonFields::missing(const std::string& where, const char* key) const {
  GPUCAST_USER_ERROR("{}: missing field '{}{}{}'", source_, where, where.empty() ? "" : ".", key);
}

}  // namespace gpucast
