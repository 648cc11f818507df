"""CUDA IPC for KV between two engine processes on the GPUs of one host (`--kv-transport cuda-ipc`): the receiver
exports handles of its KV cache tensors once (torch's CUDA IPC), the sender opens them once and writes a layer's
keys and values straight into the receiver's cache slots on a stream of its own, recording an interprocess
event after each layer that the receiver's compute stream waits on. No byte goes through host memory.

It moves a layer into given slots and says when it is there; it does not choose the slots (the receiver's block
table, sent ahead of the layers), nor carry the announcement (the push's gRPC stream would), and no engine uses
it yet: the engines do not advertise `cuda-ipc`, so `auto` never picks it. Unmeasured: it ran on no GPU here.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor


KEEP_EVENTS = 1024


@dataclasses.dataclass(frozen=True)
class CacheHandles:
    """What a receiver sends once (picklable): how to open its key and value caches in another process."""

    device_uuid: str
    keys: tuple[Any, Any]
    values: tuple[Any, Any]


def export_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> CacheHandles:
    """The receiver's side: handles of its caches ([layers, slots, kv_heads, head_dim] each, on one GPU)."""
    if k_cache.device.type != "cuda":
        raise ValueError("CUDA IPC exports device memory only")
    uuid = str(torch.cuda.get_device_properties(k_cache.device).uuid)
    return CacheHandles(uuid, reduce_tensor(k_cache), reduce_tensor(v_cache))


class PeerCache:
    """The sender's side: a receiver's caches opened once, and layers written into them."""

    def __init__(self, handles: CacheHandles, device: torch.device) -> None:
        if str(torch.cuda.get_device_properties(device).uuid) != handles.device_uuid:
            raise ValueError("the peer's cache is on another GPU than this engine's: CUDA IPC writes stay on one GPU")
        rebuild, args = handles.keys
        self.keys: torch.Tensor = rebuild(*args)
        rebuild, args = handles.values
        self.values: torch.Tensor = rebuild(*args)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.events: collections.deque[torch.cuda.Event] = collections.deque(maxlen=KEEP_EVENTS)
        """The latest layers' events, kept alive while the receiver may still open their handles."""

    def write_layer(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    ready: torch.cuda.Event | None = None) -> bytes:
        """Keys and values of tokens ([tokens, kv_heads, head_dim], on this GPU) into the peer's `slots` of layer
        `layer`, after `ready` (the layer's compute); returns the IPC handle of an event recorded after the
        write, which the receiver waits on (`wait_for`) before it reads those slots."""
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            target = slots.to(self.device, non_blocking=True)
            self.keys[layer].index_copy_(0, target, keys)
            self.values[layer].index_copy_(0, target, values)
            done = torch.cuda.Event(interprocess=True)
            done.record(self.stream)
        self.events.append(done)
        return done.ipc_handle()


def wait_for(handle: bytes, device: torch.device) -> torch.cuda.Event:
    """The receiver's side: its current stream waits for the sender's write of a layer (the event it named)."""
    event = torch.cuda.Event.from_ipc_handle(device, handle)
    torch.cuda.current_stream(device).wait_event(event)
    return event
