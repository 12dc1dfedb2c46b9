// Host-side launch settings that are fixed per device or per (kernel, device), read or set once per process:
// on a busy host every CUDA runtime call costs microseconds, and these would otherwise be paid on every
// launch of the normal-mode and FP8 GEMM kernels. Torch-free (compiled with the kernels).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

namespace moe_ep::kernels {

// The opt-in dynamic shared memory per block of the current device (0 when it cannot be read).
inline int shared_memory_optin() {
    static std::mutex mutex;
    static std::map<int, int> per_device;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 0;
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = per_device.find(device);
    if (it == per_device.end()) {
        int optin = 0;
        if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
        it = per_device.emplace(device, optin).first;
    }
    return it->second;
}

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
