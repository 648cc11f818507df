"""A layer's KV leaves the GPU while the next layer computes: device-to-host copies on a side stream into
preallocated pinned staging buffers, drained in order by a thread that hands the bytes on (Mooncake §5.2,
layer-wise transfer).

CUDA only: on a CPU engine the cache is host memory already and the layer hook copies a layer out itself.
It copies; it does not send (the caller's `deliver` does) or decide what to copy.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch

from kvcentric.engine.model.pools import serial_workers
from kvcentric.runtime.transfer import checksum

Deliver = Callable[[bytes, bytes, int], None]
"""Called with a staged layer's key bytes, value bytes and their checksum, from the drain thread."""


class LayerStaging:
    """`buffers` pinned buffers of at least `buffer_bytes` each (grown once when a layer needs more); a layer
    waits for a free one (back-pressure on the model thread when the host side falls behind)."""

    def __init__(self, device: torch.device, buffers: int = 4, buffer_bytes: int = 16 << 20) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(buffers):
            self.free.put(index)
        self.drainer = serial_workers(1, "kv-staging")

    def stage(self, keys: torch.Tensor, values: torch.Tensor, deliver: Deliver,
              fail: Callable[[BaseException], None]) -> None:
        """From the model thread, right after the layer's compute was queued: copy its keys and values to
        the host behind that compute; `deliver` gets them (in the order staged), `fail` any error."""
        nbytes = keys.numel() * keys.element_size()
        index = self.free.get()
        if self.buffers[index].numel() < 2 * nbytes:
            self.buffers[index] = torch.empty(2 * nbytes, dtype=torch.uint8, pin_memory=True)
        buffer = self.buffers[index]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for offset, tensor in ((0, keys), (nbytes, values)):
                target = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                target.copy_(tensor.contiguous(), non_blocking=True)
                tensor.record_stream(self.stream)  # its memory is not reused until this copy has read it
            done = torch.cuda.Event()
            done.record(self.stream)
        self.drainer.submit(self._drain, index, nbytes, done, deliver, fail)

    def _drain(self, index: int, nbytes: int, done: torch.cuda.Event, deliver: Deliver,
               fail: Callable[[BaseException], None]) -> None:
        try:
            done.synchronize()
            data = self.buffers[index].numpy()
            key, value = data[:nbytes].tobytes(), data[nbytes:2 * nbytes].tobytes()
        except BaseException as exc:  # noqa: BLE001 - the push fails, the engine lives on
            self.free.put(index)
            fail(exc)
            return
        self.free.put(index)
        deliver(key, value, checksum(key, value))

    def after(self, callback: Callable[[], object]) -> None:
        """Run `callback` in the drain thread once every layer staged so far was delivered."""
        self.drainer.submit(callback)

    def close(self) -> None:
        self.drainer.shutdown(wait=True)
