"""Benchmarks of one engine in one process: the model, its kernels (CPU and GPU), its start and its memory."""
