"""Chunked pipeline parallelism end to end (issue 20, Mooncake §5.1) on real NATS, Redis and gRPC: `kvcentric up
--prefill-pipeline 2` runs each prefill instance as two stages holding half the layers each; the conductor
places on the group, the stages pass hidden states chunk by chunk, each streams its own layers' KV to decode,
and the greedy tokens equal a single process's exactly (fp32). One stage killed fails the next request with
503, promptly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from factories import make_pool, make_runner
from harness import UpProcess
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from test_request_path import post
from waiting import eventually

CHUNK = 32


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A cluster on NATS and Redis of its own (`up` starts them): on the session's, the session cluster's
    conductors and its own prefill-0 would answer too."""
    up = UpProcess(str(tmp_path_factory.mktemp("cpp")), "--prefill-pipeline", "2", "--prefill-chunk", str(CHUNK),
                   "--restart", "never", "--conductors", "1")
    try:
        yield up
    finally:
        up.stop()


def reference(token_ids: list[int], max_tokens: int) -> list[int]:
    runner = make_runner(num_blocks=64, block_size=16, seed=0)
    runner_chunks = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return generate(runner, make_pool(runner), token_ids, runner_chunks)[0]


def test_a_two_stage_group_gives_the_single_instance_tokens_exactly(group):
    prompt = "Chunked pipeline parallelism: every stage holds a slice of the layers. " * 2  # 4+ chunks
    token_ids = ByteTokenizer().encode(prompt)
    assert len(token_ids) > 3 * CHUNK
    decode_before = group.health("decode-0")["stats"]
    status, headers, body = post(group.url, {"prompt": token_ids, "max_tokens": 10, "temperature": 0,
                                             "ignore_eos": True})
    assert status == 200, body
    assert headers["x-kvcentric-prefill"] == "prefill-0-s0"
    assert body["choices"][0]["text"] == ByteTokenizer().decode(reference(token_ids, 10))
    first, last = group.health("prefill-0-s0")["stats"], group.health("prefill-0-s1")["stats"]
    assert first["prefill_chunks"] >= 4 and last["prefill_chunks"] == first["prefill_chunks"]
    decode = group.health("decode-0")["stats"]
    config = preset("tiny")
    whole = config.num_layers * len(token_ids) * 2 * config.num_kv_heads * config.head_dim * 4
    assert decode["kv_bytes_received"] - decode_before["kv_bytes_received"] == whole
    assert decode["streams_received"] - decode_before.get("streams_received", 0) == 2  # one from each stage
    assert decode["kv_blocks_free"] == decode["kv_blocks_total"]


def test_a_cached_prefix_is_reused_by_every_stage(group):
    prompt = ByteTokenizer().encode("A shared system prompt that every stage caches for its own layers. " * 2)
    for tail in ("first question", "second question"):
        token_ids = prompt + ByteTokenizer().encode(tail)
        status, _, body = post(group.url, {"prompt": token_ids, "max_tokens": 4, "temperature": 0,
                                           "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == ByteTokenizer().decode(reference(token_ids, 4))
    assert group.health("prefill-0-s1")["stats"]["prefill_tokens_cached"] > 0


def test_a_dead_stage_fails_the_request_with_503(tmp_path):
    up = UpProcess(str(tmp_path), "--prefill-pipeline", "2", "--prefill-chunk", str(CHUNK), "--conductors", "1")
    try:
        os.kill(up.manifest["services"]["prefill-0-s1"]["pid"], signal.SIGKILL)
        started = time.monotonic()
        status, _, body = post(up.url, {"prompt": "x" * 200, "max_tokens": 4, "temperature": 0})
        assert status == 503, body
        # the request failed, not its placement: stage 0 says so, or the decode whose push stage 0 dropped
        # says so first (the two race)
        message = body["error"]["message"]
        assert "next stage" in message or "KV transfer failed" in message, message
        assert time.monotonic() - started < 15
        eventually(lambda: up.health("prefill-0-s0")["stats"], "the failed request's blocks released",
                   until=lambda stats: stats["kv_blocks_free"] == stats["kv_blocks_total"])
    finally:
        up.stop(timeout_s=5)
