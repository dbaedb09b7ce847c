// Built when torch has no CUDA: there is no CUDA allocator to observe.
#include "gpucast/tracer.h"
#include "memory_sink.h"

namespace gpucast {

bool install_cuda_allocator_hook(std::string* /*why*/) { return false; }

bool cuda_device_present() { return false; }

namespace detail {
void cuda_baseline(std::map<std::string, DeviceBaseline>& /*out*/, std::vector<BaselineBlock>& /*blocks*/,
                   std::vector<Note>& /*notes*/) {}
}  // namespace detail

}  // namespace gpucast
