#include "intranode/runtime.hpp"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace moe_ep {

NvlRuntime::NvlRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s)
    : rank_(rank), num_ranks_(num_ranks), data_bytes_(kernels::align_buffer_bytes(num_nvl_bytes)), timeout_s_(timeout_s) {
    if (num_ranks < 1 || num_ranks > kNumMaxNvlPeers)
        throw std::invalid_argument("group: the CUDA backend serves 1 to 8 ranks inside one node, got " +
                                    std::to_string(num_ranks));
    cuda_check(cudaGetDevice(&device_), "cudaGetDevice");
    cuda_check(cudaDeviceGetAttribute(&device_sms_, cudaDevAttrMultiProcessorCount, device_),
               "cudaDeviceGetAttribute");
    cuda_check(cudaMalloc(&base_, data_bytes_ + kernels::ctrl::kBytes), "cudaMalloc(NVLink buffer)");
    cuda_check(cudaMemset(base_ + data_bytes_, 0, kernels::ctrl::kBytes), "cudaMemset");
    cuda_check(cudaIpcGetMemHandle(&ipc_handle_, base_), "cudaIpcGetMemHandle");
    flags_.host()->recv_count = -1;
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    comm_.rank = rank;
    comm_.num_ranks = num_ranks;
    comm_.flags = flags_.device();
    comm_.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
#ifdef MOE_EP_PROFILE
    cuda_check(cudaMalloc(&profile_, sizeof(int64_t) * kernels::prof::kInt64s), "cudaMalloc(profile)");
    cuda_check(cudaMemset(profile_, 0, sizeof(int64_t) * kernels::prof::kInt64s), "cudaMemset(profile)");
    comm_.profile = profile_;
#endif
}

NvlRuntime::~NvlRuntime() {
    try {
        destroy();
    } catch (...) {
    }
}

std::string NvlRuntime::local_handle() const {
    std::string record(kHandleBytes, '\0');
    std::memcpy(record.data(), &ipc_handle_, sizeof(ipc_handle_));
    std::memcpy(record.data() + sizeof(ipc_handle_), &data_bytes_, sizeof(data_bytes_));
    return record;
}

void NvlRuntime::open_peers(const std::vector<std::string>& handles) {
    if (static_cast<int>(handles.size()) != num_ranks_) throw std::invalid_argument("open_peers: one handle per rank");
    for (int r = 0; r < num_ranks_; ++r) {
        if (static_cast<int>(handles[r].size()) != kHandleBytes) throw std::invalid_argument("open_peers: bad handle");
        int64_t peer_bytes = 0;
        std::memcpy(&peer_bytes, handles[r].data() + sizeof(cudaIpcMemHandle_t), sizeof(peer_bytes));
        if (peer_bytes != data_bytes_)
            throw std::invalid_argument("num_nvl_bytes: ranks disagree (rank " + std::to_string(r) + " has " +
                                        std::to_string(peer_bytes) + ", this rank " + std::to_string(data_bytes_) +
                                        ")");
    }
    for (int r = 0; r < num_ranks_; ++r) {
        if (r == rank_) {
            peer_bases_[r] = base_;
        } else {
            cudaIpcMemHandle_t handle;
            std::memcpy(&handle, handles[r].data(), sizeof(handle));
            void* ptr = nullptr;
            cuda_check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
            peer_bases_[r] = static_cast<uint8_t*>(ptr);
        }
        comm_.peers.data[r] = peer_bases_[r];
        comm_.peers.ctrl[r] = reinterpret_cast<int*>(peer_bases_[r] + data_bytes_);
    }
    connected_ = true;
}

void NvlRuntime::destroy() {
    if (base_ == nullptr) return;
    cudaDeviceSynchronize();
    for (int r = 0; r < num_ranks_; ++r)
        if (r != rank_ && peer_bases_[r] != nullptr) cudaIpcCloseMemHandle(peer_bases_[r]);
    cudaFree(base_);
    flags_.release();
#ifdef MOE_EP_PROFILE
    cudaFree(profile_);
    profile_ = nullptr;
    comm_.profile = nullptr;
#endif
    base_ = nullptr;
    connected_ = false;
    broken_ = true;
    broken_reason_ = "the buffer was destroyed";
}

kernels::CommContext NvlRuntime::comm(int pipeline_lag) const {
    kernels::CommContext ctx = comm_;
    ctx.pipeline_lag = pipeline_lag;
    return ctx;
}

