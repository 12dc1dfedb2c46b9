// What every communication kernel gets, in plain C++ types: the control area of each rank's NVLink
// buffer, the host-mapped flags through which kernels report, and the context (peers, rank, timeout)
// passed to every launch. Shared by the normal and low-latency modes.
#pragma once

#include <cstdint>

#include "common/constants.h"

namespace moe_ep::kernels {

// `bytes` rounded up to a multiple of kBufferAlignment.
constexpr int64_t align_buffer_bytes(int64_t bytes) {
    return (bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
}

// Control area at the end of every rank's NVLink buffer, in ints. Peers write barrier signals, ring
// tails/heads and notify slots into it; the owner clears tails/heads between barriers. Shapes below:
// R = kNumMaxNvlPeers, C = kNumMaxChannels.
namespace ctrl {
constexpr int kBarrierSignal = 0;                                   // [R], monotonically increasing
constexpr int kBarrierEpoch = kNumMaxNvlPeers;                      // barriers this rank has entered
// Nonzero while dispatch kernels must move nothing: set by this rank's notify_dispatch from its start
// until it found every rank's rows within that rank's num_worst_tokens (all ranks reach one verdict).
constexpr int kDispatchCancelled = kBarrierEpoch + 1;
constexpr int kTail = 32;                                           // [C][R] written by senders
constexpr int kHead = kTail + kNumMaxChannels * kNumMaxNvlPeers;    // [C][R] written by receivers
constexpr int kNotify = kHead + kNumMaxChannels * kNumMaxNvlPeers;  // [R][kNotifySlot] written by peers
constexpr int kNotifySlot = kNumMaxNvlPeers + kNumMaxChannels + kNumMaxLocalExperts + 8;
// Staged combine: rows of each chunk of source r's staging block that have landed, [R][kStagingChunks],
// raised by r's senders once their bulk stores completed.
constexpr int kStagingChunks = 1024;
constexpr int kStagingReady = kNotify + kNumMaxNvlPeers * kNotifySlot;
// Staged combine: this rank's claim counters, [0] chunks of rows to send, [1] tokens to reduce.
constexpr int kCombineClaims = kStagingReady + kNumMaxNvlPeers * kStagingChunks;
constexpr int kInts = kCombineClaims + 2;
constexpr int64_t kBytes = (kInts * 4 + 4095) / 4096 * 4096;
}  // namespace ctrl

// A rank that receives more rows than its num_worst_tokens, as the notify kernel found it. The device
// is the only writer: `seq` is odd while it rewrites the fields and grows by 2 per overflow, so that
// the host reads a consistent copy at any time and counts the overflows it has not raised yet.
struct WorstTokensOverflow {
    int seq;
    int rank;
    int rows;
    int limit;
};

// Pinned, device-mapped memory through which kernels report to the host without a synchronization.
struct HostFlags {
    int recv_count;  // rows this rank receives; -1 until the notify kernel writes it (num_worst_tokens == 0 only)
    int error;       // ErrorCode, 0 while everything is fine
    int error_detail;
    int recv_cancelled;  // written with recv_count: 1 when a num_worst_tokens overflow cancelled the dispatch
    int expert_counts[kNumMaxLocalExperts];  // received slots per local expert, aligned (num_worst_tokens == 0 only)
    WorstTokensOverflow overflow;
    int combine_path;  // CombinePath of the latest combine kernel on this rank
};

enum ErrorCode : int {
    kOk = 0,
    kErrBarrierTimeout = 1,     // a peer never reached a barrier
    kErrSendTimeout = 2,        // a receiver never freed ring slots
    kErrRecvTimeout = 3,        // a sender never delivered
    kErrInternalTimeout = 5,    // a pipeline stage inside one block never completed
};

// Base pointers of every rank's NVLink buffer as mapped into this process (own one included).
struct PeerTable {
    uint8_t* data[kNumMaxNvlPeers];
    int* ctrl[kNumMaxNvlPeers];
};

// What every communication kernel needs to find its peers and report trouble.
struct CommContext {
    PeerTable peers;
    int rank;
    int num_ranks;
    HostFlags* flags;  // device pointer of the mapped host flags
    uint64_t timeout_ns;
    // Config.pipeline_lag: bulk stores a sender leaves in flight before it waits for the oldest, 0 for
    // each kernel's default (the dispatch storer: half its stages; the staged combine: kStagedSignalLag).
    int pipeline_lag;
#ifdef MOE_EP_PROFILE
    int64_t* profile;  // device buffer of prof::kInt64s values (common/profile.h); null disables recording
#endif
};

}  // namespace moe_ep::kernels
