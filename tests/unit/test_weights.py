"""How an engine's model is made: seeded random weights drawn where they live, in the dtype asked for,
the same in every process for a seed; checkpoints read straight to the model's device."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import subprocess
import sys

import pytest
import torch

from checkpoints import build_checkpoint
from kvcentric.engine.model.weights import DRAW_CHUNK
from kvcentric.engine.model.runner import build_model
from kvcentric.model.config import ModelConfig, load_model_config, preset

WIDE = dataclasses.replace(preset("tiny"), name="wide", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                           num_layers=1, num_heads=8, num_kv_heads=8, head_dim=128)
"""Big enough that its embedding is drawn in several chunks and its fp32 copy would show in memory."""


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def build_in_a_new_process(config: ModelConfig, seed: int, dtype: str) -> dict:
    """Build in a fresh interpreter: the weights' fingerprint and the peak host memory the build added."""
    code = f"""
import hashlib, json, resource, torch
from kvcentric.engine.model.runner import build_model
from kvcentric.model.config import ModelConfig
{inspect.getsource(fingerprint)}
config = ModelConfig(**json.loads({json.dumps(json.dumps(dataclasses.asdict(config)))}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = build_model(config, {seed}, getattr(torch, {dtype!r}), torch.device("cpu"))
added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({{"fingerprint": fingerprint(model), "peak_added_bytes": added * 1024,
                   "fp32_bytes": config.num_params * 4}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_same_seed_gives_the_same_weights_in_another_process_and_another_seed_others():
    here = fingerprint(build_model(preset("tiny"), 7, torch.float32, torch.device("cpu")))
    assert build_in_a_new_process(preset("tiny"), 7, "float32")["fingerprint"] == here
    assert fingerprint(build_model(preset("tiny"), 8, torch.float32, torch.device("cpu"))) != here


def test_the_weights_do_not_depend_on_how_many_threads_draw_them():
    assert WIDE.vocab_size * WIDE.hidden_size > DRAW_CHUNK  # the embedding is drawn in several chunks
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(build_model(WIDE, 3, torch.bfloat16, torch.device("cpu")))
        torch.set_num_threads(4)
        four = fingerprint(build_model(WIDE, 3, torch.bfloat16, torch.device("cpu")))
    finally:
        torch.set_num_threads(threads)
    assert one == four


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_weight_and_table_is_in_the_dtype_asked_for_and_drawn(dtype):
    model = build_model(preset("tiny"), 0, dtype, torch.device("cpu"))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    tensors |= {f"layer{i}.qkv": layer.self_attn.qkv[0] for i, layer in enumerate(model.layers)}
    assert {name: t.dtype for name, t in tensors.items() if t.dtype != dtype} == {}
    embedding = model.embed_tokens.weight.float()
    assert abs(embedding.std().item() - 0.02) < 0.002 and torch.isfinite(embedding).all()
    assert (model.norm.weight == 1).all()


def test_a_bf16_model_is_drawn_without_a_full_size_fp32_copy_on_the_host():
    built = build_in_a_new_process(WIDE, 0, "bfloat16")
    assert built["peak_added_bytes"] < 0.75 * built["fp32_bytes"], built


def test_a_checkpoint_loads_in_the_dtype_asked_for_with_its_tied_embedding(tmp_path):
    directory = build_checkpoint(tmp_path, "qwen2")  # ties lm_head to the embedding
    config = load_model_config(str(directory))
    model = build_model(config, 0, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    from safetensors.torch import load_file
    stored = load_file(str(next(directory.glob("*.safetensors"))))
    torch.testing.assert_close(model.embed_tokens.weight, stored["model.embed_tokens.weight"].to(torch.bfloat16))
