// The `moe_ep._C` extension module. Each feature registers its functions from its own file.
#include "bindings.hpp"

PYBIND11_MODULE(_C, m) {
    m.doc() = "moe_ep CUDA kernels";
    moe_ep::register_intranode(m);
#ifdef MOE_EP_WITH_LOW_LATENCY
    moe_ep::register_low_latency(m);
#endif
}
