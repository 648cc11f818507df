"""One stage of a pipelined prefill group (Mooncake §5.1): the model's slice of layers this instance holds
and the paged KV cache of those layers only, computing a chunk from tokens (the first stage) or from the
previous stage's hidden states, and handing on hidden states (every stage but the last) or logits (the last).

Weights are made on the meta device and only this stage's get memory; a seeded random model draws each
weight by its name (`weights.random_init`), so a stage's weights equal those of the whole model's same
layers. It computes; it does not schedule chunks or move bytes between stages.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn

from kvcentric.core.pipeline import StagePosition, stage_layers
from kvcentric.engine.model.batch import AttentionBatch, SequenceSlice
from kvcentric.engine.model.dispatch import use_ops
from kvcentric.engine.model.llama import DecoderLayer, LayerHook, LlamaModel
from kvcentric.engine.model.weights import random_init
from kvcentric.engine.model.runner import DTYPES, ModelRunner, device_kernels
from kvcentric.model.config import ModelConfig


def stage_model(config: ModelConfig, layers: range, first: bool, last: bool, dtype: torch.dtype,
                device: torch.device) -> LlamaModel:
    """The model with only `layers` (named as in the whole model), the embedding on the first stage and the
    final norm and output projection on the last; built on the meta device, given memory on `device`."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model.layers = nn.ModuleDict({str(index): model.layers[index] for index in layers})  # type: ignore[assignment]
    keep_embedding = first or (last and config.tie_word_embeddings)
    if not keep_embedding:
        del model.embed_tokens
    if not last:
        del model.norm, model.lm_head
    model = model.to(dtype=dtype).to_empty(device=device)
    if last and keep_embedding:
        model.tie()
    model.rotary.compute_tables(device, dtype)
    return model


def load_stage_checkpoint(model: LlamaModel, directory: str) -> LlamaModel:
    """Copy the checkpoint tensors this stage holds into it by name (the others are skipped)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    device = str(next(iter(params.values())).device)
    loaded = set()
    with torch.no_grad():
        for file in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device=device) as tensors:
                for stored in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = stored.removeprefix("model.")
                    if name in params:
                        params[name].copy_(tensors.get_tensor(stored))
                        loaded.add(name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"{directory}: tensors missing from the checkpoint: {sorted(missing)[:5]}")
    return model


def _fuse(model: LlamaModel, onednn: bool) -> LlamaModel:
    for layer in model.layers.values():  # type: ignore[operator]
        layer.self_attn.fuse(pack=onednn)
        layer.mlp.fuse(pack=onednn)
    return model


class StageRunner(ModelRunner):
    """A `ModelRunner` over one stage's layers: `config` is the stage's (its layer count), `whole` the
    model's; KV is addressed by local layer (0..len(layers)-1), `layers[local]` is the global index."""

    def __init__(self, config: ModelConfig, position: StagePosition, num_blocks: int, block_size: int,
                 seed: int = 0, dtype: str = "float32", device: str = "cpu", onednn: bool = True,
                 cpu_kernels: bool = True, gpu_kernels: bool = True) -> None:
        self.whole, self.position = config, position
        self.layers = stage_layers(config.num_layers, position.stages, position.index)
        self.config = dataclasses.replace(config, num_layers=len(self.layers))
        self.block_size, self.dtype, self.dtype_name = block_size, DTYPES[dtype], dtype
        self.device = torch.device(device)
        self.layered = None  # a stage's cache is whole blocks (no LayerKV)
        self.num_blocks = num_blocks
        self.graphs = None  # stages compute prompts only
        self.kernels, ops = device_kernels(config, self.dtype, self.device, block_size, cpu_kernels, gpu_kernels,
                                           onednn)
        model = stage_model(config, self.layers, position.first, position.last, self.dtype, self.device)
        model = load_stage_checkpoint(model, config.path) if config.path else random_init(model, seed)
        self.model = _fuse(model.eval(), onednn)
        use_ops(self.model, ops)
        by_name = dict(model.layers.named_children())
        self.decoder_layers = [cast(DecoderLayer, by_name[str(index)]) for index in self.layers]
        shape = (len(self.layers), num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def prefill(self, token_ids: list[int], block_table: list[int], start: int, end: int | None = None,
                on_layer: LayerHook | None = None, every_row: bool = False,
                before_layer: Callable[[int], None] | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Positions start..end-1 through this stage's layers: from the tokens (first stage) or `hidden`
        ([end - start, hidden_size], the previous stage's output; zeros when none, as in calibration).
        Returns the hidden states (not the last stage) or the logits of the last position, or of every one."""
        end = len(token_ids) if end is None else end
        context = self._slots(block_table, 0, end)
        sequence = SequenceSlice(0, end - start, context, start, self.config.sliding_window)
        batch = AttentionBatch(torch.arange(start, end, device=self.device), context[start:], [sequence],
                               kernels=self.kernels)
        if self.position.first:
            x = self.model.embed_tokens(torch.tensor(token_ids[start:end], device=self.device))
        elif hidden is None:
            x = torch.zeros((end - start, self.config.hidden_size), dtype=self.dtype, device=self.device)
        else:
            x = hidden.to(self.device)
        rows = torch.arange(end - start) if every_row else torch.tensor([end - start - 1])
        out = self._forward(x, batch, rows.to(self.device), on_layer, before_layer)
        return out if every_row or not self.position.last else out[0]

    @torch.inference_mode()
    def _forward(self, x: torch.Tensor, batch: AttentionBatch, rows: torch.Tensor,
                 on_layer: LayerHook | None, before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        for local, (index, layer) in enumerate(zip(self.layers, self.decoder_layers)):
            if before_layer is not None:  # this stage's own layer numbers: its cache holds only its layers
                before_layer(local)
            x, k, v = layer(x, batch, self.model.rotary, self.k_cache[local], self.v_cache[local])
            if on_layer is not None:
                on_layer(index, k, v)
        if not self.position.last:
            return x
        return self.model.lm_head(self.model.norm(x[rows])).float()

    def decode(self, token_ids, positions, block_tables):
        raise NotImplementedError("a pipeline stage only prefills")


def hidden_bytes(hidden: torch.Tensor) -> bytes:
    """Hidden states as the raw bytes of their dtype, C order, on the host."""
    return hidden.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def hidden_tensor(data: bytes, dtype: str, tokens: int, hidden_size: int) -> torch.Tensor:
    """[tokens, hidden_size] over received bytes (a copy: the model reads it after the message is gone)."""
    expected = tokens * hidden_size * torch.tensor([], dtype=DTYPES[dtype]).element_size()
    if len(data) != expected:
        raise ValueError(f"hidden states of {tokens} tokens: expected {expected} bytes, got {len(data)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(bytearray(data), dtype=DTYPES[dtype]).view(tokens, hidden_size)
