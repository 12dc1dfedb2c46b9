#include "low_latency/nvshmem_runtime.hpp"

#include <nvshmem_host.h>

#include <cstring>
#include <stdexcept>
#include <vector>

namespace moe_ep {

namespace {

// The NVSHMEM job this process joined (NVSHMEM is initialised once per process).
int g_rank = -1;
int g_num_ranks = -1;

// The symmetric buffer starts on a page of its own.
constexpr size_t kSymmetricBufferAlignment = 4096;

}  // namespace

int NvshmemRuntime::unique_id_bytes() { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }

std::string NvshmemRuntime::create_unique_id() {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed");
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void NvshmemRuntime::init(const std::string& unique_id, int rank, int num_ranks) {
    if (g_rank >= 0) {
        if (g_rank == rank && g_num_ranks == num_ranks) return;
        throw std::runtime_error("low-latency mode: NVSHMEM already joins this process as rank " +
                                 std::to_string(g_rank) + " of " + std::to_string(g_num_ranks) +
                                 "; every low-latency Buffer of a process must use the same group");
    }
    if (static_cast<int>(unique_id.size()) != unique_id_bytes())
        throw std::invalid_argument("low-latency mode: malformed NVSHMEM unique id");
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) != 0)
        throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
#ifdef MOE_EP_LL_P2P_ONLY
    // The P2P-only module's kernels use no NVSHMEM device API: the host library alone is initialised.
    if (nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
        throw std::runtime_error("nvshmemx_hostlib_init_attr failed");
#else
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) throw std::runtime_error("nvshmemx_init_attr failed");
#endif
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks)
        throw std::runtime_error("low-latency mode: NVSHMEM numbered this process " + std::to_string(nvshmem_my_pe()) +
                                 " of " + std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) +
                                 " of " + std::to_string(num_ranks));
    g_rank = rank;
    g_num_ranks = num_ranks;
}

uint8_t* NvshmemRuntime::allocate_symmetric(int64_t num_bytes) {
    auto* base = static_cast<uint8_t*>(nvshmem_align(kSymmetricBufferAlignment, static_cast<size_t>(num_bytes)));
    if (base == nullptr)
        throw std::runtime_error("nvshmem_align: could not allocate " + std::to_string(num_bytes) +
                                 " bytes of symmetric memory (num_rdma_bytes)");
    cuda_check(cudaMemset(base, 0, num_bytes), "cudaMemset(symmetric buffer)");
    return base;
}

NvshmemRuntime::NvshmemRuntime(int rank, int num_ranks, int64_t num_bytes, double timeout_s, bool puts_only,
                               bool shrink, int ranks_per_node)
    : rank_(rank), num_ranks_(num_ranks), num_bytes_(kernels::align_buffer_bytes(num_bytes)), timeout_s_(timeout_s) {
#ifdef MOE_EP_LL_P2P_ONLY
    if (puts_only)
        throw std::invalid_argument("low-latency mode: the P2P-only module has no put path; "
                                    "MOE_EP_LOW_LATENCY_TRANSPORT=nvshmem_puts uses moe_ep._low_latency");
#endif
    if (g_rank != rank || g_num_ranks != num_ranks)
        throw std::runtime_error("low-latency mode: NVSHMEM is not initialised for rank " + std::to_string(rank) +
                                 " of " + std::to_string(num_ranks));
    if (num_bytes_ <= 0) throw std::invalid_argument("num_rdma_bytes: low-latency mode needs a positive size");
    if (shrink && num_ranks > kernels::ll::kMaxElasticRanks)
        throw std::invalid_argument("enable_shrink: elastic mode serves at most " +
                                    std::to_string(kernels::ll::kMaxElasticRanks) + " ranks, got " +
                                    std::to_string(num_ranks));
    cuda_check(cudaGetDevice(&device_), "cudaGetDevice");
    base_ = allocate_symmetric(num_bytes_);

    // Peers whose buffer NVSHMEM maps into this process are written with plain stores (with
    // `puts_only`, only this rank's own; with `ranks_per_node`, only those of this rank's node).
    std::vector<uint8_t*> peers(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
        const bool other_node = ranks_per_node > 0 && r / ranks_per_node != rank / ranks_per_node;
        peers[r] = (puts_only && r != rank) || other_node ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(base_, r));
        all_peers_mapped_ = all_peers_mapped_ && peers[r] != nullptr;
    }
#ifdef MOE_EP_LL_P2P_ONLY
    if (!all_peers_mapped_)
        throw std::runtime_error("low-latency mode: the P2P-only module needs every rank's buffer mapped for direct "
                                 "stores, NVSHMEM could not map some; set MOE_EP_LOW_LATENCY_TRANSPORT=nvshmem");
