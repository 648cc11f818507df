"""The whole request path on real NATS, Redis and gRPC: gateway -> conductor -> prefill -> messenger -> decode."""

from __future__ import annotations

import json
import urllib.request

import pytest

from factories import make_pool, make_runner
from kvcentric.engine.model.local import generate
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.core.protocol import SamplingParams
from waiting import eventually


def post(url: str, body, raw: bytes | None = None) -> tuple[int, dict, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.load(exc)


def stream(url: str, body) -> list[str]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return [line.decode().strip()[len("data: "):] for line in response if line.startswith(b"data: ")]


def reference_tokens(prompt: str, max_tokens: int) -> list[int]:
    """The same model and seed run in this one process, no disaggregation."""
    runner = make_runner(num_blocks=64, block_size=16, seed=0)
    token_ids = ByteTokenizer().encode(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return generate(runner, make_pool(runner), token_ids, params)[0]


def test_completion_equals_single_process_generation_and_kv_came_over_the_messenger(cluster):
    prompt, max_tokens = "The KVCache-centric architecture of Mooncake", 12
    decode_before = cluster.health("decode-0")["stats"]
    status, headers, body = post(cluster.url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert headers["x-kvcentric-prefill"] == "prefill-0" and headers["x-kvcentric-decode"] == "decode-0"
    expected = reference_tokens(prompt, max_tokens)
    assert body["choices"][0]["text"] == ByteTokenizer().decode(expected)
    assert body["choices"][0]["finish_reason"] == "length"
    n_prompt = len(ByteTokenizer().encode(prompt))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                             "total_tokens": n_prompt + max_tokens}
    decode_after = cluster.health("decode-0")["stats"]
    config = preset("tiny")
    expected_bytes = config.num_layers * n_prompt * 2 * config.num_kv_heads * config.head_dim * 4
    assert decode_after["kv_bytes_received"] - decode_before["kv_bytes_received"] == expected_bytes
    assert decode_after["bytes_received"] - decode_before.get("bytes_received", 0) == expected_bytes  # gRPC servicer
    assert decode_after["prefill_tokens_computed"] == 0
    assert decode_after["kv_blocks_free"] == decode_after["kv_blocks_total"]
    prefill = cluster.health("prefill-0")["stats"]
    assert prefill["prefill_tokens_computed"] >= n_prompt


def test_token_ids_as_prompt_give_the_same_tokens_as_the_reference(cluster):
    token_ids = ByteTokenizer().encode("disaggregated")
    runner = make_runner(num_blocks=64, block_size=16)
    expected = generate(runner, make_pool(runner), token_ids,
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    status, _, body = post(cluster.url, {"prompt": token_ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["text"] == ByteTokenizer().decode(expected)


def test_streaming_sends_openai_chunks_and_ends_with_done(cluster):
    prompt = "Streaming over server-sent events"
    events = stream(cluster.url, {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                  "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == ByteTokenizer().decode(reference_tokens(prompt, 10))
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_prefix_blocks_reach_kvs_meta_in_redis(cluster, nats_url):
    prompt = "a prompt long enough to fill two blocks of sixteen tokens each, and then some"
    status, _, _ = post(cluster.url, {"prompt": prompt, "max_tokens": 1})
    assert status == 200
    from kvcentric.core.hashing import BlockHasher, to_hex
    hashes = [to_hex(h) for h in BlockHasher(block_size=16).hash_blocks(ByteTokenizer().encode(prompt))]
    url = cluster.manifest["services"]["kvs-meta"]["health_url"].replace("/health", "/batch_query_keys")

    def batch_query() -> dict:
        with urllib.request.urlopen(f"{url}?keys={','.join(hashes)},nosuchkey") as response:
            return json.load(response)
    reply = eventually(batch_query, "two holders of every block (events are asynchronous)",
                       until=lambda reply: all(len(reply["data"][h].get("values", [])) == 2 for h in hashes),
                       every_s=0.1)
    assert reply["success"] is True
    for block_hash in hashes:  # in prefill-0's paged cache and in its host pool
        assert sorted((v["node_id"], v["tier"]) for v in reply["data"][block_hash]["values"]) == \
            [("prefill-0", "device"), ("prefill-0", "dram")]
    assert reply["data"]["nosuchkey"]["ok"] is False
    try:
        urllib.request.urlopen(url)
        raise AssertionError("no keys must be a 400")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and json.load(exc)["success"] is False


@pytest.mark.parametrize("raw, param", [
    (b"{not json", None),
    (json.dumps({"max_tokens": 4}).encode(), "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": "four"}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": [1]}).encode(), "temperature"),
    (json.dumps({"prompt": "x" * 2100}).encode(), "prompt"),
    (json.dumps({"prompt": "x", "model": "no-such-model"}).encode(), "model"),
])
def test_bad_requests_get_400_with_an_openai_error_object(cluster, raw, param):
    status, _, body = post(cluster.url, None, raw=raw)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param


def test_health_and_models_answer(cluster):
    health = cluster.health("gateway")
    assert health["status"] == "ok" and health["prefill_alive"] == 1 and health["decode_alive"] == 1
    with urllib.request.urlopen(cluster.url + "/v1/models") as response:
        models = json.load(response)
    assert models["data"][0]["id"] == "tiny"
    for service in ("conductor-0", "kvs-meta", "prefill-0", "decode-0"):
        assert cluster.health(service)["status"] == "ok"
