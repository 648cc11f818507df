"""`kvcentric up --colocated 1 --layerkv`: a prompt longer than the device KV cache holds in any layer is
served with its layers in host memory, and its greedy text equals the reference's."""

from __future__ import annotations

import json
import urllib.request

import pytest

from factories import make_pool, make_runner
from harness import UpProcess
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.local import generate
from kvcentric.model.tokenizer import ByteTokenizer

DEVICE_BLOCKS = 8
"""128 tokens per layer on the device (16-token blocks): the prompt below needs more."""


@pytest.fixture(scope="module")
def layerkv(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-layerkv")), "--colocated", "1", "--layerkv",
                   "--num-kv-blocks", str(DEVICE_BLOCKS))
    try:
        yield up
    finally:
        up.stop()


def test_a_prompt_larger_than_the_device_cache_is_served_from_host_layers(layerkv):
    prompt = "LayerKV keeps some layers of the KV cache in host memory. " * 4
    request = urllib.request.Request(layerkv.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": prompt, "max_tokens": 9, "temperature": 0,
                                                      "ignore_eos": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        body = json.load(response)
    tokens = ByteTokenizer().encode(prompt)
    assert len(tokens) > DEVICE_BLOCKS * 16
    runner = make_runner(num_blocks=64, block_size=16)
    expected, _ = generate(runner, make_pool(runner), tokens,
                           SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert body["choices"][0]["text"] == ByteTokenizer().decode(expected)
    stats = layerkv.health("colocated-0")["stats"]
    assert stats["layerkv_prompt_layers_offloaded"] == runner.config.num_layers
    assert stats["layerkv_bytes_to_host"] > 0 and stats["layerkv_bytes_to_device"] > 0
    assert stats["layerkv_prefills_admitted"] == 1
    assert stats["layerkv_device_layer_blocks_free"] == DEVICE_BLOCKS * runner.config.num_layers
