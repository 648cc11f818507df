"""bfloat16 end to end on the disaggregated path: `kvcentric up` with KVC_DTYPE=bfloat16 gives the same greedy
tokens as one process in bfloat16, and the KV that crossed the messenger is exactly the cache's raw bytes
(layers x tokens x 2 x kv_heads x head_dim x 2 bytes): nothing converts it on the way."""

from __future__ import annotations

import json
import urllib.request

from factories import TEST_DEVICE
from harness import UpProcess
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer


def complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_bf16_disaggregated_equals_one_process_and_moves_raw_kv_bytes(tmp_path):
    prompt, max_tokens = "bfloat16 is what everyone serves in", 10
    up = UpProcess(str(tmp_path), "--model", "tiny", env={"KVC_DTYPE": "bfloat16"})
    try:
        before = up.health("decode-0")["stats"]["kv_bytes_received"]
        body = complete(up.url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True})
        after = up.health("decode-0")["stats"]["kv_bytes_received"]
    finally:
        up.stop()
    runner = ModelRunner(preset("tiny"), 64, 16, 0, dtype="bfloat16", device=TEST_DEVICE)
    token_ids = ByteTokenizer().encode(prompt)
    pool = BlockPool(runner.num_blocks, runner.block_size)
    expected = generate(runner, pool, token_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True))[0]
    assert body["choices"][0]["text"] == ByteTokenizer().decode(expected)
    config = preset("tiny")
    assert after - before == config.num_layers * len(token_ids) * 2 * config.num_kv_heads * config.head_dim * 2
