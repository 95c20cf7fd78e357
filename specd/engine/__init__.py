"""The runtime core: the engine step, scheduler, sequences, KV cache, sampling, health."""
