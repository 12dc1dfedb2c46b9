// NVLink buffer shared by the ranks of one node: allocation, CUDA IPC mapping, host-mapped flags.
// Free of torch: the binding layer wraps it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/host_flags.hpp"
#include "common/profile.h"
#include "intranode/api.cuh"

namespace moe_ep {

class NvlRuntime {
   public:
    // Bytes of the record `local_handle()` returns: a CUDA IPC handle, then the data size (int64).
    static constexpr int kHandleBytes = sizeof(cudaIpcMemHandle_t) + sizeof(int64_t);

    NvlRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s);
    ~NvlRuntime();
    NvlRuntime(const NvlRuntime&) = delete;
    NvlRuntime& operator=(const NvlRuntime&) = delete;

    std::string local_handle() const;
    // Maps every peer's buffer; `handles` holds one `local_handle()` record per rank, in rank order.
    void open_peers(const std::vector<std::string>& handles);
    void destroy();

    int rank() const { return rank_; }
    int num_ranks() const { return num_ranks_; }
    int device() const { return device_; }
    // SMs of the device (read once: every launch checks its grid against it).
    int device_sms() const { return device_sms_; }
    int64_t data_bytes() const { return data_bytes_; }
    // This rank's data region (data_bytes() bytes; the control area follows it).
    uint8_t* data() const { return base_; }
    // Launch context with CommContext::pipeline_lag (Config.pipeline_lag, 0 for the kernels' defaults).
    kernels::CommContext comm(int pipeline_lag = 0) const;

    // Throws if the buffer is unusable: destroyed, not yet connected, or a kernel reported an error. Throws
    // std::invalid_argument for a num_worst_tokens overflow that the notify kernel reported (visible once
    // the device ran it) and the host has not raised yet; the buffer is unusable afterwards.
    void check_usable();
    // Waits (host side, with a timeout) until the notify kernel published the received row count;
    // throws like check_usable when a num_worst_tokens overflow cancelled this dispatch.
    int wait_recv_count();
    // Received slots per local expert, as the notify kernel left them.
    std::vector<int> expert_counts(int num_local_experts) const;
    // Resets the host flags before a notify kernel runs; `num_worst_tokens`: the dispatch sizes its outputs
    // itself, so that an overflow may cancel its data kernels (and, until the next notify, those of
    // every cached dispatch).
    void arm_recv_count(bool num_worst_tokens);
    // Whether the latest notify was one of a num_worst_tokens dispatch (see arm_recv_count).
    bool dispatch_may_be_cancelled() const { return may_be_cancelled_; }
    // kernels::CombinePath of the latest combine kernel that ran (the caller synchronizes first).
    int last_combine_path() const;
#ifdef MOE_EP_PROFILE
    // Waits for the device, then copies the per-phase timing records (kernels::prof) to the host.
    std::vector<int64_t> read_profile() const;
#endif

   private:
    [[noreturn]] void fail_from_flags();
    // The device's latest overflow report, read consistently while the device may be writing a new one.
    kernels::WorstTokensOverflow read_overflow() const;
    [[noreturn]] void raise_overflow(const kernels::WorstTokensOverflow& report);

    int rank_, num_ranks_, device_ = -1, device_sms_ = 0;
    int64_t data_bytes_;
    double timeout_s_;
    uint8_t* base_ = nullptr;
    uint8_t* peer_bases_[kNumMaxNvlPeers] = {};
    cudaIpcMemHandle_t ipc_handle_{};
    MappedHostFlags flags_;
    kernels::CommContext comm_{};
    bool connected_ = false;
    bool broken_ = false;
    bool may_be_cancelled_ = false;
    int overflows_raised_ = 0;  // overflow reports (seq / 2) already raised
#ifdef MOE_EP_PROFILE
    int64_t* profile_ = nullptr;  // device memory, kernels::prof::kInt64s values
#endif
    std::string broken_reason_;
};

}  // namespace moe_ep
