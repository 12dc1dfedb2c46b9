// Host entry points of the low-latency (decode) kernels, modules moe_ep._low_latency and
// moe_ep._low_latency_p2p. Plain C++ and CUDA runtime types only: the NVSHMEM runtime and binding.cpp
// include this header, kernels/ implements it.
//
// Protocol. Every rank owns one symmetric buffer (NVSHMEM heap) with two halves, a send region and
// one acknowledgement word per rank. Operations (dispatches and combines) are numbered in the order
// their send phases run; device counters (advanced by the kernels, so they agree on every rank and
// survive CUDA-graph replays) give the send phase and the receive phase their operation number `seq`.
// Operation `seq` uses half `seq & 1`; its signals carry a 32-bit tag derived from `seq` (never 0), so
// a receiver never mistakes an earlier operation's signal for a fresh one and no signal is cleared.
// Data is stored first, then its signal with release semantics (or NVSHMEM put-with-signal for peers
// without a P2P mapping); receivers acquire the signal, then read. Receive phases run in send order
// (the Python side keeps at most two operations in flight and completes them first in, first out);
// when one ends, every rank learns it through its acknowledgement word, and a send phase first waits
// until every rank has received the operation that used the same half before. A combine's send phase
// also waits for its peers' send phase of the same operation (the top-k weights the experts' ranks
// need to reduce a token's rows before sending them back); every rank runs the send phases in the same
// order, and each phase makes all of its stores before its first wait, so this never forms a cycle.
//
// Elastic mode (`Context::mask` set, Buffer(enable_shrink=True)): a device array of one word per rank,
// nonzero for a rank this rank leaves out. Nothing is stored to a rank left out (acknowledgements and
// barrier signals excepted: they are counters that a rank rejoining later needs), and no wait is made
// for one; a rank whose own word is set leaves every rank out (it sends and receives nothing). A wait
// for a peer that gives up after the timeout sets the peer's word and goes on instead of failing. A
// dispatch's receive phase first decides, once per source, whether that source takes part (all of its
// counts arrived, or it is left out): every warp packs the rows by these verdicts, so that a source
// masked while some warps had already read its counts cannot make them disagree on the layout.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/comm.cuh"

