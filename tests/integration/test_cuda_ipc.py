"""CUDA IPC between two processes on one GPU (`engine/kv/cudaipc.py`): a sender writes a layer's keys and values
straight into the receiver's cache slots through the handles it exported, and the receiver's stream waits on the
interprocess event of that layer before it reads them. Runs only where torch sees a GPU."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU; torch sees none here")]

SHAPE = (4, 64, 2, 8)  # layers, slots, kv_heads, head_dim


def receiver(conn) -> None:
    from kvcentric.engine.kv.cudaipc import export_cache, wait_for
    device = torch.device("cuda:0")
    keys, values = torch.zeros(SHAPE, device=device), torch.zeros(SHAPE, device=device)
    conn.send(export_cache(keys, values))
    layer, slots, handle = conn.recv()
    wait_for(handle, device)
    conn.send((keys[layer, slots].cpu(), values[layer, slots].cpu(), keys[layer + 1].abs().sum().item()))
    conn.recv()  # the sender is done with the handles


def test_a_layer_written_through_cuda_ipc_is_in_the_receivers_cache_once_its_event_passed():
    from kvcentric.engine.kv.cudaipc import PeerCache
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=receiver, args=(theirs,))
    process.start()
    try:
        device = torch.device("cuda:0")
        peer = PeerCache(ours.recv(), device)
        slots = torch.tensor([3, 4, 5, 40])
        keys, values = torch.randn(4, *SHAPE[2:], device=device), torch.randn(4, *SHAPE[2:], device=device)
        ours.send((1, slots, peer.write_layer(1, slots, keys, values)))
        got_keys, got_values, other_layer = ours.recv()
        ours.send("done")
    finally:
        process.join(30)
    assert torch.equal(got_keys, keys.cpu()) and torch.equal(got_values, values.cpu()) and other_layer == 0
