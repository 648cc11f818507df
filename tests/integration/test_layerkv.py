"""`kvcentric up --colocated 1 --layerkv` and `kvcentric up --prefill 1 --decode 1 --layerkv`: a prompt longer
than the (prefill) instance's device KV cache holds in any layer is served with its layers in host memory, and
its greedy text equals the reference's (the same model run without LayerKV)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from factories import make_pool, make_runner
from harness import UpProcess
from waiting import eventually
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.local import generate
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


@pytest.fixture(scope="module")
def layerkv_prefill(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("up-layerkv-pd")), "--prefill", "1", "--decode", "1", "--layerkv",
                   "--prefill-kv-blocks", str(DEVICE_BLOCKS), "--num-kv-blocks", "64", "--prefill-chunk", "100")
    try:
        yield up
    finally:
        up.stop()


PROMPT = "LayerKV keeps some layers of the KV cache in host memory. " * 4


def complete_greedy(up: UpProcess, prompt: str, max_tokens: int = 9) -> str:
    request = urllib.request.Request(up.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]


def reference_text(prompt: str, max_tokens: int = 9) -> str:
    """The same model (tiny, seed 0, fp32) run in process with whole device blocks, no LayerKV."""
    tokens = ByteTokenizer().encode(prompt)
    assert len(tokens) > DEVICE_BLOCKS * 16
    runner = make_runner(num_blocks=64, block_size=16)
    expected, _ = generate(runner, make_pool(runner), tokens,
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return ByteTokenizer().decode(expected)


def test_a_prompt_larger_than_the_device_cache_is_served_from_host_layers(layerkv):
    assert complete_greedy(layerkv, PROMPT) == reference_text(PROMPT)
    runner = make_runner(num_blocks=1, block_size=16)
    stats = layerkv.health("colocated-0")["stats"]
    assert stats["layerkv_prompt_layers_offloaded"] == runner.config.num_layers
    assert stats["layerkv_bytes_to_host"] > 0 and stats["layerkv_bytes_to_device"] > 0
    assert stats["layerkv_prefills_admitted"] == 1
    assert stats["layerkv_device_layer_blocks_free"] == DEVICE_BLOCKS * runner.config.num_layers


def test_a_prefill_instance_computes_a_prompt_larger_than_its_device_cache_with_host_layers(layerkv_prefill):
    assert complete_greedy(layerkv_prefill, PROMPT) == reference_text(PROMPT)
    runner = make_runner(num_blocks=1, block_size=16)
    layers = runner.config.num_layers
    stats = layerkv_prefill.health("prefill-0")["stats"]
    assert stats["layerkv_prompt_layers_offloaded"] == layers  # none of its layers fit the device: all on the host
    assert stats["layerkv_bytes_to_host"] > 0 and stats["layerkv_bytes_to_device"] > 0  # 3 chunks: read back
    assert stats["layerkv_prefills_admitted"] == 1
    assert "layerkv_bytes_to_host" not in layerkv_prefill.health("decode-0")["stats"]  # decode keeps whole blocks
    host_blocks = (1024 << 20) // (2 * 16 * runner.layer_token_bytes)  # --layerkv-host-mb's default
    eventually(lambda: layerkv_prefill.health("prefill-0")["stats"]["layerkv_host_layer_blocks_free"],
               "the prompt's host layer blocks given back once its push is done", until=host_blocks.__eq__)