namespace moe_ep::kernels::ll {

// Largest number of (token, top-k slot) entries one dispatch handles: the send phase keeps the top-k
// ids of all tokens in shared memory as int16 (64 KiB).
constexpr int kMaxTopkEntries = 32768;
constexpr int kMaxExperts = 32767;  // expert ids must fit into int16
constexpr int kBlockThreads = 512;

enum Phase : int { kSendPhase = 1, kRecvPhase = 2 };

// What a dispatch sends of a token: its BF16 row as it is, or the FP8 row followed by its
// scales (float32 per 128 channels, or UE8M0 exponents packed four to an int32).
enum class Mode : int { kBF16 = 0, kFP8 = 1, kFP8UE8M0 = 2 };

// The words at the start of the buffer that survive cleans (the sequence numbers do too): [R] u64
// acknowledgements, the number of operations each rank has received; then [R] u64 barrier signals,
// the number of `launch_barrier` calls each rank has made.
constexpr int64_t barrier_offset(int64_t num_ranks) { return num_ranks * 8; }
constexpr int64_t persistent_bytes(int64_t num_ranks) { return align_buffer_bytes(num_ranks * 16); }

// Byte offsets inside the symmetric buffer for one (max tokens M, hidden H, ranks R, experts E):
// `acks` and the barrier signals first (see persistent_bytes). Per half:
//  * `counts` [E_local][R] u64: dispatch counts;
//  * `flags` [E * M] u64 signals: dispatch: one per message, [E_local][R][M], carrying the token;
//    combine: the first R * M, [expert rank][token], one per partial row received;
//  * `data` [E * M] rows of 2H bytes: dispatch: the first R * M, [source rank][token], each token sent
//    once per rank; combine: the first R * M, [expert rank][token], the partial sums of this rank's
//    tokens over each rank's experts;
//  * `meta_flags` [R][M] u64 and `meta` [R][M][kNumMaxTopk] 8-byte entries (int32 expert id, float
//    weight): combine, the top-k ids and weights of token t of source s, sent to every rank that
//    hosts one of its experts.
// Once:
//  * `send`, E * M rows of 2H bytes: the zero-copy combine buffer and the dispatch's staging area for
//    rows put through NVSHMEM;
//  * `rowmap` [R][M][E_local] u64: combine, the packed row of (source, token) in each local expert,
//    tagged with the operation (written and read by this rank only, inside one send phase);
//  * `stage` R * M rows of 2H bytes then `stage_meta` [M][kNumMaxTopk] entries: the combine's staging
//    area for partial rows and metadata put through NVSHMEM.
// moe_ep/ops/config.py `low_latency_buffer_bytes` mirrors `total`.
struct Layout {
    int64_t acks;
    int64_t counts[2];
    int64_t flags[2];
    int64_t data[2];
    int64_t meta_flags[2];
    int64_t meta[2];
    int64_t send;
    int64_t rowmap;
    int64_t stage;
    int64_t stage_meta;
    int64_t total;
    int64_t row_bytes;  // 2H: stride of data, send and dispatch message rows
};

// Bytes of one combine metadata entry per top-k slot (int32 expert id, float weight) and of one token's
// metadata (kNumMaxTopk entries, whatever k is: the layout does not depend on k).
constexpr int kMetaEntryBytes = 8;
constexpr int kMetaBytes = kNumMaxTopk * kMetaEntryBytes;

Layout make_layout(int64_t max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts);

// Lives in ordinary device memory of each rank, zeroed at creation.
struct State {
    uint64_t send_seq;     // operations whose send phase ran
    uint64_t recv_seq;     // operations whose receive phase ran
    uint32_t send_done;    // blocks that finished the current send phase
    uint32_t recv_done;    // blocks that finished the current receive phase
    int abort;             // set on a timeout: every later wait gives up at once
    int barrier_failed;    // set when a launch_barrier timed out
};

// Most ranks of a group in elastic mode (the kernels keep a bit per rank in shared memory).
constexpr int kMaxElasticRanks = 1024;

// Where this rank's kernels find the buffers of every rank.
struct Context {
    uint8_t* local;              // this rank's symmetric buffer
    uint8_t* const* peers;       // device array [R]: each rank's buffer mapped for direct stores, or null
    State* state;                // device memory
    CommContext comm;            // rank, num_ranks, mapped host flags, timeout (peers unused)
    int num_blocks;              // grid size: every block must be resident at once (cooperative launch)
    int* mask;                   // elastic mode: device array [R], nonzero = rank left out; null otherwise
    uint64_t* verdicts;          // elastic mode: device array [R], per source of the current dispatch receive
                                 // (tag << 32 | 1 taking part, 2 left out)
};

struct DispatchArgs {
    const void* x;                  // [T, H] bf16
    const int64_t* topk_idx;        // [T, k]
    void* recv_x;                   // [E_local, R*M, H] fp8 or bf16
    void* recv_scales;              // [E_local, G, R*M] float32 or [E_local, ceil(G/4), R*M] int32, or null
    int* recv_src_info;             // [E_local, R*M]
    int64_t* layout_range;          // [E_local, R]: count | begin << 32
    int* recv_count;                // [E_local]
    int* cumulative_stats;          // [E_local] or null
    int64_t* wait_stats;            // [R] nanoseconds waited per source, or null
    int num_tokens;
    int num_topk;
    int hidden;
    int max_tokens;
    int num_experts;
    Mode mode;
    bool round_scale;
};

struct CombineArgs {
    const void* x;                  // [E_local, R*M, H] bf16 expert outputs (the send region when zero-copy)
    const int* src_info;            // [E_local, R*M] from the dispatch
    const int64_t* layout_range;    // [E_local, R] from the dispatch
    const int64_t* topk_idx;        // [T, k]
    const float* topk_weights;      // [T, k]
    void* out;                      // [T, H] bf16
    int64_t* wait_stats;            // [R] nanoseconds waited per rank (metadata and partial rows), or null
    int num_tokens;
    int num_topk;
    int hidden;
    int max_tokens;
    int num_experts;
    bool logfmt;                    // partial rows travel in LogFMT-10 (kernels/logfmt.cuh; hidden % 128 == 0,
                                    // at most 8192; x is not the send region)
};

// A barrier of all ranks on `stream` with a timeout: signals every rank that this rank made its
// `epoch`-th call, then waits until every rank has made it (`exact`: exactly that many calls, for the
// last barrier of a buffer, so that ranks whose call counts differ all fail instead of some passing).
// The buffer writes queued before it on `stream` are visible to every peer after it. A peer that does
// not arrive within the timeout sets `State::barrier_failed`, the abort word and the host error flag.
cudaError_t launch_barrier(const Context& ctx, uint64_t epoch, bool exact, cudaStream_t stream);

// Launch the phases (`kSendPhase | kRecvPhase`) of one operation on `stream`. The caller checked the
// arguments and that `layout` fits into the buffer.
cudaError_t launch_dispatch(const DispatchArgs& args, const Context& ctx, const Layout& layout, int phases,
                            cudaStream_t stream);
cudaError_t launch_combine(const CombineArgs& args, const Context& ctx, const Layout& layout, int phases,
                           cudaStream_t stream);

// Blocks of a low-latency grid on `device`: one per SM, as many as can be resident together.
int grid_blocks(int device);

// LogFMT-10 (kernels/logfmt.cuh): the hidden sizes it supports are multiples of this many channels
// (a block, one header word) up to this limit.
constexpr int kLogfmtBlock = 128;
constexpr int kLogfmtMaxHidden = 8192;

// LogFMT-10, the combine's wire format, on its own (for tests): encode each BF16 row of `rows` [N, H]
// into `wire` [N, 2H] (`compact` [N]: 1 for the LogFMT layout, 0 for the row's plain bytes; `nbytes`
// [N]: the bytes written), and decode such rows back into BF16 `rows`.
cudaError_t launch_logfmt_encode(const void* rows, void* wire, int* compact, int* nbytes, int num_rows, int hidden,
                                 cudaStream_t stream);
cudaError_t launch_logfmt_decode(const void* wire, const int* compact, void* rows, int num_rows, int hidden,
                                 cudaStream_t stream);

}  // namespace moe_ep::kernels::ll
