// The row exchange of internode normal mode (internode/api.cuh), over NVSHMEM's standard device API.
//
// Block c < C sends channel c of every outgoing stream, block C + c receives channel c of every incoming
// one; stream (i -> j) is split into C consecutive row ranges, one per channel. Each (channel, member)
// pair has a ring of `chunks_per_ring` chunks of `chunk_rows` rows at the receiver and a staging copy at
// the sender (the put's source must be symmetric memory on transports that register it). Protocol:
// - A sender copies a chunk into its staging ring and puts it with a signal: `flags[c][me][slot]` at the
//   receiver becomes `(seq << 32) | (g + 1)` for chunk g. NVSHMEM delivers a put's data before its
//   signal; a flag per chunk needs no ordering between two puts, and the tag makes every value unique
//   over the buffer's life, so flags are never cleared.
// - The receiver copies the chunk out and ADDs 1 to `heads[c][me]` at the sender, which may reuse a slot
//   once its chunk is freed. Additions commute, so a late one never moves a head back.
// - A sender writes to member j only after j's handshake for this exchange arrived (j entered this
//   exchange, so it finished reading its rings of every earlier one, whatever their geometry), and it
//   returns only once every chunk it sent was freed: no ADD of this exchange arrives during a later one.
// Every wait gives up after the timeout (error in the host flags, the block's peers stop through the
// runtime's abort word); a rank that gave up skips nvshmem_quiet, which cannot be timed.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/common.cuh"
#include "internode/api.cuh"

