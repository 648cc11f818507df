"""Mooncake §5.2 on prefill, both ways. A prefix found in the host pool loads into the cache layer by layer
beside the compute: the same tokens and KV as a whole load, layer L computes as soon as layer L is there (not
the whole prefix), and a cancelled or failed load leaves no pinned host slot, held block or findable garbage
behind. A chunk's new full blocks go into the host pool layer by layer as each layer is computed: the same
bytes as the cache holds, and a chunk that fails gives its slots and blocks back."""

import threading

import pytest
import torch

from factories import make_runner, prefill_job, prompt
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.cores.prefill import PrefillEngine

PREFIX = prompt(21)  # 5 full blocks of 4 tokens
PROMPT = PREFIX + [7, 8, 9, 10, 11, 12]


def run(engine: PrefillEngine, job, on_layer=None):
    engine.submit(job)
    chunk = engine.schedule()
    first = engine.execute(chunk, on_layer)
    engine.update(chunk)
    return chunk.work, first


def host_holding_the_prefix(layers: int = 0) -> HostBlockPool:
    """A host pool that a first engine filled with PREFIX's full blocks (`layers`: 0 block-major, else
    layer-major)."""
    runner = make_runner(num_blocks=16, block_size=4)
    host = HostBlockPool(64, runner.block_bytes, layers=layers)
    engine = PrefillEngine(runner, BlockPool(16, 4), BlockHasher(block_size=4), host=host)
    work, _ = run(engine, prefill_job(PREFIX))
    engine.finish(work)
    engine.writer.collect(wait=True)
    assert host.prefix(work.hashes) == 5
    return host


def fresh_engine(host: HostBlockPool, layerwise: bool = True) -> PrefillEngine:
    """An engine whose device cache is empty: the prefix can only come from the host pool."""
    return PrefillEngine(make_runner(num_blocks=16, block_size=4), BlockPool(16, 4), BlockHasher(block_size=4),
                         host=host, layerwise_load=layerwise)


class GatedLoads:
    """Holds the copy of every layer from `gated_from` on until `open()` (as a slow host link would)."""

    def __init__(self, runner, gated_from: int = 1, fail_at: int | None = None) -> None:
        self.gate, self.gated_from, self.fail_at = threading.Event(), gated_from, fail_at
        self.load = runner.load_host_layer
        runner.load_host_layer = self.gated

    def gated(self, layer, *args):
        if layer == self.fail_at:
            raise OSError("host memory went away")
        if layer >= self.gated_from:
            assert self.gate.wait(10), "the load was never let through"
        return self.load(layer, *args)

    def open(self) -> None:
        self.gate.set()


@pytest.mark.parametrize("layers", [0, 4], ids=["block-major", "layer-major"])  # tiny has 4 layers
def test_a_layer_wise_load_gives_the_tokens_and_kv_of_a_whole_load_and_of_computing_the_prefix(layers):
    results = {}
    for name, engine in (("layerwise", fresh_engine(host_holding_the_prefix(layers))),
                         ("whole", fresh_engine(host_holding_the_prefix(layers), layerwise=False)),
                         ("computed", fresh_engine(HostBlockPool(1, make_runner(block_size=4).block_bytes)))):
        work, first = run(engine, prefill_job(PROMPT))
        results[name] = first, engine.runner.read_blocks(work.blocks), engine.stats
        engine.finish(work)
        engine.writer.collect(wait=True)  # the write-behind of the new full block holds it until collected
        assert all(count == 0 for count in engine.pool.ref_counts) and not engine.host.pins
    assert results["layerwise"][2]["prefill_tokens_from_host"] == 20 == results["whole"][2]["prefill_tokens_from_host"]
    assert results["layerwise"][2]["prefill_tokens_computed"] == 7 and results["computed"][2][
        "prefill_tokens_from_host"] == 0
    assert results["layerwise"][0] == results["whole"][0] == results["computed"][0]
    assert torch.equal(results["layerwise"][1], results["whole"][1])  # the same bytes, wherever they came from
    torch.testing.assert_close(results["layerwise"][1], results["computed"][1])  # other chunking: not bitwise


