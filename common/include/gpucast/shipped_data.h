// gpucast/shipped_data.h (common): where the files shipped with the library (weights, tables) are found.
#pragma once

#include <string>

namespace gpucast {

// A file shipped with the library: $env when set and not empty, else data/<name> beside the directory of the
// library holding this code (lib/ and data/ sit side by side in the installed package and in the build tree);
// "" when that library cannot be found. env nullptr: the shipped file whatever the environment says.
std::string shipped_data_file(const char* env, const char* name);

}  // namespace gpucast
