// What every runtime (host side) shares: the CUDA error check, the pinned, device-mapped HostFlags
// (common/comm.cuh) through which kernels report without a synchronization, and what their error codes
// mean. Host-only, header-only.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/comm.cuh"

namespace moe_ep {

inline void cuda_check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// What a kernel's error code (HostFlags::error) means, for the runtimes' messages.
inline const char* describe_error(int code) {
    switch (code) {
        case kernels::kErrBarrierTimeout: return "a peer rank never reached the barrier (it is not calling the same "
                                                 "operation, or it died)";
        case kernels::kErrSendTimeout: return "a receiving rank stopped freeing ring slots";
        case kernels::kErrRecvTimeout: return "a sending rank stopped delivering tokens";
        case kernels::kErrInternalTimeout: return "a pipeline stage never completed";
        default: return "unknown error";
    }
}

// Zeroed HostFlags in pinned host memory mapped into the device; freed with the object or by `release`.
class MappedHostFlags {
   public:
    MappedHostFlags() {
        void* flags = nullptr;
        cuda_check(cudaHostAlloc(&flags, sizeof(kernels::HostFlags), cudaHostAllocMapped), "cudaHostAlloc");
        host_ = static_cast<kernels::HostFlags*>(flags);
        std::memset(host_, 0, sizeof(kernels::HostFlags));
        void* device = nullptr;
        cuda_check(cudaHostGetDevicePointer(&device, flags, 0), "cudaHostGetDevicePointer");
        device_ = static_cast<kernels::HostFlags*>(device);
    }
    ~MappedHostFlags() { release(); }
    MappedHostFlags(const MappedHostFlags&) = delete;
    MappedHostFlags& operator=(const MappedHostFlags&) = delete;

    void release() {
        if (host_ != nullptr) cudaFreeHost(host_);
        host_ = nullptr;
        device_ = nullptr;
    }
    // The host's view: volatile, since kernels write it at any time.
    volatile kernels::HostFlags* host() const { return host_; }
    // The address kernels write to (CommContext::flags).
    kernels::HostFlags* device() const { return device_; }

   private:
    kernels::HostFlags* host_ = nullptr;
    kernels::HostFlags* device_ = nullptr;
};

}  // namespace moe_ep
