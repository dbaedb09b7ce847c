// gpucast/note.h (common): a forecast's note or warning. The code is stable (lower-case words joined by '-'): tests
// and callers act on it and on the forecast's fields, never on the text, which is for a person and may be reworded.
// docs/design.md lists the codes.
#pragma once

#include <string>

namespace gpucast {

struct Note {
  std::string code;
  std::string text;
  bool operator==(const Note&) const = default;
};

}  // namespace gpucast
