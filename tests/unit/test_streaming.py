"""The prefill's KV push hands computed layers from the model thread to the event loop: small layers
together, once enough bytes are pending or the chunk's last layer is done (every hand-off wakes the loop,
which then competes with the model for the GIL and the cores); big layers one by one, as computed. The
stream carries the same layers and bytes either way."""

from __future__ import annotations

import asyncio

import torch

from factories import make_pool, make_runner, prefill_job, prompt
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.service.streaming import RequestPush
from kvcentric.core.hashing import BlockHasher
from kvcentric.runtime.kvwire import LayerData
from kvcentric.model.config import preset
from kvcentric.proto import kv_pb2

TOKENS = 8
LAYER_BYTES = 2 * TOKENS * preset("tiny").num_kv_heads * preset("tiny").head_dim * 4
"""Key and value bytes of one layer of an 8-token chunk of `tiny` (float32)."""


class RecordingPusher:
    """Takes what a push streams, as a messenger's client would, and keeps it."""

    def __init__(self) -> None:
        self.items: list = []

    async def push_with_retry(self, addr, make_chunks, retries=2, timeout_s=120.0, metadata=None) -> int:
        async for item in make_chunks(0):
            self.items.append(item)
        return sum(item.nbytes for item in self.items if isinstance(item, LayerData))

    def layers(self) -> list[int]:
        return [item.layer for item in self.items if isinstance(item, LayerData)]


def start_push(n_tokens: int, **kwargs):
    runner = make_runner(device="cpu")  # the CPU hand-off (on CUDA each layer is staged on its own)
    engine = PrefillEngine(runner, make_pool(runner), BlockHasher("sha256_hex", runner.block_size), 512)
    engine.submit(prefill_job(prompt(n_tokens)))
    chunk = engine.schedule()
    pusher = RecordingPusher()
    return RequestPush(runner, pusher, chunk.work, **kwargs), pusher, runner


def layer_kv(runner):
    shape = (TOKENS, runner.config.num_kv_heads, runner.config.head_dim)
    return torch.ones(shape), torch.zeros(shape)


async def settle() -> None:
    """Let the event loop run the callbacks the hook handed it (a few turns of the loop; no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_small_layers_reach_the_stream_together_after_the_last_layer():
    push, pusher, runner = start_push(TOKENS)
    on_layer = push.hook(0)
    for layer in range(runner.config.num_layers - 1):
        on_layer(layer, *layer_kv(runner))
    await settle()
    assert pusher.layers() == []  # nothing handed over yet: the loop was not woken per layer
    on_layer(runner.config.num_layers - 1, *layer_kv(runner))
    await settle()
    assert pusher.layers() == list(range(runner.config.num_layers))
    push.finish(7)
    total = await push.task
    assert total == runner.config.num_layers * LAYER_BYTES
    assert isinstance(pusher.items[-1], kv_pb2.KVCommit) and pusher.items[-1].total_bytes == total


async def test_layers_at_least_handoff_bytes_reach_the_stream_one_by_one():
    push, pusher, runner = start_push(TOKENS, handoff_bytes=LAYER_BYTES)
    on_layer = push.hook(0)
    for layer in range(runner.config.num_layers):
        on_layer(layer, *layer_kv(runner))
        await settle()
        assert pusher.layers() == list(range(layer + 1))
    push.finish(7)
    await push.task


async def test_pending_layers_go_over_once_their_bytes_reach_the_threshold():
    push, pusher, runner = start_push(TOKENS, handoff_bytes=2 * LAYER_BYTES)
    on_layer = push.hook(0)
    seen = []
    for layer in range(runner.config.num_layers):
        on_layer(layer, *layer_kv(runner))
        await settle()
        seen.append(len(pusher.layers()))
    assert seen == [0, 2, 2, 4]  # two layers a hand-off (tiny has 4 layers)
    push.finish(7)
    await push.task


async def test_a_real_prefill_streams_every_layer_of_every_chunk_once():
    push, pusher, runner = start_push(TOKENS)
    loop = asyncio.get_running_loop()
    token = await loop.run_in_executor(None, lambda: runner.prefill(push.work.job.token_ids, push.work.blocks, 0,
                                                                    None, push.hook(0)))
    push.finish(int(torch.argmax(token)))
    await push.task
    assert sorted(pusher.layers()) == list(range(runner.config.num_layers))
    assert all(item.token_start == 0 and item.token_end == TOKENS
               for item in pusher.items if isinstance(item, LayerData))
