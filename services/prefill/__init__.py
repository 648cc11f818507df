"""kvcentric prefill service: computes prompts and streams their KV, layer by layer, to decode."""
