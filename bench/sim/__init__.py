"""Benchmarks of the pure cores and the simulator: block hashing, placement speed, the simulator, and chunked
pipeline parallelism and LayerKV as modelled."""