void NvlRuntime::check_usable() {
    if (broken_) throw std::runtime_error("moe_ep CUDA backend unusable: " + broken_reason_);
    if (!connected_) throw std::runtime_error("moe_ep CUDA backend: peers are not connected yet");
    // An overflow first: it may be what made a later kernel of some rank time out.
    const kernels::WorstTokensOverflow overflow = read_overflow();
    if (overflow.seq / 2 > overflows_raised_) raise_overflow(overflow);
    const int code = flags_.host()->error;
    if (code != kernels::kOk)
        throw std::runtime_error(std::string("moe_ep CUDA backend: an earlier kernel failed: ") + describe_error(code) +
                                 "; the buffer is unusable, recreate the process group and Buffer");
}

kernels::WorstTokensOverflow NvlRuntime::read_overflow() const {
    const volatile kernels::WorstTokensOverflow* live = &flags_.host()->overflow;
    kernels::WorstTokensOverflow copy{};
    // The device rewrites the fields within microseconds; should it die in between, a torn report is
    // still a report.
    for (int attempt = 0; attempt < (1 << 20); ++attempt) {
        copy = {live->seq, live->rank, live->rows, live->limit};
        if (copy.seq % 2 == 0 && live->seq == copy.seq) return copy;
    }
    copy.seq += copy.seq % 2;
    return copy;
}

void NvlRuntime::raise_overflow(const kernels::WorstTokensOverflow& report) {
    const int unraised = report.seq / 2 - overflows_raised_;
    overflows_raised_ = report.seq / 2;
    // Each rank raises at the first call that finds the report, so the ranks may have stopped at different
    // calls: going on could pair different operations across ranks.
    broken_ = true;
    broken_reason_ = "a dispatch's num_worst_tokens was too small (raised as ValueError); create a new Buffer on "
                     "every rank";
    std::string message = "num_worst_tokens: too small, rank " + std::to_string(report.rank) + " receives " +
                          std::to_string(report.rows) + " rows, more than its num_worst_tokens=" +
                          std::to_string(report.limit) + "; that dispatch was cancelled on every rank (no data "
                          "moved, its outputs are padding, its handle is invalid)";
    if (unraised > 1) message += " (" + std::to_string(unraised) + " dispatches overflowed)";
    throw std::invalid_argument(message + "; the Buffer is unusable now: create a new one on every rank");
}

int NvlRuntime::last_combine_path() const {
    return flags_.host()->combine_path;
}

void NvlRuntime::arm_recv_count(bool num_worst_tokens) {
    flags_.host()->recv_count = -1;
    may_be_cancelled_ = num_worst_tokens;
}

int NvlRuntime::wait_recv_count() {
    volatile kernels::HostFlags* flags = flags_.host();
    const auto start = std::chrono::steady_clock::now();
    const double limit_s = 2 * timeout_s_ + 10;
    for (long spins = 0;; ++spins) {
        // The kernel publishes the count last, also when it failed: errors are read after it.
        const int count = flags->recv_count;
        if (count >= 0) {
            if (flags->error != kernels::kOk) fail_from_flags();
            // Every rank's dispatch kernel of this call moves nothing, so not launching it here is safe.
            if (flags->recv_cancelled) raise_overflow(read_overflow());
            return count;
        }
        if ((spins & 1023) == 1023) {
            const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > limit_s) {
                broken_ = true;
                broken_reason_ = "the notify kernel did not report within " + std::to_string(limit_s) + " s";
                throw std::runtime_error("moe_ep CUDA backend: " + broken_reason_);
            }
            std::this_thread::yield();
        }
    }
}

void NvlRuntime::fail_from_flags() {
    const int code = flags_.host()->error;
    broken_ = true;
    broken_reason_ = describe_error(code);
    throw std::runtime_error(std::string("moe_ep CUDA backend: ") + describe_error(code) + " (kernel timeout after " +
                             std::to_string(timeout_s_) + " s)");
}

std::vector<int> NvlRuntime::expert_counts(int num_local_experts) const {
    volatile kernels::HostFlags* flags = flags_.host();
    std::vector<int> counts(num_local_experts);
    for (int e = 0; e < num_local_experts; ++e) counts[e] = flags->expert_counts[e];
    return counts;
}

#ifdef MOE_EP_PROFILE
std::vector<int64_t> NvlRuntime::read_profile() const {
    std::vector<int64_t> values(kernels::prof::kInt64s, 0);
    if (profile_ == nullptr) return values;
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_check(cudaMemcpy(values.data(), profile_, sizeof(int64_t) * values.size(), cudaMemcpyDeviceToHost),
               "cudaMemcpy(profile)");
    return values;
}
#endif

}  // namespace moe_ep
