"""Mooncake §5.2's layer-wise prefill, load side: the prefix blocks a prompt finds in the host pool enter the
device cache one layer at a time beside the compute, and layer L of the prompt's first chunk waits only for
layer L's copy, not for the whole prefix (on CUDA a side stream and an event per layer; on CPU a worker
thread and a flag per layer).

It copies and tells when a layer is there; which blocks to load is the prefill engine's choice, and the host
slots stay pinned (not evicted, not overwritten) until `close`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from kvcentric.engine.model.runner import ModelRunner


class LayerwiseLoad:
    """One prompt's prefix, host slots `slots[i]` into cache blocks `blocks[i]`, layer by layer in order."""

    def __init__(self, runner: ModelRunner, blocks: list[int], slots: list[int], buffer: torch.Tensor) -> None:
        self.runner, self.blocks, self.slots, self.buffer = runner, blocks, slots, buffer
        layers = runner.config.num_layers
        self.queued = [threading.Event() for _ in range(layers)]
        """Layer L's copy is done (CPU) or enqueued on the side stream with its event (CUDA)."""
        self.events: list[torch.cuda.Event | None] = [None] * layers
        self.error: BaseException | None = None
        self.waited_s = 0.0
        """How long the compute waited for copies (the part of the load the compute did not hide)."""

    def start(self, worker: concurrent.futures.Executor) -> LayerwiseLoad:
        worker.submit(self._copy_layers)
        return self

    def _copy_layers(self) -> None:
        try:
            for layer, queued in enumerate(self.queued):
                self.events[layer] = self.runner.load_host_layer(layer, self.buffer, self.slots, self.blocks)
                queued.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the compute thread, which fails the request
            self.error = exc
            for queued in self.queued:
                queued.set()

    def wait(self, layer: int) -> None:
        """Before layer `layer` computes: its prefix KV is in the cache (CUDA: the compute stream waits)."""
        if not self.queued[layer].is_set():
            started = time.perf_counter()
            self.queued[layer].wait()
            self.waited_s += time.perf_counter() - started
        if self.error is not None:
            raise RuntimeError(f"loading the prefix from the host pool failed: {self.error}") from self.error
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream(self.runner.device).wait_event(event)

    def wait_all(self) -> None:
        """Every layer is in the cache, for a step that cannot wait layer by layer (mixed, LayerKV)."""
        for layer in range(len(self.queued)):
            self.wait(layer)

    def close(self) -> None:
        """Every copy has finished (its blocks may be freed and reused, its host slots unpinned); a failed
        load raises nothing here (the request that needed it has failed already)."""
        for queued in self.queued:
            queued.wait()
        last = self.events[-1]
        if last is not None:  # one side stream: its last event follows every copy
            last.synchronize()
