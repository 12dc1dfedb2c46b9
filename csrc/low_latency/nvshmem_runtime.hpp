// NVSHMEM runtime of the low-latency mode: process-wide NVSHMEM initialisation from a unique id, and
// one symmetric buffer per Buffer with the peer mappings, device state and error flags its kernels
// use. Free of torch (the binding layer wraps it) and of NVSHMEM types (only the .cpp includes them).
#pragma once

#include <cstdint>
#include <string>

#include "common/host_flags.hpp"
#include "low_latency/api.cuh"

namespace moe_ep {

class NvshmemRuntime {
   public:
    // Bytes of the unique id that rank 0 creates and every rank passes to `init`.
    static int unique_id_bytes();
    static std::string create_unique_id();
    // Joins this process to the NVSHMEM job of `num_ranks` processes (once per process; again with the
    // same rank and size is a no-op). Collective; the current CUDA device must be this rank's.
    static void init(const std::string& unique_id, int rank, int num_ranks);

    // Allocates `num_bytes` of symmetric memory (collective: every rank calls it in the same order).
    // `puts_only`: every other rank is reached through NVSHMEM puts, even one NVSHMEM maps (tests the
    // path of peers without P2P on one node; not in the P2P-only module). `shrink`: elastic mode, with
    // a rank mask (api.cuh). `ranks_per_node` > 0: ranks of other (virtual) nodes, groups of that many
    // consecutive ranks, are reached through puts likewise.
    NvshmemRuntime(int rank, int num_ranks, int64_t num_bytes, double timeout_s, bool puts_only = false,
                   bool shrink = false, int ranks_per_node = 0);
    ~NvshmemRuntime();
    NvshmemRuntime(const NvshmemRuntime&) = delete;
    NvshmemRuntime& operator=(const NvshmemRuntime&) = delete;

    // `num_bytes` of zeroed symmetric memory on a page of its own (collective: every rank calls it in
    // the same order); throws if NVSHMEM cannot allocate it. Shared with internode mode's runtime.
    static uint8_t* allocate_symmetric(int64_t num_bytes);

    // Frees the symmetric buffer (collective, after a timed barrier: a rank that does not destroy its
    // Buffer makes the others raise). The runtime is unusable afterwards.
    void destroy();

    // Throws if the buffer is destroyed or a kernel gave up waiting for a peer.
    void check_usable() const;
    // The layout of these sizes; throws std::invalid_argument if it does not fit into the buffer.
    kernels::ll::Layout layout(int64_t max_tokens, int64_t hidden, int64_t num_experts) const;
    // `layout`, for an operation about to be sent on `stream`: when the sizes differ from the previous
    // operation's, the buffer is first cleaned (signals of the old layout could alias the new one).
    kernels::ll::Layout prepare(int64_t max_tokens, int64_t hidden, int64_t num_experts, cudaStream_t stream);
    // Zeroes the buffer (all but the persistent words) on `stream`, then waits there for every rank to
    // do the same (a timed barrier; in elastic mode it waits for no rank left out and masks a rank that
    // does not arrive). No operation may be in flight.
    void clean(cudaStream_t stream);
    // Queues a barrier of all ranks on `stream` that gives up after the timeout (the error surfaces
    // through check_usable). Collective: every rank makes the same number of calls.
    void barrier(cudaStream_t stream);

    const kernels::ll::Context& context() const { return ctx_; }
    uint8_t* send_region(const kernels::ll::Layout& layout) const { return base_ + layout.send; }
    uint8_t* base() const { return base_; }
    // Elastic mode: the device rank mask [R] (nonzero = left out); null without it.
    int* mask() const { return mask_; }
    int rank() const { return rank_; }
    int num_ranks() const { return num_ranks_; }
    int device() const { return device_; }
    int64_t num_bytes() const { return num_bytes_; }
    // Whether every rank's buffer is mapped for direct stores (else some peers are reached through NVSHMEM).
    bool all_peers_mapped() const { return all_peers_mapped_; }

   private:
    int rank_, num_ranks_, device_ = -1;
    int64_t num_bytes_;
    double timeout_s_;
    uint8_t* base_ = nullptr;
    uint8_t** peers_ = nullptr;  // device array [num_ranks]
    kernels::ll::State* state_ = nullptr;
    MappedHostFlags flags_;
    int* mask_ = nullptr;           // elastic mode: device memory [R]
    uint64_t* verdicts_ = nullptr;  // elastic mode: device memory [R]
    kernels::ll::Context ctx_{};
    bool all_peers_mapped_ = true;
    bool cleaned_for_next_ = true;  // the buffer is zero: the next layout needs no clean
    int64_t last_key_[3] = {-1, -1, -1};
    uint64_t barrier_epoch_ = 0;  // barrier calls made (the value this rank signals)
};

}  // namespace moe_ep