namespace moe_ep::kernels::internode {

namespace {

MOE_EP_DEVICE uint64_t chunk_tag(uint32_t seq, int64_t chunk) {
    return (static_cast<uint64_t>(seq) << 32) | static_cast<uint64_t>(chunk + 1);
}

// Rows [begin, end) of a stream of `rows` rows that channel `c` of `channels` moves.
MOE_EP_DEVICE void channel_rows(int64_t rows, int channels, int c, int64_t& begin, int64_t& count) {
    begin = rows * c / channels;
    count = rows * (c + 1) / channels - begin;
}

// The whole block copies `bytes` (a multiple of 16); loads bypass L1 when the source is a ring a peer wrote.
template <bool kFromPeer>
MOE_EP_DEVICE void copy_block(uint8_t* dst, const uint8_t* src, int64_t bytes) {
    const int64_t n = bytes / 16;
    auto* d = reinterpret_cast<int4*>(dst);
    const auto* s = reinterpret_cast<const int4*>(src);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = kFromPeer ? __ldcg(s + i) : s[i];
}

MOE_EP_DEVICE uint64_t* heads_of(const ExchangeArgs& a, int channel) {
    return reinterpret_cast<uint64_t*>(a.buffer + a.layout.heads) + static_cast<int64_t>(channel) * a.layout.team;
}

MOE_EP_DEVICE uint64_t* flags_of(const ExchangeArgs& a, int channel, int member) {
    return reinterpret_cast<uint64_t*>(a.buffer + a.layout.flags) +
           (static_cast<int64_t>(channel) * a.layout.team + member) * a.layout.chunks_per_ring;
}

MOE_EP_DEVICE int64_t ring_offset(const ExchangeArgs& a, int channel, int member) {
    return (static_cast<int64_t>(channel) * a.layout.team + member) * a.layout.ring_rows * a.layout.row_bytes;
}

// Thread 0 polls `pick()` (a member to serve, or -1) until it yields one or `done()`; the deadline restarts
// whenever something was served. Returns the pick to the whole block, -1 when done, -2 on timeout/abort.
template <typename Pick, typename Done>
MOE_EP_DEVICE int schedule(const ExchangeArgs& a, Pick&& pick, Done&& done, int code) {
    __shared__ int s_pick;
    if (threadIdx.x == 0) {
        int chosen = -1;
        const bool ok = wait_until(
            [&] {
                if (done()) return true;
                chosen = pick();
                return chosen >= 0;
            },
            a.comm, &a.state->abort, code);
        s_pick = ok ? chosen : -2;
    }
    __syncthreads();
    const int result = s_pick;
    __syncthreads();
    return result;
}

__device__ void run_sender(const ExchangeArgs& a, int c) {
    const Layout& l = a.layout;
    __shared__ int64_t s_begin[kMaxTeam], s_rows[kMaxTeam], s_chunks[kMaxTeam], s_sent[kMaxTeam];
    __shared__ uint64_t s_base[kMaxTeam];
    __shared__ int s_entered[kMaxTeam], s_next;
    uint64_t* heads = heads_of(a, c);
    const uint64_t* handshake = reinterpret_cast<const uint64_t*>(a.buffer + l.handshake);
    if (threadIdx.x < l.team) {
        const int p = threadIdx.x;
        channel_rows(a.send_counts[p], l.channels, c, s_begin[p], s_rows[p]);
        s_chunks[p] = (s_rows[p] + l.chunk_rows - 1) / l.chunk_rows;
        s_sent[p] = 0;
        s_entered[p] = 0;
        // Every ADD of earlier exchanges landed before they returned: the counters are at rest.
        s_base[p] = ld_acquire_sys_u64(heads + p);
    }
    if (threadIdx.x == 0) s_next = 0;
    __syncthreads();
    auto all_sent = [&] {
        for (int p = 0; p < l.team; ++p)
            if (s_sent[p] < s_chunks[p]) return false;
        return true;
    };
    auto pick = [&] {
        for (int i = 0; i < l.team; ++i) {
            const int p = (s_next + i) % l.team;
            if (s_sent[p] == s_chunks[p]) continue;
            if (!s_entered[p]) {
                if (ld_acquire_sys_u64(handshake + a.pes[p]) < a.seq) continue;
                s_entered[p] = 1;
            }
            const int64_t freed = static_cast<int64_t>(ld_acquire_sys_u64(heads + p) - s_base[p]);
            if (s_sent[p] - freed >= l.chunks_per_ring) continue;
            s_next = p + 1;
            return p;
        }
        return -1;
    };
    for (;;) {
        const int p = schedule(a, pick, all_sent, kErrSendTimeout);
        if (p == -2) return;
        if (p < 0) break;
        const int64_t g = s_sent[p];
        const int slot = static_cast<int>(g % l.chunks_per_ring);
        const int64_t rows = min(static_cast<int64_t>(l.chunk_rows), s_rows[p] - g * l.chunk_rows);
        const int64_t bytes = rows * l.row_bytes;
        const int64_t slot_offset = static_cast<int64_t>(slot) * l.chunk_rows * l.row_bytes;
        uint8_t* staged = a.buffer + l.send_rings + ring_offset(a, c, p) + slot_offset;
        copy_block<false>(staged, a.send + (a.send_offsets[p] + s_begin[p] + g * l.chunk_rows) * l.row_bytes, bytes);
        __threadfence_system();  // the staged rows reach memory before the transport (a NIC) reads them
        __syncthreads();
        nvshmemx_putmem_signal_nbi_block(a.buffer + l.recv_rings + ring_offset(a, c, a.me) + slot_offset, staged,
                                         static_cast<size_t>(bytes), flags_of(a, c, a.me) + slot,
                                         chunk_tag(a.seq, g), NVSHMEM_SIGNAL_SET, a.pes[p]);
        if (threadIdx.x == 0) ++s_sent[p];
        __syncthreads();
    }
    // Return only once every chunk was freed: no ADD of this exchange may land during the next one.
    auto all_freed = [&] {
        for (int p = 0; p < l.team; ++p)
            if (static_cast<int64_t>(ld_acquire_sys_u64(heads + p) - s_base[p]) < s_chunks[p]) return false;
        return true;
    };
    if (schedule(a, [] { return -1; }, all_freed, kErrSendTimeout) == -2) return;
    if (threadIdx.x == 0) nvshmem_quiet();
}

__device__ void run_receiver(const ExchangeArgs& a, int c) {
    const Layout& l = a.layout;
    __shared__ int64_t s_begin[kMaxTeam], s_rows[kMaxTeam], s_chunks[kMaxTeam], s_got[kMaxTeam];
    __shared__ int s_next;
    if (threadIdx.x < l.team) {
        const int p = threadIdx.x;
        channel_rows(a.recv_counts[p], l.channels, c, s_begin[p], s_rows[p]);
        s_chunks[p] = (s_rows[p] + l.chunk_rows - 1) / l.chunk_rows;
        s_got[p] = 0;
    }
    if (threadIdx.x == 0) s_next = 0;
    __syncthreads();
    auto all_received = [&] {
        for (int p = 0; p < l.team; ++p)
            if (s_got[p] < s_chunks[p]) return false;
        return true;
    };
    auto pick = [&] {
        for (int i = 0; i < l.team; ++i) {
            const int p = (s_next + i) % l.team;
            const int64_t g = s_got[p];
            if (g == s_chunks[p]) continue;
            if (ld_acquire_sys_u64(flags_of(a, c, p) + g % l.chunks_per_ring) != chunk_tag(a.seq, g)) continue;
            s_next = p + 1;
            return p;
        }
        return -1;
    };
    for (;;) {
        const int p = schedule(a, pick, all_received, kErrRecvTimeout);
        if (p == -2) return;
        if (p < 0) break;
        const int64_t g = s_got[p];
        const int64_t rows = min(static_cast<int64_t>(l.chunk_rows), s_rows[p] - g * l.chunk_rows);
        const int64_t slot_offset = (g % l.chunks_per_ring) * l.chunk_rows * l.row_bytes;
        copy_block<true>(a.recv + (a.recv_offsets[p] + s_begin[p] + g * l.chunk_rows) * l.row_bytes,
                         a.buffer + l.recv_rings + ring_offset(a, c, p) + slot_offset, rows * l.row_bytes);
        __syncthreads();  // every thread's loads of the slot are done before it is handed back
        if (threadIdx.x == 0) {
            nvshmemx_signal_op(heads_of(a, c) + a.me, 1, NVSHMEM_SIGNAL_ADD, a.pes[p]);
            ++s_got[p];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) nvshmem_quiet();
}

__global__ void __launch_bounds__(kBlockThreads, 1) exchange_kernel(const __grid_constant__ ExchangeArgs args) {
    const int channel = static_cast<int>(blockIdx.x) % args.layout.channels;
    if (blockIdx.x == 0 && threadIdx.x < args.layout.team) {
        // Tell every member this rank entered the exchange: its rings may be written from now on.
        uint64_t* mine = reinterpret_cast<uint64_t*>(args.buffer + args.layout.handshake) + args.my_pe;
        nvshmemx_signal_op(mine, args.seq, NVSHMEM_SIGNAL_SET, args.pes[threadIdx.x]);
    }
    if (static_cast<int>(blockIdx.x) < args.layout.channels)
        run_sender(args, channel);
    else
        run_receiver(args, channel);
}

}  // namespace

cudaError_t launch_exchange(const ExchangeArgs& args, cudaStream_t stream) {
    exchange_kernel<<<2 * args.layout.channels, kBlockThreads, 0, stream>>>(args);
    return cudaGetLastError();
}

}  // namespace moe_ep::kernels::internode
