"""`kvcentric up --colocated N`: the vLLM-style baseline on the same stack, tokens equal to the reference, with
split steps and with mixed steps (`--step-tokens`)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import urllib.request

import pytest

from factories import make_pool, make_runner
from kvcentric.engine.model.local import generate
from harness import UpProcess
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.core.protocol import SamplingParams


@pytest.fixture(scope="module", params=["split steps", "mixed steps"])
def colocated(request, tmp_path_factory):
    env = {"KVC_STEP_TOKENS": "64" if request.param == "mixed steps" else "0"}
    up = UpProcess(str(tmp_path_factory.mktemp("up-colocated")), "--colocated", "1", env=env)
    up.steps = request.param
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


def complete(url: str, prompt: str, max_tokens: int) -> str:
    request = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]


def test_prompts_at_once_get_the_reference_tokens_and_mixed_steps_compute_some_on_the_lane(colocated):
    """Six prompts of 150-250 tokens at once: with mixed steps of 64 tokens the model thread computes a few
    steps per prompt, and the others wait meanwhile, so the lane (`node.Lane`; two torch threads here, one per
    core of the 2-core box) takes some of them in passes of its own."""
    prompts = [f"{index} " + "lanes beside mixed steps " * (6 + 2 * index) for index in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(colocated.url, p, 6), prompts))
    runner = make_runner(num_blocks=256, block_size=16)
    for prompt, text in zip(prompts, texts):
        expected, _ = generate(runner, make_pool(runner), ByteTokenizer().encode(prompt),
                               SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert text == ByteTokenizer().decode(expected), prompt
    stats = colocated.health("colocated-0")["stats"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if colocated.steps == "mixed steps" and (os.cpu_count() or 1) >= 2:
        assert stats["lane_calls"] > 0
    else:
        assert "lane_calls" not in stats  # split steps run no lane


def test_structured_output_holds_on_split_and_mixed_steps(colocated):
    """A JSON schema at temperature 1 through the colocated engine (its mixed steps sample first tokens and
    decode tokens in one pass): every choice is JSON the schema accepts."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "boolean"}},
              "required": ["n", "b"], "additionalProperties": False}
    body = {"prompt": "json please", "max_tokens": 100, "temperature": 1.0, "seed": 11, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "nb", "schema": schema}}}
    request = urllib.request.Request(colocated.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    for choice in answer["choices"]:
        value = json.loads(choice["text"])
        assert set(value) == {"n", "b"} and 0 <= value["n"] <= 9 and isinstance(value["b"], bool)
        assert choice["finish_reason"] == "stop"
