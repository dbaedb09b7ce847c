// storage_identity.h: how a trace names a tensor's storage, one rule for the tracer and the plugin's tags.
#pragma once

#include <cstdint>

#include <c10/core/Storage.h>

namespace gpucast {

// The storage's data pointer, which its allocation's memory events carry; a meta storage has no data, and is named
// by the meta allocator wrapper's token, its DataPtr's context (meta_allocator_hook.cpp). 0: nothing to name (a meta
// storage of zero bytes, or one made before the wrapper was installed).
inline uint64_t storage_identity(const c10::Storage& s) {
  const c10::DataPtr& dp = s.data_ptr();
  return reinterpret_cast<uint64_t>(dp.device().is_meta() ? dp.get_context() : dp.get());
}

}  // namespace gpucast
