// Runtime of internode normal mode: one NVSHMEM symmetric buffer per Buffer, the device state and error
// flags of its exchanges, and the exchange counter that tags their signals. Free of torch (the binding
// wraps it) and of NVSHMEM types (only the .cpp includes them). NVSHMEM itself is joined by the
// low-latency runtime's `NvshmemRuntime::init`, which this module shares.
#pragma once

#include <cstdint>
#include <vector>

#include "common/host_flags.hpp"
#include "internode/api.cuh"

namespace moe_ep {

class InternodeRuntime {
   public:
    // Allocates `num_bytes` of symmetric memory (collective: every rank calls it in the same order).
    InternodeRuntime(int rank, int num_ranks, int64_t num_bytes, double timeout_s);
    ~InternodeRuntime();
    InternodeRuntime(const InternodeRuntime&) = delete;
    InternodeRuntime& operator=(const InternodeRuntime&) = delete;

    // Frees the symmetric buffer (collective and untimed in NVSHMEM: the caller first meets every rank
    // in a timed barrier). The runtime is unusable afterwards.
    void destroy();
    // Throws if the buffer is destroyed or an exchange gave up waiting for a peer.
    void check_usable() const;
    // The layout of an exchange of these sizes; throws std::invalid_argument if it does not fit.
    kernels::internode::Layout layout(int channels, int team, int chunk_rows, int ring_rows, int64_t row_bytes) const;
    // Queues one exchange on `stream` (internode/api.cuh): `pes` are the team's NVSHMEM PEs in team
    // order, `me` this rank's index among them, counts in rows of `row_bytes`.
    void exchange(const uint8_t* send, uint8_t* recv, int64_t row_bytes, const std::vector<int64_t>& pes, int me,
                  const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts, int channels,
                  int chunk_rows, int ring_rows, cudaStream_t stream);

    int rank() const { return rank_; }
    int device() const { return device_; }
    int64_t num_bytes() const { return num_bytes_; }
    uint32_t exchanges() const { return seq_; }

   private:
    int rank_, num_ranks_, device_ = -1;
    int64_t num_bytes_;
    double timeout_s_;
    uint8_t* base_ = nullptr;
    kernels::internode::State* state_ = nullptr;
    MappedHostFlags flags_;
    uint32_t seq_ = 0;
};

}  // namespace moe_ep
