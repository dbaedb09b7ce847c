// note_json.h (predictor, private): a Note as JSON, {"code", "text"} (nlohmann finds it by argument lookup, so a
// forecast's notes serialise as {"notes", f.notes}).
#pragma once

#include <nlohmann/json.hpp>

#include "gpucast/note.h"

namespace gpucast {

inline void to_json(nlohmann::json& j, const Note& n) { j = nlohmann::json{{"code", n.code}, {"text", n.text}}; }

}  // namespace gpucast
