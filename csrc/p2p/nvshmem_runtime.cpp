// P2P-only build of the NVSHMEM runtime (host library only; module moe_ep._low_latency_p2p, see setup.py).
#include "../nvshmem_runtime.cpp"
