// The profile records of the normal-mode data kernels: plain C++, shared by the kernels that write them
// (through common/phase_clock.cuh), the runtime that allocates them and the binding that returns them.
#pragma once

#include "common/constants.h"

namespace moe_ep::kernels {

// Layout of the profile buffer (CommContext::profile, builds with -DMOE_EP_PROFILE only), which
// moe_ep._C.last_profile returns. Every role (a warp, or a group of identical warps) of every channel
// owns one record of kFields int64 values, written once when the role ends. Timestamps are %globaltimer
// ns; durations are ns summed over the role's loop (for a group of warps: summed over the warps,
// `kWriters` says how many). The launch functions clear their kernel's area first, so a record with
// kWriters == 0 did not run.
namespace prof {
enum Kernel : int { kDispatch = 0, kCombine = 1, kNumKernels = 2 };
constexpr int kRoles = 16;
enum Field : int {
    kStart = 0,       // timestamp: role entered
    kFirst = 1,       // timestamp: first token / slot / row ready to work on
    kEnd = 2,         // timestamp: role left
    kWaitStage = 3,   // waits inside the block: stage full/empty mbarriers, block barriers
    kWaitRemote = 4,  // waits on peers: ring space (heads), announced tokens (tails)
    kCopy = 5,        // issuing copies: metadata loads/stores, bulk copy issue, combine loads + adds + stores
    kCopyWait = 6,    // waiting for bulk copies to complete (cp.async.bulk.wait_group[.read])
    kPublish = 7,     // fences + release stores of tails / heads
    kItems = 8,       // tokens / slots / rows handled
    kWaitEvents = 9,  // remote waits that did not succeed at the first poll
    kWriters = 10,    // warps that wrote this record
    kMeta = 11,       // routing metadata loads and claims (is_token_in_rank, send_head, claim counters)
    kSm = 12,         // the SM the writing warp ran on (fields before it accumulate)
    kFields = 13,
};
// Dispatch roles: sender loader warps, sender storer, send_head writer, the receiver warps (one record).
constexpr int kDispatchLoaders = 4;
constexpr int kDispatchSendStorer = kDispatchLoaders;
constexpr int kDispatchSendHead = kDispatchLoaders + 1;
constexpr int kDispatchRecvCopy = kDispatchLoaders + 2;
// Combine roles: role d is the sender warp for destination d (rings) or sender warp d (staged); the
// reducer warps share one record (staged: sender warps that turned reducers add to it).
constexpr int kCombineReducer = kNumMaxNvlPeers;
constexpr int kRecordInt64s = kRoles * kFields;
constexpr int kKernelInt64s = kNumMaxChannels * kRecordInt64s;
constexpr int kInt64s = kNumKernels * kKernelInt64s;
constexpr int record(int kernel, int channel, int role) {
    return (kernel * kNumMaxChannels + channel) * kRecordInt64s + role * kFields;
}
}  // namespace prof

}  // namespace moe_ep::kernels
