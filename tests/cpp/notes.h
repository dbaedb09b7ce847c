// Test helper: a forecast's notes by their stable codes (gpucast/note.h), not their prose.
#pragma once

#include <string>
#include <vector>

#include "gpucast/note.h"

namespace gpucast::test_util {

// The codes of the notes, in order.
inline std::vector<std::string> codes(const std::vector<Note>& notes) {
  std::vector<std::string> out;
  for (const Note& n : notes) out.push_back(n.code);
  return out;
}

// How many notes carry the code.
inline int count_code(const std::vector<Note>& notes, const std::string& code) {
  int n = 0;
  for (const Note& x : notes) n += x.code == code;
  return n;
}

}  // namespace gpucast::test_util