def test_layer_zero_computes_while_the_deeper_layers_are_still_loading():
    host = host_holding_the_prefix()
    engine = fresh_engine(host)
    gate = GatedLoads(engine.runner, gated_from=1)
    computed: list[int] = []
    engine.submit(prefill_job(PROMPT))
    chunk = engine.schedule()
    assert chunk.work.loading is not None and len(host.pins) == 5  # slots pinned for as long as they load
    worker = threading.Thread(target=engine.execute, args=(chunk, lambda layer, k, v: computed.append(layer)))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and computed == [0]  # layer 0 ran on its own copy; layer 1 waits for its own
    gate.open()
    worker.join(10)
    assert computed == list(range(engine.runner.config.num_layers))
    assert chunk.work.loading is None and not host.pins
    assert engine.stats["prefix_load_wait_seconds"] >= 0.4


def test_a_prompt_cancelled_before_its_first_chunk_frees_its_blocks_once_the_copies_end():
    host = host_holding_the_prefix()
    engine = fresh_engine(host)
    gate = GatedLoads(engine.runner, gated_from=1)
    engine.submit(prefill_job(PROMPT))
    work = engine.schedule().work
    engine.cancel(work.request_id)
    threading.Timer(0.2, gate.open).start()
    engine.finish(work)  # waits for the copies into its blocks before giving the blocks back
    engine.writer.collect(wait=True)
    assert gate.gate.is_set() and not host.pins
    assert all(count == 0 for count in engine.pool.ref_counts)


def test_a_failed_load_fails_the_prompt_and_leaves_no_garbage_findable():
    host = host_holding_the_prefix()
    engine = fresh_engine(host)
    GatedLoads(engine.runner, gated_from=99, fail_at=2)
    engine.submit(prefill_job(PROMPT))
    chunk = engine.schedule()
    with pytest.raises(RuntimeError, match="loading the prefix"):
        engine.execute(chunk)
    engine.finish(chunk.work)
    engine.writer.collect(wait=True)
    assert not host.pins and all(count == 0 for count in engine.pool.ref_counts)
    assert engine.pool.cached_prefix(chunk.work.hashes) == []  # half-loaded blocks are not reused
    engine.runner.load_host_layer = type(engine.runner).load_host_layer.__get__(engine.runner)
    work, first = run(engine, prefill_job(PROMPT, request_id="again"))
    reference = fresh_engine(HostBlockPool(1, engine.runner.block_bytes))
    assert first == run(reference, prefill_job(PROMPT))[1]


class RecordingPusher:
    """Takes what a push streams, as a messenger's client would."""

    def __init__(self) -> None:
        self.items: list = []

    async def push_with_retry(self, addr, make_chunks, retries=2, timeout_s=120.0, metadata=None) -> int:
        async for item in make_chunks(0):
            self.items.append(item)
        return 0


