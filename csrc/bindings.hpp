// Registration functions of the `moe_ep._C` module, one per feature file.
#pragma once

#include <torch/extension.h>

namespace moe_ep {

void register_intranode(py::module_& m);  // csrc/intranode.cpp: normal mode over NVLink

}  // namespace moe_ep
