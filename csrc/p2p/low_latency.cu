// P2P-only build of the low-latency kernels: whole-program code without NVSHMEM device calls (module
// moe_ep._low_latency_p2p, see setup.py).
#include "../kernels/low_latency.cu"
