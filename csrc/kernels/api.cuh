// Host entry points of the moe_ep kernels. Plain C++ and CUDA runtime types only: the torch binding
// layer (csrc/*.cpp) includes this header, the kernel files implement it. Low-latency kernels get
// their own section and file (csrc/kernels/low_latency.cu) when they are written.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#ifdef MOE_EP_PROFILE
#if defined(__CUDACC__)
#define MOE_EP_PROF_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_PROF_HOST_DEVICE
#endif
#endif

namespace moe_ep::kernels {

constexpr int kMaxRanks = 8;
constexpr int kMaxChannels = 64;
constexpr int kMaxTopk = 32;
constexpr int kMaxLocalExperts = 256;
constexpr int kMaxStages = 32;
// Normal-mode channels per pair of SMs: `Config.num_sms` SMs give num_sms / 2 * this channels, one block
// per channel. A dispatch block runs its channel's send pipeline and its receiver warps side by side (one
// pipeline's per-token chain of latencies cannot keep an SM busy); a combine block its channel's
// senders and reducers.
constexpr int kChannelsPerSmPair = 2;

// Control area at the end of every rank's NVLink buffer, in ints. Peers write barrier signals, ring
// tails/heads and notify slots into it; the owner clears tails/heads between barriers.
namespace ctrl {
constexpr int kBarrierSignal = 0;                          // [kMaxRanks], monotonically increasing
constexpr int kBarrierEpoch = kMaxRanks;                   // barriers this rank has entered
// Nonzero while dispatch kernels must move nothing: set by this rank's notify_dispatch from its start
// until it found every rank's rows within that rank's num_worst_tokens (all ranks reach one verdict).
constexpr int kDispatchCancelled = kBarrierEpoch + 1;
constexpr int kTail = 32;                                  // [kMaxChannels][kMaxRanks] written by senders
constexpr int kHead = kTail + kMaxChannels * kMaxRanks;    // [kMaxChannels][kMaxRanks] written by receivers
constexpr int kNotify = kHead + kMaxChannels * kMaxRanks;  // [kMaxRanks][kNotifySlot] written by peers
constexpr int kNotifySlot = kMaxRanks + kMaxChannels + kMaxLocalExperts + 8;
// Staged combine: rows of each chunk of source r's staging block that have landed, [kMaxRanks][kStagingChunks],
// raised by r's senders once their bulk stores completed.
constexpr int kStagingChunks = 1024;
constexpr int kStagingReady = kNotify + kMaxRanks * kNotifySlot;
// Staged combine: this rank's claim counters, [0] chunks of rows to send, [1] tokens to reduce.
constexpr int kCombineClaims = kStagingReady + kMaxRanks * kStagingChunks;
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
    int expert_counts[kMaxLocalExperts];  // received slots per local expert, aligned (num_worst_tokens == 0 only)
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
    uint8_t* data[kMaxRanks];
    int* ctrl[kMaxRanks];
};

// What every communication kernel needs to find its peers and report trouble.
struct CommContext {
    PeerTable peers;
    int rank;
    int num_ranks;
    HostFlags* flags;  // device pointer of the mapped host flags
    uint64_t timeout_ns;
    int pipeline_lag;  // bulk stores left in flight per storer thread; 0 = half the stages
#ifdef MOE_EP_PROFILE
    int64_t* profile;  // device buffer of prof::kInt64s values (see below); null disables recording
#endif
};

#ifdef MOE_EP_PROFILE
// Per-phase timing of the normal-mode data kernels (built with -DMOE_EP_PROFILE only). Every role
// (a warp, or a group of identical warps) of every channel owns one record of kFields int64 values,
// written once when the role ends. Timestamps are %globaltimer ns; durations are ns summed over the
// role's loop (for a group of warps: summed over the warps, `kWriters` says how many). The launch
// functions clear their kernel's area first, so a record with kWriters == 0 did not run.
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
    kMeta = 11,       // routing metadata loads (combine reducer: is_token_in_rank, send_head)
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
constexpr int kCombineReducer = kMaxRanks;
constexpr int kRecordInt64s = kRoles * kFields;
constexpr int kKernelInt64s = kMaxChannels * kRecordInt64s;
constexpr int kInt64s = kNumKernels * kKernelInt64s;
MOE_EP_PROF_HOST_DEVICE constexpr int record(int kernel, int channel, int role) {
    return (kernel * kMaxChannels + channel) * kRecordInt64s + role * kFields;
}
}  // namespace prof
#endif

// ---------------------------------------------------------------------------------------------
// Normal mode (intranode NVLink)
// ---------------------------------------------------------------------------------------------

