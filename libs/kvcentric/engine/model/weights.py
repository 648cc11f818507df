"""A model's weights: allocated where it runs (`empty_model`), drawn at random from a seed (`random_init`, the
"dummy" models), or read from a Hugging Face checkpoint (`load_checkpoint`); it builds no layers (`llama.py`).
"""

from __future__ import annotations

import concurrent.futures
import zlib
from pathlib import Path

import torch

from kvcentric.engine.model.llama import LlamaModel
from kvcentric.model.config import ModelConfig


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
    """The model with its weights allocated, uninitialised, on `device` in `dtype`: built on the meta device
    (no host copy, no default init, no fp32 temporary), then given memory where it runs; rotary tables filled."""
    with torch.device("meta"):
        model = LlamaModel(config)
    materialize(model, dtype, torch.device(device))
    model.tie()  # materializing gave the two modules a parameter each
    model.rotary.compute_tables(torch.device(device), dtype)
    return model


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialised memory on `device`
    (floating point ones in `dtype`). What `Module.to_empty` does, without its `empty_like` of a meta tensor,
    whose first call imports SymPy (hundreds of modules, seconds of an engine's start)."""
    def empty(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype, device=device)

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer)


DRAW_CHUNK = 1 << 22
"""Elements drawn from one generator: a weight is drawn in chunks of this many, each from a generator of
its own, so the chunks can be drawn in parallel and the weights depend on nothing but seed and name."""


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The seed of one chunk's generator, from the model's seed, the parameter's name and the chunk's index
    (not the order of the parameters, their shapes, or how many threads draw)."""
    return (seed * 1_000_003 + zlib.crc32(f"{name}:{chunk}".encode())) % (1 << 63)


def random_init(model: LlamaModel, seed: int, std: float = 0.02) -> LlamaModel:
    """Seeded random weights ("dummy" model), drawn in place where the weights are and in their dtype (no
    fp32 temporary), chunk by chunk (`DRAW_CHUNK`), on the CPU by torch's threads in parallel. The same seed
    gives the same model in any process on the same kind of device and dtype (CUDA's generator is not the
    CPU's, so a CPU and a GPU model differ)."""
    draws: list[tuple[torch.Tensor, int]] = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                flat = param.detach().view(-1)
                draws += [(flat[start:start + DRAW_CHUNK], chunk_seed(seed, name, start // DRAW_CHUNK))
                          for start in range(0, flat.numel(), DRAW_CHUNK)]

    def draw(chunk: tuple[torch.Tensor, int]) -> None:
        values, chunk_seed_ = chunk
        values.normal_(0.0, std, generator=torch.Generator(device=values.device).manual_seed(chunk_seed_))

    on_cpu = bool(draws) and draws[0][0].device.type == "cpu"
    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads()) if on_cpu else 1) as pool:
        list(pool.map(draw, draws))
    return model


def load_checkpoint(model: LlamaModel, directory: str) -> LlamaModel:
    """Copy a Hugging Face checkpoint's safetensors into the model by name, each tensor read straight to
    the model's device (safetensors' `safe_open`) and converted to its dtype there, one at a time; missing
    or extra tensors fail."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors files")
    params = dict(model.named_parameters())
    device = str(next(iter(params.values())).device)
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device=device) as tensors:
                for stored in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = stored.removeprefix("model.")
                    if name not in params:
                        if "rotary_emb" in name:
                            continue
                        raise ValueError(f"{file.name}: unexpected tensor {name}")
                    params[name].copy_(tensors.get_tensor(stored))
                    loaded.add(name)
    missing = set(params) - loaded - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{directory}: tensors missing from the checkpoint: {sorted(missing)[:5]}")
    return model
