"""The GPU worker: model, engine, paged KV cache, weight page table, page mover."""
