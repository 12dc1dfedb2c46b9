// Host-side launch settings that are fixed per device or per (kernel, device), read or set once per process:
// on a busy host every CUDA runtime call costs microseconds, and these would otherwise be paid on every
// launch of the normal-mode and FP8 GEMM kernels. Torch-free (compiled with the kernels).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

namespace moe_ep::kernels {

// An attribute of the current device, read once per (attribute, device) (0 when it cannot be read).
inline int device_attribute(cudaDeviceAttr attribute) {
    static std::mutex mutex;
    static std::map<std::pair<int, int>, int> cache;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 0;
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find({static_cast<int>(attribute), device});
    if (it == cache.end()) {
        int value = 0;
        if (cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) return 0;
        it = cache.emplace(std::make_pair(static_cast<int>(attribute), device), value).first;
    }
    return it->second;
}

// The opt-in dynamic shared memory per block of the current device.
inline int shared_memory_optin() { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin); }

// Allow `kernel` `bytes` of dynamic shared memory on the current device. The attribute is a ceiling, so
// raising it once to the largest size asked so far serves every smaller launch after it.
template <typename Kernel>
cudaError_t allow_dynamic_shared_memory(Kernel kernel, size_t bytes) {
    static std::mutex mutex;
    static std::map<std::pair<const void*, int>, size_t> allowed;
    int device = 0;
    if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    const std::lock_guard<std::mutex> lock(mutex);
    size_t& ceiling = allowed[{reinterpret_cast<const void*>(kernel), device}];
    if (bytes <= ceiling) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(bytes));
    if (err == cudaSuccess) ceiling = bytes;
    return err;
}

}  // namespace moe_ep::kernels
