// The `moe_ep._C` extension module (normal mode). Each feature registers its functions from its own file;
// the low-latency mode is the separate module `moe_ep._low_latency` (csrc/low_latency_binding.cpp).
#include "bindings.hpp"

PYBIND11_MODULE(_C, m) {
    m.doc() = "moe_ep CUDA kernels";
    moe_ep::register_intranode(m);
}