async def test_the_push_sends_each_layer_of_a_loading_prefix_once_it_is_in_the_cache():
    """The prefix's KV goes to decode too: not read at once when the push opens (it is not all there yet),
    but layer by layer from the first chunk's hook, after that layer's copy."""
    import asyncio

    from kvcentric.engine.service.streaming import RequestPush
    from kvcentric.runtime.kvwire import LayerData
    engine = fresh_engine(host_holding_the_prefix())
    gate = GatedLoads(engine.runner, gated_from=1)
    engine.submit(prefill_job(PROMPT))
    chunk = engine.schedule()
    pusher = RecordingPusher()
    push = RequestPush(engine.runner, pusher, chunk.work)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not [item for item in pusher.items if isinstance(item, LayerData)]  # nothing read before its load
    gate.open()
    first = engine.execute(chunk, push.hook(chunk.start))
    for _ in range(5):  # the hook hands layers to the loop; they are queued before the commit
        await asyncio.sleep(0)
    push.finish(first)
    await push.task
    sent = [item for item in pusher.items if isinstance(item, LayerData)]
    for layer in range(engine.runner.config.num_layers):
        prefix = [item for item in sent if item.layer == layer and (item.token_start, item.token_end) == (0, 20)]
        assert len(prefix) == 1
        key, value, _ = engine.runner.read_layer(layer, chunk.work.blocks, 0, 20)
        assert (prefix[0].key, prefix[0].value) == (key, value)  # the loaded bytes, not what was there before
        assert any(item.layer == layer and (item.token_start, item.token_end) == (20, len(PROMPT)) for item in sent)


def stored_engine(chunk_tokens: int = 512) -> tuple[PrefillEngine, HostBlockPool]:
    runner = make_runner(num_blocks=16, block_size=4)
    host = HostBlockPool(64, runner.block_bytes)
    return PrefillEngine(runner, BlockPool(16, 4), BlockHasher(block_size=4), chunk_tokens, host=host), host


@pytest.mark.parametrize("chunk_tokens", [512, 6])
def test_a_chunks_new_blocks_go_to_the_host_pool_layer_by_layer_with_the_caches_bytes(chunk_tokens):
    engine, host = stored_engine(chunk_tokens)
    engine.submit(prefill_job(PROMPT))  # 27 tokens: 6 full blocks; chunks of 6 leave blocks across two chunks
    layers_sent_before: list[int] = []
    while (chunk := engine.schedule()) is not None:
        engine.execute(chunk, lambda layer, k, v, store=chunk.store: layers_sent_before.append(
            len(store.layers) if store else -1))
        engine.update(chunk)
        if chunk.last:
            break
    work = chunk.work
    if chunk_tokens == 512:  # at each layer, the copies of the layers before it were already on their way
        assert layers_sent_before == list(range(engine.runner.config.num_layers))
    expected = engine.runner.read_blocks(work.blocks[:6])
    engine.finish(work)
    engine.writer.collect(wait=True)
    assert engine.writer.stats["host_writes_layerwise"] == 6 == engine.writer.stats["host_writes_queued"]
    for depth, block_hash in enumerate(work.hashes):  # nothing went twice: the whole-block path found them held
        stored = host.view(block_hash, depth).view(torch.float32).view(expected[depth].shape)
        assert torch.equal(stored, expected[depth])
    assert all(count == 0 for count in engine.pool.ref_counts)


def test_a_chunk_that_fails_half_way_gives_its_host_slots_and_blocks_back():
    engine, host = stored_engine()
    engine.submit(prefill_job(PROMPT))
    chunk = engine.schedule()
    assert chunk.store is not None and len(host.reserved) == 6

    def broken(layer, keys, values):
        if layer == 2:
            raise RuntimeError("the device went away")
    with pytest.raises(RuntimeError):
        engine.execute(chunk, broken)
    engine.finish(chunk.work)  # as the service does when a chunk fails
    engine.writer.collect(wait=True)
    assert not host.reserved and len(host) == 0 and host.prefix(chunk.work.hashes) == 0
    assert engine.writer.stats["host_writes_failed"] == 6 and all(c == 0 for c in engine.pool.ref_counts)


@pytest.mark.parametrize(("device", "mode", "layerwise"), [
    ("cpu", "auto", True), ("cuda", "auto", False), ("cuda:1", "auto", False), ("cuda", "on", True),
    ("cpu", "off", False)])
def test_layerwise_load_auto_is_on_for_cpu_engines_and_off_on_cuda(device, mode, layerwise):
    from kvcentric.engine.config import EngineConfig
    assert EngineConfig(device=device, layerwise_load=mode).layerwise_prefix_load is layerwise
