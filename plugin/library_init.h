// library_init.h (plugin, private): what happens when the library loads (library_init.cpp), and the registrations
// it makes.
#pragma once

#include <string>

#include <torch/library.h>

namespace gpucast {

// One line on stderr, written whole in one write(2) (fprintf may interleave with the job's own output).
void say(const std::string& line);
// The file this copy of the library was loaded from.
std::string this_library_path();
// The ops and classes of torch.ops.gpucast / torch.classes.gpucast (ops.cpp, ops_step_gnn.cpp, ops_workspace.cpp).
void register_ops(torch::Library& m);
void register_step_gnn_ops(torch::Library& m);
void register_workspace_ops(torch::Library& m);

}  // namespace gpucast