// is_token_in_rank [T, R], num_tokens_per_rank [R], num_tokens_per_expert [E] from topk_idx [T, k].
cudaError_t launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, bool* is_token_in_rank, int* num_tokens_per_rank,
                                   int* num_tokens_per_expert, cudaStream_t stream);

struct NotifyArgs {
    const bool* is_token_in_rank;       // [T, R]
    const int* num_tokens_per_rank;     // [R]
    const int* num_tokens_per_expert;   // [E]
    int num_tokens;
    int num_channels;
    int num_local_experts;
    int expert_alignment;
    int num_worst_tokens;  // this rank's limit, 0 = none (then the host waits for the counts)
    int* channel_prefix_matrix;       // out [R, C]
    int* rank_prefix_matrix;          // out [R, R]
    int* recv_channel_prefix_matrix;  // out [R, C]
};

// Exchanges counts and num_worst_tokens limits with every peer; writes the three prefix matrices and,
// when the host waits (num_worst_tokens == 0), the received row count and per-expert counts into the
// host flags. When some rank would receive more rows than its limit, it cancels the data kernels up to
// the next notify (ctrl::kDispatchCancelled) and reports the overflow (HostFlags::overflow). Also
// resets the ring counters for the next data kernel.
cudaError_t launch_notify_dispatch(const NotifyArgs& args, const CommContext& comm, cudaStream_t stream);

// Barrier, reset of this rank's ring counters, barrier: what a data kernel needs when no notify runs.
cudaError_t launch_prepare_rings(const CommContext& comm, cudaStream_t stream);

struct DispatchArgs {
    const void* x;                  // [T, row_bytes]
    const uint32_t* x_scales;       // [T, G] 4-byte scales with row stride scale_stride, or null
    int64_t scale_stride;
    const int64_t* topk_idx;        // [T, k] or null
    const float* topk_weights;      // [T, k] or null
    const bool* is_token_in_rank;   // [T, R]
    const int* channel_prefix_matrix;       // [R, C] sender side
    const int* recv_channel_prefix_matrix;  // [R, C] receiver side
    const int* rank_prefix_matrix;          // [R, R]
    void* recv_x;                   // [N, row_bytes]
    int num_recv_rows;              // N: rows of every recv_* output
    uint32_t* recv_x_scales;        // [N, G] or null
    int64_t* recv_topk_idx;         // [N, k] or null
    float* recv_topk_weights;       // [N, k] or null
    int* recv_src_idx;              // [N] or null (cached dispatch keeps the handle's)
    int* send_head;                 // [T, R] or null (cached dispatch keeps the handle's)
    int num_tokens;
    int row_bytes;
    int num_scales;
    int num_topk;
    int num_local_experts;
    int num_channels;
    int ring_slots;       // Q: slots of each (channel, source) ring
    int publish_every;    // ring counters are published at least every this many tokens
};

// Ring slot size in bytes for one dispatched token.
int dispatch_slot_bytes(int row_bytes, int num_scales, int num_topk);
int combine_slot_bytes(int row_bytes, int num_topk);
// Stages of a block's stage ring that fit into its shared memory for a slot size (0 if not even two fit).
int max_pipeline_stages(int slot_bytes);

// Moves nothing (it still writes send_head) when the dispatch is cancelled (ctrl::kDispatchCancelled)
// or this rank's rows (from rank_prefix_matrix) exceed num_recv_rows.
cudaError_t launch_dispatch(const DispatchArgs& args, const CommContext& comm, cudaStream_t stream);

// Rows [*num_recv, num_rows) of the dispatch outputs become padding (0 / -1); every row when the
// dispatch was cancelled (as launch_dispatch decides it).
cudaError_t launch_fill_padding(const int* num_recv, int num_rows, int row_bytes, void* recv_x, int num_scales,
                                uint32_t* recv_x_scales, int num_topk, int64_t* recv_topk_idx,
                                float* recv_topk_weights, int* recv_src_idx, const CommContext& comm,
                                cudaStream_t stream);

enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

struct CombineArgs {
    const void* x;                  // [N, H] rows in this rank's dispatch receive layout
    const float* topk_weights;      // [N, k] or null
    const void* bias_0;             // [T, H] or null
    const void* bias_1;             // [T, H] or null
    const int* rank_prefix_matrix;          // [R, R]
    const int* channel_prefix_matrix;       // [R, C] (this rank as dispatch sender)
    const int* recv_channel_prefix_matrix;  // [R, C] (this rank as dispatch receiver)
    const bool* is_token_in_rank;   // [T, R]
    const int* send_head;           // [T, R]
    void* combined_x;               // [T, H]
    float* combined_topk_weights;   // [T, k] or null
    DType dtype;
    int num_tokens;
    int row_bytes;
    int num_topk;
    int num_channels;
    int ring_slots;
    int publish_every;  // rings: tails published at least every this many rows; staged: rows per chunk
    // Staged path when every rank's staging area fits into this many bytes (its NVLink buffer's data
    // region); 0: always the rings. The kernel decides from rank_prefix_matrix, the same way on every rank.
    int64_t staging_bytes;
};

