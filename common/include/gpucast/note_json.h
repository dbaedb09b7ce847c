// gpucast/note_json.h (common): a Note as JSON, {"code", "text"} (nlohmann finds it by argument lookup, so a
// forecast's notes serialise as {"notes", f.notes} and a trace's as j["notes"] = trace.notes).
#pragma once

#include <nlohmann/json.hpp>

#include "gpucast/note.h"

namespace gpucast {

inline void to_json(nlohmann::json& j, const Note& n) { j = nlohmann::json{{"code", n.code}, {"text", n.text}}; }

}  // namespace gpucast
