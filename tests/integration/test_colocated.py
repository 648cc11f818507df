"""`kvcentric up --colocated N`: the vLLM-style baseline on the same stack, tokens equal to the reference, with
split steps and with mixed steps (`--step-tokens`)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from factories import make_pool, make_runner
from kvcentric.engine.local import generate
from harness import UpProcess
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.core.protocol import SamplingParams


@pytest.fixture(scope="module", params=["split steps", "mixed steps"])
def colocated(request, tmp_path_factory):
    env = {"KVC_STEP_TOKENS": "64" if request.param == "mixed steps" else "0"}
    up = UpProcess(str(tmp_path_factory.mktemp("up-colocated")), "--colocated", "1", env=env)
    try:
        yield up
    finally:
        up.stop()


def test_a_colocated_instance_prefills_and_decodes_without_moving_kv(colocated):
    prompt = "colocated baseline"
    request = urllib.request.Request(colocated.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": prompt, "max_tokens": 9, "temperature": 0,
                                                      "ignore_eos": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["x-kvcentric-prefill"] == response.headers["x-kvcentric-decode"] == "colocated-0"
        body = json.load(response)
    runner = make_runner(num_blocks=64, block_size=16)
    expected, _ = generate(runner, make_pool(runner), ByteTokenizer().encode(prompt),
                           SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert body["choices"][0]["text"] == ByteTokenizer().decode(expected)
    stats = colocated.health("colocated-0")["stats"]
    assert stats["kv_bytes_received"] == 0 and stats["requests_prefilled"] == 1
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
