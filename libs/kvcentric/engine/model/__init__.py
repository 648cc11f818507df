"""The model and its kernels: the LLaMA-family transformer, the runner that owns the KV cache tensors and runs
steps, sampling, and the CPU and GPU kernels; no scheduling and no I/O."""
