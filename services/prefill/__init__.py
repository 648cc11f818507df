"""kvcentric prefill service: computes prompts and streams their KV, layer by layer, to decode."""

from kvc_prefill import stage  # noqa: F401, E402 - names the service of a pipeline stage (`--pipeline-group`)
