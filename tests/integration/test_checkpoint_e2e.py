"""`kvcentric up --model <checkpoint>` serves a Hugging Face checkpoint of each architecture (Llama, Mistral,
Qwen2 with its q/k/v biases): greedy text equals transformers'."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from checkpoints import build_checkpoint, hf_model
from harness import UpProcess
from kvcentric.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(f"ckpt-{request.param}"), request.param)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """A cluster of its own (own NATS and Redis): engines of another model must not see its requests."""
    up = UpProcess(str(tmp_path_factory.mktemp("up-ckpt")), "--model", str(checkpoint))
    try:
        yield up
    finally:
        up.stop()


def complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_served_checkpoint_generates_what_transformers_generates(checkpoint, served):
    prompt = "Mooncake schedules requests by prefix cache hits"
    tokenizer = load_tokenizer(str(checkpoint))
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        expected = hf_model(checkpoint).generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                                 do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    body = complete(served.url, {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                 "ignore_eos": True})
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == tokenizer.decode(expected)
