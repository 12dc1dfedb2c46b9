#include "internode/runtime.hpp"

#include "low_latency/nvshmem_runtime.hpp"

#include <nvshmem_host.h>

#include <stdexcept>
#include <string>

namespace moe_ep {

namespace in = kernels::internode;

InternodeRuntime::InternodeRuntime(int rank, int num_ranks, int64_t num_bytes, double timeout_s)
    : rank_(rank), num_ranks_(num_ranks), num_bytes_(kernels::align_buffer_bytes(num_bytes)), timeout_s_(timeout_s) {
    if (num_bytes_ <= 0) throw std::invalid_argument("num_rdma_bytes: internode mode needs a positive size");
    if (num_ranks > in::kMaxRanks)
        throw std::invalid_argument("group: internode mode serves at most " + std::to_string(in::kMaxRanks) +
                                    " ranks, got " + std::to_string(num_ranks));
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks)
        throw std::runtime_error("internode mode: NVSHMEM numbered this process " + std::to_string(nvshmem_my_pe()) +
                                 " of " + std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) +
                                 " of " + std::to_string(num_ranks));
    cuda_check(cudaGetDevice(&device_), "cudaGetDevice");
    base_ = NvshmemRuntime::allocate_symmetric(num_bytes_);
    cuda_check(cudaMalloc(&state_, sizeof(in::State)), "cudaMalloc(state)");
    cuda_check(cudaMemset(state_, 0, sizeof(in::State)), "cudaMemset(state)");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    // No peer may write into this buffer before it is zeroed (the Python side reached the collective
    // allocation above through a timed process-group barrier).
    nvshmem_barrier_all();
}

InternodeRuntime::~InternodeRuntime() {
    // The symmetric buffer is only freed by the collective `destroy`; process exit reclaims it otherwise.
    if (base_ == nullptr) return;
    cudaDeviceSynchronize();
    cudaFree(state_);
}

void InternodeRuntime::destroy() {
    if (base_ == nullptr) return;
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    nvshmem_free(base_);
    cudaFree(state_);
    flags_.release();
    base_ = nullptr;
}

void InternodeRuntime::check_usable() const {
    if (base_ == nullptr) throw std::runtime_error("internode mode: the buffer was destroyed");
    const int code = flags_.host()->error;
    if (code != kernels::kOk)
        throw std::runtime_error(std::string("internode mode: an exchange gave up after ") +
                                 std::to_string(timeout_s_) + " s: " + describe_error(code) +
                                 " (a peer is not calling the same operation, or it died); the buffer is unusable, "
                                 "recreate the process group and Buffer");
}

in::Layout InternodeRuntime::layout(int channels, int team, int chunk_rows, int ring_rows, int64_t row_bytes) const {
    if (channels < 1 || channels > kNumMaxChannels)
        throw std::invalid_argument("config.num_sms: internode mode runs 1 to " + std::to_string(kNumMaxChannels) +
                                    " channels (two SMs each), got " + std::to_string(channels));
    if (team < 1 || team > in::kMaxTeam)
        throw std::invalid_argument("internode mode: a team of " + std::to_string(team) + " ranks (1 to " +
                                    std::to_string(in::kMaxTeam) + " expected)");
    if (chunk_rows < 1 || ring_rows < chunk_rows)
        throw std::invalid_argument("config.num_max_rdma_chunked_send_tokens: expected 1 <= send chunk <= "
                                    "num_max_rdma_chunked_recv_tokens, got " + std::to_string(chunk_rows) + " and " +
                                    std::to_string(ring_rows));
    if (row_bytes <= 0 || row_bytes % 16 != 0)
        throw std::invalid_argument("internode mode: rows of " + std::to_string(row_bytes) +
                                    " bytes (a positive multiple of 16 expected)");
    const in::Layout l = in::make_layout(channels, team, chunk_rows, ring_rows, row_bytes);
    if (l.total > num_bytes_)
        throw std::invalid_argument("num_rdma_bytes: internode mode needs " + std::to_string(l.total) +
                                    " bytes for rows of " + std::to_string(row_bytes) + " bytes, " +
                                    std::to_string(team) + " peers and " + std::to_string(channels) +
                                    " channels; the Buffer has " + std::to_string(num_bytes_) +
                                    " (size it with Config.get_rdma_buffer_size_hint)");
    return l;
}

void InternodeRuntime::exchange(const uint8_t* send, uint8_t* recv, int64_t row_bytes, const std::vector<int64_t>& pes,
                                int me, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& recv_counts, int channels, int chunk_rows, int ring_rows,
                                cudaStream_t stream) {
    check_usable();
    const int team = static_cast<int>(pes.size());
    in::ExchangeArgs a{};
    a.layout = layout(channels, team, chunk_rows, ring_rows, row_bytes);
    if (static_cast<int>(send_counts.size()) != team || static_cast<int>(recv_counts.size()) != team)
        throw std::invalid_argument("internode mode: one send and one receive count per team member expected");
    if (me < 0 || me >= team || pes[me] != rank_)
        throw std::invalid_argument("internode mode: this rank is not the team member it claims to be");
    a.buffer = base_;
    a.send = send;
    a.recv = recv;
    int64_t sent = 0, received = 0;
    for (int p = 0; p < team; ++p) {
        if (pes[p] < 0 || pes[p] >= num_ranks_) throw std::invalid_argument("internode mode: a PE out of range");
        if (send_counts[p] < 0 || recv_counts[p] < 0) throw std::invalid_argument("internode mode: a negative count");
        a.pes[p] = static_cast<int>(pes[p]);
        a.send_offsets[p] = sent;
        a.send_counts[p] = send_counts[p];
        a.recv_offsets[p] = received;
        a.recv_counts[p] = recv_counts[p];
        sent += send_counts[p];
        received += recv_counts[p];
    }
    a.me = me;
    a.my_pe = rank_;
    a.seq = ++seq_;
    a.comm.rank = rank_;
    a.comm.num_ranks = num_ranks_;
    a.comm.flags = flags_.device();
    a.comm.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
    a.state = state_;
    cuda_check(in::launch_exchange(a, stream), "internode exchange");
}

}  // namespace moe_ep
