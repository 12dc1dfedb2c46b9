"""moe_ep: expert-parallel Mixture-of-Experts communication and layers for PyTorch."""
