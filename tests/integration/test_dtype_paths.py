"""Half-precision KV across processes and sockets: prefix blocks pulled over real gRPC from a peer's host pool
(hot-spot replication) arrive as the holder's raw bytes and let the puller compute only the rest, with the
tokens of a run without any cache; `kvcentric up --colocated` in bfloat16 gives the tokens of one process,
and bfloat16 engines that switch roles serve the same tokens as before."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from factories import TEST_DEVICE, greedy, prefill_job, prompt
from harness import UpProcess
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.local import generate
from kvcentric.engine.service.messenger import HostPoolSource
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.runtime.host_store import HostKVStore
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, pull_blocks, start_server
from test_role_switch import complete as complete_role_prompt, switch, wait_for_roles


def node(dtype: str) -> PrefillEngine:
    runner = ModelRunner(preset("tiny"), 16, 4, 0, dtype=dtype, device=TEST_DEVICE)
    host = HostBlockPool(64, runner.block_bytes)
    return PrefillEngine(runner, BlockPool(16, 4), BlockHasher(block_size=4), host=host)


def prefill(engine: PrefillEngine, token_ids: list[int]) -> int | None:
    engine.submit(prefill_job(token_ids, greedy()))
    chunk = engine.schedule()
    first = engine.execute(chunk)
    engine.update(chunk)
    engine.finish(chunk.work)
    return first


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_a_prefix_pulled_over_grpc_is_the_holders_bytes_and_gives_the_same_tokens(dtype):
    holder, puller = node(dtype), node(dtype)
    first = prefill(holder, prompt(21))
    assert holder.writer is not None and holder.host is not None and puller.host is not None
    holder.writer.collect(wait=True)
    hashes = holder.hashes(prompt(21))
    servicer = KVTransferServicer(HostKVStore(1 << 20), HostPoolSource(holder.host, holder.runner))
    server, port = await start_server(servicer, "127.0.0.1", 0)
    pusher = KVPusher()
    try:
        pulled = await pull_blocks(pusher, f"127.0.0.1:{port}", hashes, puller.host, 0, dtype, 4)
    finally:
        await pusher.close()
        await server.stop(None)
    assert pulled == len(hashes) == 5
    for block_hash in hashes:
        assert torch.equal(puller.host.view(block_hash), holder.host.view(block_hash))
    assert prefill(puller, prompt(21)) == first
    assert puller.stats["prefill_tokens_from_host"] == 20 and puller.stats["prefill_tokens_computed"] == 1
    reference = ModelRunner(preset("tiny"), 64, 4, 0, dtype=dtype, device=TEST_DEVICE)
    assert first == generate(reference, BlockPool(64, 4), prompt(21), greedy(1))[0][0]


def test_bf16_colocated_equals_one_process(tmp_path):
    prompt_text, max_tokens = "colocated in bfloat16", 10
    up = UpProcess(str(tmp_path), "--colocated", "1", env={"KVC_DTYPE": "bfloat16"})
    try:
        body = {"prompt": prompt_text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(up.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.load(response)["choices"][0]["text"]
        health = up.health("colocated-0")
    finally:
        up.stop()
    runner = ModelRunner(preset("tiny"), 64, 16, 0, dtype="bfloat16", device=TEST_DEVICE)
    expected, _ = generate(runner, BlockPool(64, 16), ByteTokenizer().encode(prompt_text),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert text == ByteTokenizer().decode(expected)
    assert health["stats"]["kv_bytes_received"] == 0
    assert health["measured_cost"]["dtype"] == "bfloat16"  # tiny's tokens alone do not tell bf16 from fp32
    assert health["measured_cost"]["kv_bytes_per_token"] == 4 * 2 * 2 * 16 * 2


def test_bf16_engines_switch_roles_and_serve_the_same_tokens(tmp_path):
    up = UpProcess(str(tmp_path), "--prefill", "1", "--decode", "2", env={"KVC_DTYPE": "bfloat16"})
    try:
        nats_url = up.manifest["nats_url"]
        wait_for_roles(nats_url, {"prefill-0"}, {"decode-0", "decode-1"})
        _, reference = complete_role_prompt(up.url)
        assert switch(nats_url, "decode-1", "prefill").returncode == 0
        wait_for_roles(nats_url, {"prefill-0", "decode-1"}, {"decode-0"})
        assert switch(nats_url, "prefill-0", "decode").returncode == 0
        wait_for_roles(nats_url, {"decode-1"}, {"decode-0", "prefill-0"})
        headers, text = complete_role_prompt(up.url)
        switched = up.health("decode-1")["measured_cost"]
    finally:
        up.stop()
    assert headers["x-kvcentric-prefill"] == "decode-1" and text == reference
    assert switched["dtype"] == "bfloat16" and switched["kv_bytes_per_token"] == 4 * 2 * 2 * 16 * 2
