// direct_tags.h (plugin, private): categories for a trace started with torch.ops.gpucast.start_trace directly (a
// LibTorch program, a script without the Python layer), from autograd's metadata on the thread that started it
// (autograd_tags.h): parameters, their gradients, each iteration's inputs; optimizer state comes from the optimizer
// step's phase (TraceOptions::optimizer_state_from_phase). gpucast.trace() turns it off (trace option
// autograd_tags:False): its module and optimizer hooks tag the same blocks.
#pragma once

#include "gpucast/tracer.h"

namespace gpucast {

// start_trace(options) with the observer, set for the calling thread once the trace runs (start_trace's errors
// as they are: a running trace is left alone).
void start_trace_with_direct_tags(const TraceOptions& options);
// Before the trace stops: tags the parameters and gradients held now. A no-op for a trace without the observer.
void finish_direct_tags() noexcept;

}  // namespace gpucast
