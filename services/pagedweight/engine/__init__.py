"""Token generation: sampling, the single-stream generator, later the batching engine."""
