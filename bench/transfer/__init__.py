"""Benchmarks of KV movement: the layer-wise push, same-host paths, the host tier, layer-wise loads and kvs-meta."""
