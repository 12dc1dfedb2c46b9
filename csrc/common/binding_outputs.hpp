// Output tensors of a binding call carved out of one allocation. Torch-side: only the modules' binding
// files include it (csrc/README.md). An allocation costs the host about as much as a kernel launch, and
// the parts of a call's outputs that users keep or drop together need only one. Each part starts on a
// 256-byte boundary (the allocator's own alignment), so that the kernels' vector accesses stay aligned.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace moe_ep {

struct Part {
    std::vector<int64_t> shape;
    at::ScalarType dtype;
};

inline std::vector<at::Tensor> carve(const at::TensorOptions& opts, const std::vector<Part>& parts) {
    constexpr int64_t kAlign = 256;
    std::vector<int64_t> offsets, sizes;
    int64_t total = 0;
    for (const Part& part : parts) {
        int64_t bytes = static_cast<int64_t>(c10::elementSize(part.dtype));
        for (const int64_t d : part.shape) bytes *= d;
        offsets.push_back(total);
        sizes.push_back(bytes);
        total += (bytes + kAlign - 1) / kAlign * kAlign;
    }
    const at::Tensor block = at::empty({total}, opts.dtype(at::kByte));
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < parts.size(); ++i)
        out.push_back(block.narrow(0, offsets[i], sizes[i]).view(parts[i].dtype).view(parts[i].shape));
    return out;
}

}  // namespace moe_ep
