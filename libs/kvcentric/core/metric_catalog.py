"""What each value a service reports on /metrics is: its Prometheus type and exposed name, and its HELP text.

The engines keep their statistics as plain dicts of numbers (they serve /health too), most of them running
totals. Here those are told apart from values of the moment: a running total is exposed as a counter whose
name ends in `_total` (`tokens_generated` becomes `kvc_tokens_generated_total`), a value of the moment as a
gauge, and no gauge is named `_total` (`kv_blocks_total`, a capacity, is exposed as `kv_blocks_capacity`).
It renders nothing; `kvcentric.core.metrics` does.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["counter", "gauge"]

RUNNING_TOTALS = frozenset({
    # prefill engine
    "prefill_tokens_computed", "prefill_tokens_cached", "prefill_tokens_from_host", "prefill_chunks",
    "prefill_passes", "requests_prefilled", "requests_cancelled", "prefix_load_wait_seconds",
    # decode engine
    "kv_staged", "kv_refused_no_room", "kv_bytes_received", "kv_streams_committed", "recomputed_tokens",
    "preemptions", "decode_steps", "batch_size_sum", "tokens_generated", "requests_finished", "requests_aborted",
    "requests_rejected_tbt", "sequences_forked",
    # decode: the KV of pushes that broke off, kept for their continuations (engine/service/keptkv.py)
    "kv_pushes_broken_kept", "kv_blocks_kept", "kv_tokens_kept", "kv_blocks_kept_expired", "kv_blocks_kept_served",
    "kv_blocks_kept_handed_over",
    # LayerKV
    "layerkv_prefills_admitted", "layerkv_held_for_slo", "layerkv_held_for_blocks", "layerkv_forecast_offloads",
    "layerkv_swap_ins", "layerkv_queue_delay_s_sum", "layerkv_decode_held_steps", "layerkv_retained_layers_sum",
    "layerkv_min_retained_layers_sum", "layerkv_bytes_to_host", "layerkv_bytes_to_device",
    "layerkv_layers_reloaded", "layerkv_layers_stored", "layerkv_copy_s",
    # host pool and its write-behind
    "host_blocks_stored", "host_blocks_evicted", "host_blocks_read", "host_writes_queued", "host_writes_layerwise",
    "host_writes_failed", "host_write_waits",
    # the KV messenger: what it received and served, and (push_) what it sent
    "bytes_received", "streams_received", "shm_refused", "checksum_failures", "shm_bytes_received",
    "blocks_served", "bytes_sent", "blocks_put", "blocks_put_refused", "bytes_put", "evicted_requests",
    "push_bytes_streamed", "push_shm_bytes_sent", "push_bytes_sent", "push_streams_sent", "push_retries",
    "push_blocks_pulled", "push_blocks_put", "mooncake_bytes_received", "push_mooncake_bytes_sent",
    "push_mooncake_no_room",
    # links chosen per --kv-transport (one per peer, again after a failed push)
    "push_links_grpc", "push_links_shm", "push_links_cuda_ipc", "push_links_mooncake",
    # the model thread, and the process
    "lane_calls", "lane_waits", "model_calls_on_lent_cores", "gc_full_collections", "minor_page_faults",
})
"""Values the services report among their gauges that only ever grow (since the process started)."""

RENAMED_GAUGES = {"kv_blocks_total": "kv_blocks_capacity"}
"""Values of the moment whose report name ends in `_total`, and the name they are exposed under."""

HELP = {
    "requests_total": "HTTP requests answered, by outcome (a finish reason, cancelled, or an error status)",
    "requests_in_flight": "requests the gateway is serving now",
    "ttft_seconds": "time to first token, request in to first token out",
    "tbt_seconds": "time between two tokens of one request",
    "e2e_seconds": "request in to last token out",
    "prompt_tokens": "prompt length in tokens",
    "tokens_generated_total": "tokens decode generated",
    "requests_finished_total": "requests decode finished (their last token sent)",
    "requests_running": "requests in the engine's running batch now",
    "requests_waiting": "requests admitted to the engine and waiting for a step (queued, KV arriving, preempted)",
    "requests_queued": "prompts waiting for the prefill engine",
    "kv_blocks_free": "KV cache blocks free on the device",
    "kv_blocks_capacity": "KV cache blocks on the device",
    "preemptions_total": "sequences preempted for want of KV blocks (recomputed later)",
    "prefill_tokens_computed_total": "prompt tokens the engine computed",
    "prefill_tokens_cached_total": "prompt tokens found in the prefix cache instead of computed",
    "decode_steps_total": "decode steps run",
    "batch_size_sum_total": "sequences over all decode steps (divide by decode_steps_total for the mean batch)",
    "bus_drops_total": "messages from the bus dropped as malformed",
    "http_errors_total": "errors the HTTP layer answered, by status",
    "gc_frozen_objects": "objects taken out of the garbage collector's sight at start (gc.freeze)",
    "gc_full_collections_total": "full garbage collections of the process",
    "minor_page_faults_total": "minor page faults of the process",
    "generation_tokens": "tokens generated per finished request",
    # the series named as vLLM names them (`vllm:` prefix, a `model_name` label)
    "num_requests_running": "requests in the engine's step batch now (vLLM's name)",
    "num_requests_waiting": "requests admitted and waiting for the engine now (vLLM's name)",
    "kv_cache_usage_perc": "fraction of the KV cache blocks in use, 0..1 (vLLM's name)",
    "gpu_cache_usage_perc": "fraction of the KV cache blocks in use, 0..1 (vLLM's name before 0.10)",
    "num_preemptions_total": "sequences preempted for want of KV blocks (vLLM's name)",
    "prompt_tokens_total": "prompt tokens of the requests that reached the engines (vLLM's name)",
    "generation_tokens_total": "tokens generated (vLLM's name)",
    "request_success_total": "requests finished, by finished_reason: stop, length or abort (vLLM's name)",
}
"""HELP text of the main series; the others get one made from their name (`help_of`)."""


def exposed(name: str) -> tuple[str, Kind]:
    """The name and type a value reported among a service's gauges is exposed under."""
    if name in RENAMED_GAUGES:
        return RENAMED_GAUGES[name], "gauge"
    if name.endswith("_total"):
        return name, "counter"
    if name in RUNNING_TOTALS:
        return f"{name}_total", "counter"
    return name, "gauge"


def help_of(name: str, kind: str) -> str:
    """The HELP text of an exposed family: its own, else its name in words and what kind of value it is."""
    if name in HELP:
        return HELP[name]
    words = name.removesuffix("_total").replace("_", " ")
    if kind == "counter":
        return f"{words}: a running total since the process started"
    if kind == "histogram":
        return f"{words}: a histogram"
    return f"{words}: the value now"
