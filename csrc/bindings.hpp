// Registration functions of the `moe_ep._C` module, one per feature file.
#pragma once

#include <torch/extension.h>

namespace moe_ep {

void register_intranode(py::module_& m);  // csrc/intranode.cpp: normal mode over NVLink

#ifdef MOE_EP_WITH_LOW_LATENCY
void register_low_latency(py::module_& m);  // low-latency mode, built when its sources are present
#endif

}  // namespace moe_ep
