// P2P-only build of the low-latency binding (module moe_ep._low_latency_p2p, see setup.py). A file of
// its own so that its object does not overwrite the relocatable build's.
#include "../low_latency_binding.cpp"
