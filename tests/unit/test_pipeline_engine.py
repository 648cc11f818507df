"""The engine side of chunked pipeline parallelism: stages holding only their layers compute exactly what the
whole model does (fp32), the hidden-state message round-trips, and a decode instance assembles a request
pushed by several senders, committing only when every layer is in."""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest
import torch

from factories import TEST_DEVICE, decode_job, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.pipeline import StagePosition
from kvcentric.engine.service.assembly import AssemblingSink
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.service.pipeline import StageEngine, StageChunk, hidden_chunk, read_hidden
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.stage import StageRunner
from kvcentric.model.config import preset


def stage(index: int, stages: int = 2, blocks: int = 64) -> StageRunner:
    return StageRunner(preset("tiny"), StagePosition("g", index, stages), blocks, 4, seed=0, device=TEST_DEVICE)


def test_a_stage_holds_only_its_layers_and_their_kv():
    first, last = stage(0), stage(1)
    assert list(first.layers) == [0, 1] and list(last.layers) == [2, 3]
    assert first.k_cache.shape[0] == 2 and first.block_bytes * 2 == make_runner().block_bytes
    names = {name for name, _ in last.model.named_parameters()}
    assert not any(name.startswith(("layers.0.", "layers.1.", "embed_tokens")) for name in names)
    assert "lm_head.weight" in names and not hasattr(first.model, "lm_head")


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_compute_exactly_the_whole_models_logits_and_kv_chunk_by_chunk(stages):
    whole, parts = make_runner(), [stage(i, stages) for i in range(stages)]
    tokens, table = prompt(50), list(range(13))
    for start, end in [(0, 16), (16, 32), (32, 50)]:
        expected = whole.prefill(tokens, table, start, end)
        hidden = None
        for part in parts:
            hidden = part.prefill(tokens, table, start, end, hidden=hidden)
        assert torch.equal(hidden, expected)
    slots = whole.num_blocks * whole.block_size  # on CUDA the whole model's cache has a spare block (CUDA graphs)
    for part in parts:
        assert torch.equal(part.k_cache, whole.k_cache[part.layers.start:part.layers.stop, :slots])


def test_hidden_states_travel_as_raw_bytes_with_their_positions_and_the_job():
    engine = StageEngine(stage(0, 3), BlockPool(64, 4), BlockHasher("sha256_cbor", 4), chunk_tokens=8)
    job = msgspec.structs.replace(prefill_job(prompt(20)), pipeline_addrs=["b:1", "c:2"])
    engine.submit(job)
    chunk = engine.schedule()
    data = engine.compute(chunk)
    message = hidden_chunk(chunk.work, chunk.start, chunk.end, data, "float32", first=True)
    sent_job, hidden = read_hidden(type(message).FromString(message.SerializeToString()), "float32", 64)
    assert sent_job.pipeline_addrs == ["c:2"] and sent_job.token_ids == job.token_ids
    assert list(message.positions) == list(range(0, 8)) and hidden.tensor.shape == (8, 64)
    with pytest.raises(ValueError, match="checksum"):
        message.hidden = bytes(len(message.hidden))
        read_hidden(message, "float32", 64)


def test_a_later_stage_computes_the_chunks_the_first_cut_and_samples_the_same_first_token():
    whole = make_runner()
    reference = PrefillEngine(whole, make_pool(whole), BlockHasher("sha256_cbor", 4), chunk_tokens=8)
    job = msgspec.structs.replace(prefill_job(prompt(30)), pipeline_addrs=["b:1"])
    reference.submit(job)
    while (chunk := reference.schedule()) is not None:
        token = reference.execute(chunk)
        reference.update(chunk)
        if chunk.last:
            reference.complete(chunk.work)
            break
    engines = [StageEngine(stage(i), BlockPool(64, 4), BlockHasher("sha256_cbor", 4), chunk_tokens=8) for i in (0, 1)]
    engines[0].submit(job)
    engines[1].submit(job)
    while (first := engines[0].schedule()) is not None:
        data = engines[0].compute(first)
        engines[0].update(first)
        message = hidden_chunk(first.work, first.start, first.end, data, "float32", first.first)
        engines[1].receive(job.request_id, read_hidden(message, "float32", 64)[1], 0.0)
        second = engines[1].schedule()
        assert isinstance(second, StageChunk) and (second.start, second.end) == (first.start, first.end)
        out = engines[1].compute(second)
        engines[1].update(second)
        if first.last:
            engines[0].complete(first.work)
            assert out == token
            return
    raise AssertionError("the last chunk never came")


def push_header(request_id: str, stripe: int, engine: DecodeEngine, tokens: int):
    return types.SimpleNamespace(request_id=request_id, dtype="float32", num_tokens=tokens, stripes=2, stripe=stripe,
                                 num_layers=engine.runner.config.num_layers, token_ids=[1] * tokens)


class Recorder:
    """The inner sink: writes into the engine, records commits."""

    copies_bytes = True

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine, self.commits, self.aborts = engine, [], []

    async def begin(self, header):
        self.engine.begin_kv(header.request_id, header.num_tokens, header.num_layers, header.token_ids,
                             join=header.stripes > 1)

    def write(self, request_id, chunk):
        self.engine.write_kv(request_id, chunk.layer, chunk.token_start, chunk.token_end, chunk.key, chunk.value)

    def commit(self, request_id, commit):
        self.commits.append(request_id)

    def abort(self, request_id, reason, retryable=False):
        self.aborts.append(request_id)


def layer(index: int, tokens: int, runner):
    nbytes = tokens * runner.layer_token_bytes
    return types.SimpleNamespace(layer=index, token_start=0, token_end=tokens, key=bytes(nbytes), value=bytes(nbytes))


def test_decode_holds_the_last_stages_commit_until_the_first_stages_layers_are_in():
    runner = make_runner()
    engine = DecodeEngine(runner, make_pool(runner))
    engine.add(decode_job("r", 6), 0.0)
    inner = Recorder(engine)
    sink = AssemblingSink(inner, engine)
    asyncio.run(sink.begin(push_header("r", 0, engine, 6)))  # the last stage, whose commit comes first
    sink.write("r", layer(2, 6, runner))
    sink.write("r", layer(3, 6, runner))
    sink.commit("r", "first token")
    assert inner.commits == []
    asyncio.run(sink.begin(push_header("r", 1, engine, 6)))
    sink.write("r", layer(0, 6, runner))
    assert inner.commits == []
    sink.write("r", layer(1, 6, runner))
    assert inner.commits == ["r"] and not sink.held


def test_a_sender_that_fails_drops_the_held_commit():
    runner = make_runner()
    engine = DecodeEngine(runner, make_pool(runner))
    engine.add(decode_job("r", 6), 0.0)
    inner = Recorder(engine)
    sink = AssemblingSink(inner, engine)
    asyncio.run(sink.begin(push_header("r", 0, engine, 6)))
    sink.commit("r", "first token")
    sink.abort("r", "stream broke")
    assert inner.aborts == ["r"] and not sink.held and not sink.senders