enum CombinePath : int { kCombineNone = 0, kCombineStaged = 1, kCombineRings = 2 };

// Two ways to return the rows, chosen inside the kernel and reported in HostFlags::combine_path:
// - staged (combine_staged.cuh), when every owner's staging area fits: each rank bulk-copies the rows
//   it received from owner d into d's staging area (slot = row + k weights), with no flow control;
//   senders claim chunks of rows and reducers claim tokens from per-rank counters;
// - rings, otherwise: per (channel, rank pair) rings with head/tail flow control, one block per channel.
// Both reduce in the torch backend's order (bias, then ranks 0..R-1 in float32), reading this rank's
// own contribution in place.
cudaError_t launch_combine(const CombineArgs& args, const CommContext& comm, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Grouped FP8 GEMM with blockwise scaling (csrc/kernels/fp8_gemm.cu, sm_90a)
// ---------------------------------------------------------------------------------------------

// Grouped by rows (the experts' forward and input gradients): out[rows of e] = (a * a_scales) @
// (b[e] * b_scales[e])^T for every expert e owning the rows [ends[e-1], ends[e]) of `a`; rows from
// ends[E-1] on become zeros.
// Grouped by depth (the experts' weight gradients, `group_depth`): out[e] = (a[:, K_e] * a_scales) @
// (b[0][:, K_e] * b_scales[0])^T for every expert e, K_e = [ends[e-1], ends[e]) (multiples of 128) of
// the one `a [num_rows, depth]` and `b [1, n_out, depth]`; `out [E, num_rows, n_out]`, num_rows a
// multiple of 128; an expert without columns gets zeros.
// Strides in elements unless named bytes; K (innermost) contiguous in `a` and `b`, and a, b and their
// byte strides 16-byte aligned.
struct Fp8GroupedGemmArgs {
    const void* a;               // [num_rows, depth] e4m3
    int64_t a_row_stride;        // bytes
    const float* a_scales;       // [num_rows, depth / 128]
    int64_t a_scale_row_stride;
    int64_t a_scale_k_stride;
    const void* b;               // [num_experts, n_out, depth] e4m3
    int64_t b_row_stride;        // bytes
    int64_t b_expert_stride;     // bytes
    const float* b_scales;       // [num_experts, n_out / 128, depth / 128]
    int64_t b_scale_expert_stride;
    int64_t b_scale_row_stride;
    int64_t b_scale_k_stride;
    const int* ends;             // [num_experts] cumulative segment ends
    __nv_bfloat16* out;          // [num_rows, n_out], or [num_experts, num_rows, n_out] grouped by depth
    int64_t out_row_stride;
    int64_t out_expert_stride;   // grouped by depth only
    bool group_depth;
    int num_rows;
    int depth;                   // K, a multiple of the tile
    int n_out;                   // a multiple of the tile
    int num_experts;
};

// Rows, columns and K depth of the GEMM's tiles: depth and n_out must be multiples of it.
int fp8_grouped_gemm_tile();
// Whether this binary holds the GEMM for sm_90a and the driver can encode TMA maps (queried once).
bool fp8_grouped_gemm_supported();
cudaError_t launch_fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

// 128x128 blockwise e4m3 cast of BF16 weights `w [num_matrices, rows, cols]` (cols contiguous), with
// the transposed copy the input-gradient GEMM reads: q [m, rows, cols], q_t [m, cols, rows] (both
// contiguous), scales [m, rows / 128, cols / 128] = max(amax, amax_floor) / 448 per block. Rows and
// cols multiples of 128; the arithmetic is that of moe_ep.ops.fp8.per_block_cast_to_fp8, bit for bit.
struct Fp8WeightCastArgs {
    const __nv_bfloat16* w;
    int64_t w_matrix_stride;  // elements
    int64_t w_row_stride;     // elements
    uint8_t* q;
    uint8_t* q_t;
    float* scales;
    int num_matrices;
    int rows;
    int cols;
    float amax_floor;
};
cudaError_t launch_fp8_weight_cast(const Fp8WeightCastArgs& args, cudaStream_t stream);

// Whether the kernels in this binary were compiled for sm_90.
bool is_sm90_compiled();

}  // namespace moe_ep::kernels
