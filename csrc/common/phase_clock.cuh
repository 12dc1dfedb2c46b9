// Per-phase timing of the kernels' roles (common/profile.h), recorded only in builds with
// -DMOE_EP_PROFILE.
//
// A role (a warp, or several identical warps) keeps one PhaseClock and calls it at its phase boundaries
// only: `lap(field)` books the time since the previous boundary to `field`, `item()` counts a token,
// slot or row, and `wait(...)` is wait_until that also notes this lane's stall. The role's record is
// written when the clock goes out of scope, on every way out of the role.
//
// Without MOE_EP_PROFILE, PhaseClock is an empty class with the same interface: every call compiles to
// nothing (`wait` is wait_until itself), and the kernels to exactly the code they have without it. It is
// a class of its own rather than the profiling one with its work skipped: that one's unused members
// still changed the order in which NVVM emitted some instructions. .ci/run compiles the kernels both ways.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/comm.cuh"
#include "common/common.cuh"
#include "common/profile.h"

namespace moe_ep::kernels {

// Zeroes the records of `kernel` (prof::Kernel) on `stream`, before the kernel runs.
inline cudaError_t clear_profile(const CommContext& comm, int kernel, cudaStream_t stream) {
#ifdef MOE_EP_PROFILE
    if (comm.profile != nullptr)
        return cudaMemsetAsync(comm.profile + prof::record(kernel, 0, 0), 0, sizeof(int64_t) * prof::kKernelInt64s,
                               stream);
#endif
    return cudaSuccess;
}

// Who writes a role's record: its only warp, or one of several warps that add into it (durations and
// counts summed, the latest end kept), one of which also writes the start, first and SM.
enum class ClockWriter : int { kSole, kShared, kSharedWithTimestamps };

#ifdef MOE_EP_PROFILE
class PhaseClock {
   public:
    // Starts the clock of the role whose record begins `record` values into the profile buffer.
    MOE_EP_DEVICE PhaseClock(const CommContext& comm, int record, ClockWriter writer = ClockWriter::kSole)
        : comm_(comm), record_(record), writer_(writer) {
        start_ = last_ = global_timer_ns();
    }
    MOE_EP_DEVICE ~PhaseClock() { store(); }
    PhaseClock(const PhaseClock&) = delete;
    PhaseClock& operator=(const PhaseClock&) = delete;

    // The time since the previous boundary goes to `field` (none while the role is idle, see idle()).
    MOE_EP_DEVICE void lap(prof::Field field) {
        if (idle_) return;
        const uint64_t now = global_timer_ns();
        acc_[field] += static_cast<uint32_t>(now - last_);  // a role runs for far less than 4 s
        last_ = now;
    }

    // `n` more tokens, slots or rows; the boundary before the first one is the role's `first`.
    MOE_EP_DEVICE void item(uint32_t n = 1) {
        acc_[prof::kItems] += n;
        if (first_ == 0) first_ = last_;
    }

    MOE_EP_DEVICE void count(prof::Field field, uint32_t n) { acc_[field] += n; }

    // A role that polls peers in its own loop: idle() once a poll found nothing (laps stop), busy() once
    // one found work again: the time in between was a wait on peers, one wait event.
    MOE_EP_DEVICE void idle() { idle_ = true; }
    MOE_EP_DEVICE void busy() {
        if (!idle_) return;
        idle_ = false;
        lap(prof::kWaitRemote);
        acc_[prof::kWaitEvents] += 1;
    }

    // wait_until, noting for this lane a stall (the first poll failed) and the time it waited after it.
    template <typename Ready>
    MOE_EP_DEVICE bool wait(Ready&& ready, const CommContext& comm, volatile int* abort, int code) {
        uint64_t stalled_at = 0;
        const bool ok = wait_until(static_cast<Ready&&>(ready), comm, abort, code,
                                   [&] { stalled_at = global_timer_ns(); });
        if (stalled_at != 0) {
            lane_wait_ += global_timer_ns() - stalled_at;
            ++stalls_;
        }
        return ok;
    }

