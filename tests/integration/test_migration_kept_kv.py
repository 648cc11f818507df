"""A prefill instance killed mid-prompt on a real cluster (`kvcentric up --prefill 2 --decode 1`, tiny, fp32,
greedy; prefill steps slowed on purpose, `--slow-step-s`, so the kill lands after 1,024 of 1,500 tokens reached
the decode instance): the decode instance keeps the KV of the tokens that arrived in every layer and announces it,
the conductor places the continuation on the surviving prefill instance pulling it from there, which computes only
the rest of the prompt, and the client's one stream has the tokens of a single-process run. No block is left
held."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request

import pytest

from factories import make_pool, make_runner
from harness import UpProcess
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from waiting import eventually

pytestmark = pytest.mark.integration

PROMPT_TOKENS, MAX_TOKENS = 1500, 32
CHUNK, BLOCK = 64, 16
"""--prefill-chunk, and up's --block-size."""
SLOW_S = 0.25
"""Each prefill step takes this much longer (so 1,500 tokens take 24 chunks of at least 0.25 s)."""
KILL_AFTER = 1024
"""Tokens whose KV must have reached the decode instance in every layer before the prefill is killed."""
DETECTION_BOUND_S = 1.5 * 3 + 5.0
"""The gateway's --silent-after-s at its worst (nobody heard at all) plus the 5 s a migration may take."""
LAYER_TOKEN_BYTES = 2 * preset("tiny").num_kv_heads * preset("tiny").head_dim * 4
"""Key and value bytes of one token in one layer (fp32)."""


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """2 prefill + 1 decode instances of tiny in fp32, chunks of 64 tokens; every prefill step 0.25 s slower while
    the switch file exists; no calibration (it would be slowed too)."""
    root = tmp_path_factory.mktemp("up-kept-kv")
    switch = root / "slow"
    switch.touch()
    cluster = UpProcess(str(root / "up"), "--prefill", "2", "--decode", "1", "--model", "tiny",
                        "--prefill-chunk", str(CHUNK), "--conductors", "1",
                        env={"KVC_SLOW_STEP_S": str(SLOW_S), "KVC_SLOW_WHILE_FILE": str(switch),
                             "KVC_CALIBRATE": "0"}, timeout_s=240.0)
    try:
        yield cluster
    finally:
        cluster.stop()


def stats(up: UpProcess, name: str) -> dict:
    return up.health(name)["stats"]


def conductor_metric(up: UpProcess, name: str) -> float:
    url = up.reload()["services"]["conductor-0"]["health_url"].replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.split("{")[0].split(" ")[0] == name)


def arrived(up: UpProcess, before: dict) -> int:
    """Tokens whose KV reached the decode instance since `before` (in every layer: a chunk's layers go together)."""
    received = stats(up, "decode-0")["kv_bytes_received"] - before["decode-0"]["kv_bytes_received"]
    return received // (preset("tiny").num_layers * LAYER_TOKEN_BYTES)


def test_a_prefill_killed_after_1024_of_1500_tokens_leaves_them_to_the_continuation(up):
    prompt = [3 + (i * 17) % 250 for i in range(PROMPT_TOKENS)]  # uncached anywhere
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    before = {name: stats(up, name) for name in ("prefill-0", "prefill-1", "decode-0")}
    pulls_before = conductor_metric(up, "kvc_placements_pulling_from_decode_total")

    connection = http.client.HTTPConnection("127.0.0.1", up.port, timeout=120)
    started = time.monotonic()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()  # opens once the request is placed
    assert response.status == 200
    victim = response.getheader("x-kvcentric-prefill")
    survivor = "prefill-1" if victim == "prefill-0" else "prefill-0"
    eventually(lambda: arrived(up, before), f"{KILL_AFTER} tokens' KV at the decode instance",
               until=lambda tokens: tokens >= KILL_AFTER + CHUNK, timeout_s=60, every_s=0.02)
    os.kill(up.reload()["services"][victim]["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    at_kill = arrived(up, before)  # the push broke off: nothing more comes until the continuation's
    assert at_kill < PROMPT_TOKENS, at_kill  # killed mid-prompt

    text, first_at, usage, errors = "", None, None, []
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: "):])
        errors += [event["error"]] if "error" in event else []
        for choice in event.get("choices", []):
            first_at = first_at or time.monotonic()
            text += choice.get("text", "")
        usage = event.get("usage") or usage
    connection.close()

    decode = stats(up, "decode-0")
    kept_tokens = decode.get("kv_tokens_kept", 0) - before["decode-0"].get("kv_tokens_kept", 0)
    kept_blocks = kept_tokens // BLOCK
    computed = stats(up, survivor)["prefill_tokens_computed"] - before[survivor]["prefill_tokens_computed"]
    from_host = stats(up, survivor)["prefill_tokens_from_host"] - before[survivor]["prefill_tokens_from_host"]
    print(f"prefill killed {killed_at - started:.2f} s in, {at_kill} tokens at the decode; {kept_tokens} kept; "
          f"the survivor computed {computed} and pulled {from_host}; first token {first_at - killed_at:.2f} s "
          f"after the kill")

    assert errors == [], errors
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS
    runner = make_runner(num_blocks=128, block_size=BLOCK)
    reference, _ = generate(runner, make_pool(runner), prompt,
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert text == ByteTokenizer().decode(reference)  # the tokens of a run nothing disturbed

    assert KILL_AFTER <= kept_tokens <= at_kill  # every token in every layer, rounded down to whole blocks
    assert from_host == kept_tokens  # pulled, not computed
    assert computed <= PROMPT_TOKENS - KILL_AFTER + CHUNK and computed == PROMPT_TOKENS - kept_tokens
    assert decode["kv_blocks_kept_served"] - before["decode-0"].get("kv_blocks_kept_served", 0) == kept_blocks
    assert decode["blocks_served"] - before["decode-0"].get("blocks_served", 0) == kept_blocks
    assert conductor_metric(up, "kvc_placements_pulling_from_decode_total") == pulls_before + 1
    assert first_at - killed_at < DETECTION_BOUND_S

    # handed over: forgotten there; and no block of the decode instance is held any more
    settled = eventually(lambda: stats(up, "decode-0"), "the decode instance's blocks all free",
                         until=lambda s: s["kv_blocks_free"] == s["kv_blocks_total"], timeout_s=30)
    assert settled["kv_blocks_kept_handed_over"] - before["decode-0"].get("kv_blocks_kept_handed_over", 0) == \
        kept_blocks
