// config_keys.h (plugin, private): the registries of the plugin's user-facing settings, in the configuration
// grammar of gpucast/config.h.
#pragma once

#include <vector>

#include "gpucast/config.h"

namespace gpucast {

// The options of gpucast.trace() / torch.ops.gpucast.start_trace.
std::vector<ConfigKey> trace_config_keys();
// The keys of GPUCAST_CONF (auto mode).
std::vector<ConfigKey> auto_config_keys();

}  // namespace gpucast
