// Built when torch has no CUDA (or the toolkit has no CUPTI headers): no device timers.
#include "gpucast/device_timer.h"

namespace gpucast {
#ifndef GPUCAST_WITH_CUPTI
std::unique_ptr<DeviceTimer> make_cupti_timer() { return nullptr; }
#endif
#ifndef GPUCAST_WITH_CUDA
std::unique_ptr<DeviceTimer> make_cuda_event_timer() { return nullptr; }
#endif
}  // namespace gpucast
