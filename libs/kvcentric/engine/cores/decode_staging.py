"""Host staging on a decode instance: a sequence's prompt KV that arrives while no device blocks are free waits in
host memory (Mooncake §3: KV lands in the decode node's DRAM first), within the bytes its `KVCacheManager`
allows, and is copied into blocks once they free up; it chooses no sequence and refuses none (`decode.py` does).
"""

from __future__ import annotations

from kvcentric.core.kv_cache import KVCacheManager
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.runner import ModelRunner


class HostStaging:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner, self.kv = runner, kv

    def size(self, request: DecodeRequest) -> int:
        """Bytes of the sequence's prompt KV, every layer's keys and values."""
        return request.job.n_prompt_tokens * 2 * self.runner.config.num_layers * self.runner.layer_token_bytes

    def fits(self, request: DecodeRequest) -> bool:
        """Host staging has room for the sequence's prompt KV (parallel sampling needs blocks to fork from)."""
        return request.job.sampling.n == 1 and self.kv.can_stage(self.size(request))

    def stage(self, request: DecodeRequest) -> None:
        """The sequence's KV goes to host staging as it arrives (`DecodeRequest.staged`), its bytes reserved."""
        request.staged, request.staged_bytes = [], self.size(request)
        self.kv.stage(request.staged_bytes)

    def load(self, request: DecodeRequest) -> bool:
        """Copy the sequence's staged KV into its blocks and give the staging back; False when it has none."""
        if request.staged is None:
            return False
        for layer, start, end, key, value in request.staged:
            self.runner.write_layer(layer, request.blocks, start, end, key, value)
        self.unstage(request)
        return True

    def unstage(self, request: DecodeRequest) -> None:
        """Drop what the sequence has staged (nothing when it has none)."""
        self.kv.unstage(request.staged_bytes)
        request.staged, request.staged_bytes = None, 0
