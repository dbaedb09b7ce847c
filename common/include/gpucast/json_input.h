// gpucast/json_input.h: reading JSON that came from outside (files, op arguments) safely. Every gpucast parser
// starts with parse_json_input; none calls nlohmann::json::parse on untrusted text itself.
//
// Invariants for what parse_json_input returns: nesting is at most kMaxJsonDepth deep (checked on the text before
// parsing, so no recursion -- nlohmann's dump() or a destructor -- ever meets an attacker's depth), and every error
// is a UserError naming the source, the byte and the reason, in valid UTF-8 (nlohmann's own messages may quote the
// raw bytes they choked on).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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

// `v` shown in an error message: at most 200 characters of its compact dump (a document's subtree can be large).
std::string json_excerpt(const nlohmann::json& v);

}  // namespace gpucast
