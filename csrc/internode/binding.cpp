// Torch binding of internode normal mode, registered into `moe_ep._low_latency` (the module whose
// NVSHMEM device state its kernels share; see setup.py): argument checks and launches on the current
// stream. moe_ep/ops/backends/cuda_internode.py builds the rows and drives the two legs.
#include <c10/cuda/CUDAStream.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "internode/runtime.hpp"

namespace moe_ep {

namespace {

using at::Tensor;

void check_rows(const Tensor& t, const char* name, int device) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device, name, ": expected a tensor on cuda:", device);
    TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, name, ": expected uint8 rows, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous(), name, ": expected a contiguous [rows, row_bytes] matrix");
}

int64_t sum(const std::vector<int64_t>& counts) {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    return total;
}

void exchange_rows(InternodeRuntime& rt, const Tensor& send, Tensor& recv, const std::vector<int64_t>& pes, int me,
                   const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts, int channels,
                   int chunk_rows, int ring_rows) {
    check_rows(send, "send", rt.device());
    check_rows(recv, "recv", rt.device());
    TORCH_CHECK_VALUE(send.size(1) == recv.size(1), "recv: rows of ", send.size(1), " bytes expected, got ",
                      recv.size(1));
    TORCH_CHECK_VALUE(send.size(0) == sum(send_counts), "send: ", sum(send_counts), " rows expected, got ",
                      send.size(0));
    TORCH_CHECK_VALUE(recv.size(0) == sum(recv_counts), "recv: ", sum(recv_counts), " rows expected, got ",
                      recv.size(0));
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(rt.device()).stream();
    rt.exchange(send.data_ptr<uint8_t>(), recv.data_ptr<uint8_t>(), send.size(1), pes, me, send_counts, recv_counts,
                channels, chunk_rows, ring_rows, stream);
}

}  // namespace

void register_internode(pybind11::module_& m) {
    namespace in = kernels::internode;
    m.def("internode_buffer_bytes", [](int channels, int team, int chunk_rows, int ring_rows, int64_t row_bytes) {
        return in::make_layout(channels, team, chunk_rows, ring_rows, row_bytes).total;
    });
    py::class_<InternodeRuntime>(m, "InternodeRuntime")
        .def(py::init<int, int, int64_t, double>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_bytes"),
             py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
        .def("destroy", &InternodeRuntime::destroy, py::call_guard<py::gil_scoped_release>())
        .def("check_usable", &InternodeRuntime::check_usable)
        .def("check_fits",
             [](const InternodeRuntime& rt, int channels, int team, int chunk_rows, int ring_rows, int64_t row_bytes) {
                 rt.layout(channels, team, chunk_rows, ring_rows, row_bytes);
             })
        .def_property_readonly("num_bytes", &InternodeRuntime::num_bytes)
        .def_property_readonly("exchanges", &InternodeRuntime::exchanges);
    m.def("internode_exchange", &exchange_rows);
}

}  // namespace moe_ep
