"""GPU memory of the worker: the byte pool and the paged KV cache."""
