"""Benchmarks of a served cluster (`kvcentric up`): latency, throughput, overload, faults, and the comparison
with vLLM."""
