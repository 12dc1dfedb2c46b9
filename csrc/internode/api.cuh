// Internode normal mode: the row exchange both of its legs run on (docs/design/internode.md).
//
// One exchange moves byte rows between the members of a team of NVSHMEM PEs (the rail: one rank per
// node; or the node: its ranks): member i sends `send_counts[j]` consecutive rows of its send matrix to
// every member j and receives `recv_counts[j]` rows from each, stored source by source at
// `recv_offsets[j]`. It uses NVSHMEM's standard device API only (put-with-signal, signal op, quiet), so
// it runs over every NVSHMEM transport: NVLink (P2P) inside a node, IBGDA, IBRC, UCX or libfabric across.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/comm.cuh"
#include "common/constants.h"

namespace moe_ep::kernels::internode {

// Members of one team: the nodes of a rail (kNumMaxNodes) or the ranks of a node (kNumMaxNvlPeers).
constexpr int kMaxTeam = kNumMaxNodes;
// PEs of the whole job: the handshake words are indexed by PE.
constexpr int kMaxRanks = kNumMaxNodes * kNumMaxNvlPeers;
constexpr int kBlockThreads = 512;

// Offsets (bytes) into the symmetric buffer, each a multiple of kBufferAlignment. Per channel c and
// member p: `heads[c][p]` (u64, at the sender: chunks member p freed, an NVSHMEM ADD counter),
// `flags[c][p][k]` (u64, at the receiver: the tag of the chunk in slot k of ring (c, p)), and the rings
// `[c][p][ring_rows][row_bytes]` (send: this rank's staging, the put's source; recv: what p put here).
struct Layout {
    int channels, team, chunk_rows, ring_rows, chunks_per_ring;
    int64_t row_bytes;
    int64_t handshake, heads, flags, send_rings, recv_rings, total;
};

// The layout of an exchange; `total` is the buffer it needs. Host-only (kernels/layout.cpp).
Layout make_layout(int channels, int team, int chunk_rows, int ring_rows, int64_t row_bytes);

// Device state of one runtime (not symmetric): the abort word its blocks share.
struct State {
    int abort;
};

struct ExchangeArgs {
    Layout layout;
    uint8_t* buffer;          // this rank's symmetric buffer (the same address names every PE's)
    const uint8_t* send;      // [sum(send_counts), row_bytes], member-major
    uint8_t* recv;            // [sum(recv_counts), row_bytes], member-major
    int pes[kMaxTeam];        // NVSHMEM PE of every member, in team order
    int64_t send_offsets[kMaxTeam], send_counts[kMaxTeam];
    int64_t recv_offsets[kMaxTeam], recv_counts[kMaxTeam];
    int me;                   // this rank's index in the team
    int my_pe;
    uint32_t seq;             // exchanges this runtime ran, this one included: the same on every rank
    CommContext comm;         // rank, flags, timeout (the NVLink peer table is unused)
    State* state;
};

// Queues the exchange on `stream`: 2 * layout.channels blocks (a sender and a receiver per channel).
cudaError_t launch_exchange(const ExchangeArgs& args, cudaStream_t stream);

}  // namespace moe_ep::kernels::internode
