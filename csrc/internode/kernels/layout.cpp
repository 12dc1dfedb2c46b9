// The symmetric buffer's layout of one exchange (internode/api.cuh). Host-only.
#include "internode/api.cuh"

namespace moe_ep::kernels::internode {

namespace {

int64_t aligned(int64_t bytes) { return align_buffer_bytes(bytes); }

}  // namespace

Layout make_layout(int channels, int team, int chunk_rows, int ring_rows, int64_t row_bytes) {
    Layout l{};
    l.channels = channels;
    l.team = team;
    l.chunk_rows = chunk_rows;
    // A ring holds whole chunks, at least two, so that one can fill while the other drains.
    l.chunks_per_ring = ring_rows / chunk_rows < 2 ? 2 : ring_rows / chunk_rows;
    l.ring_rows = l.chunks_per_ring * chunk_rows;
    l.row_bytes = row_bytes;
    const int64_t rings = static_cast<int64_t>(channels) * team;
    l.handshake = 0;  // u64 [kMaxRanks], persistent: the latest exchange each PE entered
    l.heads = aligned(8LL * kMaxRanks);
    l.flags = l.heads + aligned(8 * rings);
    l.send_rings = l.flags + aligned(8 * rings * l.chunks_per_ring);
    l.recv_rings = l.send_rings + aligned(rings * l.ring_rows * row_bytes);
    l.total = l.recv_rings + aligned(rings * l.ring_rows * row_bytes);
    return l;
}

}  // namespace moe_ep::kernels::internode