#endif
    cuda_check(cudaMalloc(&peers_, sizeof(uint8_t*) * num_ranks), "cudaMalloc(peer table)");
    cuda_check(cudaMemcpy(peers_, peers.data(), sizeof(uint8_t*) * num_ranks, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_check(cudaMalloc(&state_, sizeof(kernels::ll::State)), "cudaMalloc(state)");
    cuda_check(cudaMemset(state_, 0, sizeof(kernels::ll::State)), "cudaMemset(state)");
    if (shrink) {
        cuda_check(cudaMalloc(&mask_, sizeof(int) * num_ranks), "cudaMalloc(rank mask)");
        cuda_check(cudaMemset(mask_, 0, sizeof(int) * num_ranks), "cudaMemset(rank mask)");
        cuda_check(cudaMalloc(&verdicts_, sizeof(uint64_t) * num_ranks), "cudaMalloc(verdicts)");
        cuda_check(cudaMemset(verdicts_, 0, sizeof(uint64_t) * num_ranks), "cudaMemset(verdicts)");
    }
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    // No peer may write into this buffer before it is zeroed. NVSHMEM's barrier, not ours: the zeroing
    // also clears our barrier words. The allocation above is collective in NVSHMEM already (no timeout);
    // the Python side reaches it only after a process-group barrier, which has the group's timeout.
    nvshmem_barrier_all();

    ctx_.local = base_;
    ctx_.peers = peers_;
    ctx_.state = state_;
    ctx_.comm.rank = rank;
    ctx_.comm.num_ranks = num_ranks;
    ctx_.comm.flags = flags_.device();
    ctx_.comm.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
    ctx_.num_blocks = kernels::ll::grid_blocks(device_);
    ctx_.mask = mask_;
    ctx_.verdicts = verdicts_;
}

NvshmemRuntime::~NvshmemRuntime() {
    // The symmetric buffer is only freed by the collective `destroy`; process exit reclaims it otherwise.
    if (base_ == nullptr) return;
    cudaDeviceSynchronize();
    cudaFree(peers_);
    cudaFree(state_);
    cudaFree(mask_);
    cudaFree(verdicts_);
}

void NvshmemRuntime::destroy() {
    if (base_ == nullptr) return;
    // No peer may still write into this buffer. A timed barrier first: nvshmem_free is collective and
    // would wait forever for a rank that never destroys its Buffer.
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    // The last barrier of this buffer counts exactly: ranks that disagree on the number of cleans fail
    // together instead of some of them entering nvshmem_free.
    cuda_check(cudaMemset(&state_->barrier_failed, 0, sizeof(int)), "cudaMemset(state)");
    cuda_check(kernels::ll::launch_barrier(ctx_, ++barrier_epoch_, true, nullptr), "low-latency barrier");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    kernels::ll::State state{};
    cuda_check(cudaMemcpy(&state, state_, sizeof(state), cudaMemcpyDeviceToHost), "cudaMemcpy(state)");
    if (state.barrier_failed)
        throw std::runtime_error("low-latency mode: destroy gave up after " + std::to_string(timeout_s_) +
                                 " s waiting for a peer rank to destroy its Buffer (or the ranks cleaned the "
                                 "buffer a different number of times); the symmetric buffer is not freed");
    nvshmem_free(base_);
    cudaFree(peers_);
    cudaFree(state_);
    cudaFree(mask_);
    cudaFree(verdicts_);
    flags_.release();
    base_ = nullptr;
}

void NvshmemRuntime::check_usable() const {
    if (base_ == nullptr) throw std::runtime_error("low-latency mode: the buffer was destroyed");
    const int code = flags_.host()->error;
    if (code != kernels::kOk)
        throw std::runtime_error("low-latency mode: a kernel gave up after " + std::to_string(timeout_s_) +
                                 " s waiting for a peer rank (it is not calling the same operation, or it died); "
                                 "the buffer is unusable, recreate the process group and Buffer");
}

kernels::ll::Layout NvshmemRuntime::layout(int64_t max_tokens, int64_t hidden, int64_t num_experts) const {
    const kernels::ll::Layout layout = kernels::ll::make_layout(max_tokens, hidden, num_ranks_, num_experts);
    if (layout.total > num_bytes_)
        throw std::invalid_argument("num_rdma_bytes: low-latency mode needs " + std::to_string(layout.total) +
                                    " bytes for num_max_dispatch_tokens_per_rank=" + std::to_string(max_tokens) +
                                    ", hidden=" + std::to_string(hidden) + ", num_experts=" +
                                    std::to_string(num_experts) + "; the Buffer has " + std::to_string(num_bytes_) +
                                    " (size it with get_low_latency_rdma_size_hint)");
    return layout;
}

kernels::ll::Layout NvshmemRuntime::prepare(int64_t max_tokens, int64_t hidden, int64_t num_experts,
                                            cudaStream_t stream) {
    const kernels::ll::Layout result = layout(max_tokens, hidden, num_experts);
    const int64_t key[3] = {max_tokens, hidden, num_experts};
    if (std::memcmp(key, last_key_, sizeof(key)) != 0) {
        if (!cleaned_for_next_) clean(stream);
        std::memcpy(last_key_, key, sizeof(key));
    }
    cleaned_for_next_ = false;
    return result;
}

void NvshmemRuntime::clean(cudaStream_t stream) {
    check_usable();
    // The acknowledgement words keep counting across cleans, like the sequence numbers.
    const int64_t kept = kernels::ll::persistent_bytes(num_ranks_);
    cuda_check(cudaMemsetAsync(base_ + kept, 0, num_bytes_ - kept, stream), "cudaMemsetAsync(symmetric buffer)");
    // Every rank must have zeroed its buffer before any rank sends into it again.
    barrier(stream);
    cleaned_for_next_ = true;
}

void NvshmemRuntime::barrier(cudaStream_t stream) {
    cuda_check(kernels::ll::launch_barrier(ctx_, ++barrier_epoch_, false, stream), "low-latency barrier");
}

}  // namespace moe_ep
