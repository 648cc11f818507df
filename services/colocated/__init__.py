"""kvcentric colocated service: prefill and decode in one instance and one KV pool, the vLLM-style baseline."""
