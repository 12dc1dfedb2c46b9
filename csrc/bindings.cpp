// The `moe_ep._C` extension module. Each feature registers its functions from its own file; the
// low-latency mode adds `register_low_latency(m)` here.
#include "bindings.hpp"

PYBIND11_MODULE(_C, m) {
    m.doc() = "moe_ep CUDA kernels";
    moe_ep::register_intranode(m);
}
