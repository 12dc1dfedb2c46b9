"""Communication core: the Buffer, its backends, autograd ops and FP8 helpers."""
