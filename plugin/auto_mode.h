// auto_mode.h (plugin, private): auto mode inside the plugin. GPUCAST_CONF="enabled:True,..." in the environment
// of a process that loads the library (torch.ops.load_library, `import gpucast`, or a LibTorch program linked with
// it): the library arms a trace when it loads, records the first training iteration, forecasts the run from it,
// appends the forecast to GPUCAST_LOG and, before the second iteration commits memory, warns or stops the job.
//
// The iteration begins at the first Optimizer.zero_grad scope or the first op that reads a parameter (a leaf
// tensor that requires grad) with grad mode on, whichever comes first; it ends where the optimizer step scope
// that steps the last parameter holding a gradient ends (several optimizers: the last of them; parameters no
// optimizer steps: the next forward), at a gpucast.iteration_end scope (gpucast/gpucast.h), or at the end of the
// scope named by iteration_scope. docs/design.md ("Auto mode") gives the rules and their sources.
#pragma once

#include <string>

#include "auto_settings.h"

namespace gpucast::auto_mode {

// When the library loads: reads GPUCAST_CONF and arms auto mode where it enables it. Never throws: a bad
// configuration is one line on stderr, auto mode stays off, and the first gpucast op raises it (raise_config_error).
void start_from_environment() noexcept;
// Throws the load-time configuration error (a UserError), once.
void raise_config_error();
// (Re)configures from `text` (GPUCAST_CONF's grammar): whatever runs is stopped, and auto mode is armed when the
// text enables it. `python`: the Python layer reports the verdicts it asks for (auto_poll). Throws UserError.
AutoSettings configure(const std::string& text, bool python);
// Stops auto mode (a trace it runs is dropped).
void stop();
// The Python layer's hooks: at an optimizer step's post-hook (`at_step`) the iteration ends there if that step
// completes it; elsewhere (a module's forward pre-hook) it ends now if it waits for the next forward. Returns
// {"state", "verdict"}: verdict null, or {"risk", "raise", "message", "warnings", "record"}.
std::string poll(bool at_step);
// "auto": this process's GPU as a device table name (resolve_auto_target), else "cpu"; other names as given.
std::string resolve_target(const std::string& target);
// {"state", "settings", "notes", "error", "traced"}: what auto mode is doing; traced: null, or the iteration it
// forecast from: {"ops", "events", "batch", "allocated_by_category"}.
std::string status_json();

}  // namespace gpucast::auto_mode
