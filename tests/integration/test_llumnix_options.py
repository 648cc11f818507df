"""Llumnix's cache-aware scheduling options on a real stack (`kvcentric up`: nats-server, redis, kvs-meta,
conductor, prefill, decode, gateway), set through the environment every service inherits: a hash seed shared
by the gateway and the engines (KVC_HASH_SEED, Llumnix's GO_HASH_SEED), so the prefix keys the gateway looks
up are the ones the engines store; the minimum prompt length for cache-aware placement; and the conductor's
kvCacheHitLen counter, the prefix tokens its placements found cached."""

from __future__ import annotations

import json
import urllib.request

import pytest

from harness import UpProcess
from kvcentric.core.hashing import BlockHasher, to_hex
from waiting import eventually

SEED = 5
MIN_TOKENS = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-llumnix")),
                   env={"KVC_HASH_SEED": str(SEED), "KVC_CACHE_AWARE_SCHEDULING_MIN_TOKENS": str(MIN_TOKENS)})
    try:
        yield up
    finally:
        up.stop()


def complete(up: UpProcess, token_ids: list[int]) -> None:
    body = json.dumps({"model": "tiny", "prompt": token_ids, "max_tokens": 2, "ignore_eos": True}).encode()
    request = urllib.request.Request(up.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def url_of(up: UpProcess, service: str, path: str) -> str:
    return up.manifest["services"][service]["health_url"].replace("/health", path)


def hit_len_tokens(up: UpProcess) -> float:
    """kvCacheHitLen summed over the conductor replicas (a request is placed by whichever one it reaches)."""
    total = 0.0
    for name in up.manifest["services"]:
        if not name.startswith("conductor"):
            continue
        with urllib.request.urlopen(url_of(up, name, "/metrics"), timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("kvc_kv_cache_hit_len_tokens_total{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def batch_query(up: UpProcess, hashes: list[str]) -> dict:
    with urllib.request.urlopen(f"{url_of(up, 'kvs-meta', '/batch_query_keys')}?keys={','.join(hashes)}") as answer:
        return json.load(answer)["data"]


def held(up: UpProcess, hashes: list[str]) -> list[bool]:
    data = batch_query(up, hashes)
    return [bool(data[h].get("values")) for h in hashes]


def test_a_shared_seed_keeps_the_gateways_keys_and_the_engines_blocks_the_same(stack):
    prompt = [(11 * i) % 256 for i in range(100)]
    complete(stack, prompt)
    seeded = [to_hex(h) for h in BlockHasher(block_size=16, seed=SEED).hash_blocks(prompt)]
    unseeded = [to_hex(h) for h in BlockHasher(block_size=16).hash_blocks(prompt)]
    eventually(lambda: held(stack, seeded), "the engines' seeded blocks in kvs-meta", until=all, every_s=0.1)
    assert not any(held(stack, unseeded))
    replica = batch_query(stack, seeded[:1])[seeded[0]]["values"][0]  # Mooncake's master replica descriptor
    kv_addr = stack.health("prefill-0")["kv_addr"]
    assert (replica["transport_endpoint_"], replica["size_"]) == (kv_addr, 4 * 2 * 16 * 2 * 16 * 4)  # tiny, fp32
    before = hit_len_tokens(stack)
    complete(stack, prompt)
    assert hit_len_tokens(stack) - before == 96  # 6 full blocks of 16 found cached at placement


def test_a_prompt_below_the_minimum_is_placed_without_its_prefix(stack):
    prompt = [(13 * i + 1) % 256 for i in range(MIN_TOKENS - 1)]
    complete(stack, prompt)
    hashes = [to_hex(h) for h in BlockHasher(block_size=16, seed=SEED).hash_blocks(prompt)]
    eventually(lambda: held(stack, hashes), "the short prompt's blocks in kvs-meta", until=all, every_s=0.1)
    before = hit_len_tokens(stack)
    complete(stack, prompt)
    assert hit_len_tokens(stack) == before