    // The warp starts an item after its lanes waited for peers (wait()): the warp waited as long as its
    // slowest lane (kWaitRemote), once per stalled lane (kWaitEvents); the rest of the time since the
    // previous boundary went to claims and routing metadata (kMeta). All lanes call it.
    MOE_EP_DEVICE void item_after_lane_waits() {
        const uint64_t now = global_timer_ns();
        const uint32_t waited = __reduce_max_sync(kFullMask, static_cast<uint32_t>(lane_wait_));
        const uint32_t spent = static_cast<uint32_t>(now - last_);
        acc_[prof::kWaitRemote] += waited;
        acc_[prof::kMeta] += spent > waited ? spent - waited : 0;
        acc_[prof::kWaitEvents] += __reduce_add_sync(kFullMask, stalls_);
        lane_wait_ = 0;
        stalls_ = 0;
        last_ = now;
        item();
    }

    // Lanes that did different work (one lane per destination): durations and counts become the maximum
    // over the lanes (the warp was held while any lane worked), wait events the sum, `first` the earliest.
    // All lanes call it, once, when the role's work is done.
    MOE_EP_DEVICE void combine_lanes() {
        acc_[prof::kWaitEvents] += stalls_;
        stalls_ = 0;
#pragma unroll
        for (int f = prof::kWaitStage; f < prof::kSm; ++f)
            acc_[f] = f == prof::kWaitEvents ? __reduce_add_sync(kFullMask, acc_[f]) : __reduce_max_sync(kFullMask, acc_[f]);
        uint64_t f0 = first_ == 0 ? ~0ull : first_;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const uint64_t o = __shfl_xor_sync(kFullMask, f0, offset);
            f0 = o < f0 ? o : f0;
        }
        first_ = f0 == ~0ull ? 0 : f0;
    }

   private:
    // Lane 0 writes the record (this lane's own stalls count: only lane 0 waits in a sole role that
    // does not combine its lanes).
    MOE_EP_DEVICE void store() {
        if (comm_.profile == nullptr || (threadIdx.x & 31) != 0) return;
        acc_[prof::kWaitEvents] += stalls_;
        int64_t* rec = comm_.profile + record_;
        const uint64_t end = global_timer_ns();
        if (writer_ != ClockWriter::kShared) {
            rec[prof::kStart] = static_cast<int64_t>(start_);
            rec[prof::kFirst] = static_cast<int64_t>(first_);
            uint32_t sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            rec[prof::kSm] = sm;
        }
        if (writer_ == ClockWriter::kSole) {
            rec[prof::kEnd] = static_cast<int64_t>(end);
            for (int f = prof::kWaitStage; f < prof::kSm; ++f) rec[f] = static_cast<int64_t>(acc_[f]);
            rec[prof::kWriters] = 1;
        } else {
            atomicMax(reinterpret_cast<unsigned long long*>(rec + prof::kEnd), static_cast<unsigned long long>(end));
            for (int f = prof::kWaitStage; f < prof::kSm; ++f)
                if (f != prof::kWriters)
                    atomicAdd(reinterpret_cast<unsigned long long*>(rec + f), static_cast<unsigned long long>(acc_[f]));
            atomicAdd(reinterpret_cast<unsigned long long*>(rec + prof::kWriters), 1ull);
        }
    }

    const CommContext& comm_;  // a kernel parameter: read where the record is written, held in no register
    int record_;
    ClockWriter writer_;
    uint64_t start_ = 0, last_ = 0, first_ = 0;
    uint64_t lane_wait_ = 0;   // this lane's time in wait() since the last item_after_lane_waits
    uint32_t stalls_ = 0;      // this lane's stalls in wait() not yet added to kWaitEvents
    bool idle_ = false;
    uint32_t acc_[prof::kFields] = {};  // durations in ns and counts, by prof::Field
};
#else
class PhaseClock {
   public:
    MOE_EP_DEVICE PhaseClock(const CommContext&, int, ClockWriter = ClockWriter::kSole) {}
    PhaseClock(const PhaseClock&) = delete;
    PhaseClock& operator=(const PhaseClock&) = delete;
    MOE_EP_DEVICE void lap(prof::Field) {}
    MOE_EP_DEVICE void item(uint32_t = 1) {}
    MOE_EP_DEVICE void count(prof::Field, uint32_t) {}
    MOE_EP_DEVICE void idle() {}
    MOE_EP_DEVICE void busy() {}
    template <typename Ready>
    MOE_EP_DEVICE bool wait(Ready&& ready, const CommContext& comm, volatile int* abort, int code) {
        return wait_until(static_cast<Ready&&>(ready), comm, abort, code);
    }
    MOE_EP_DEVICE void item_after_lane_waits() {}
    MOE_EP_DEVICE void combine_lanes() {}
};
#endif

}  // namespace moe_ep::kernels
