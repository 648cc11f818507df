"""The LLaMA-family transformer in torch (LLaMA, Mistral, Qwen2), reading and writing a paged KV cache.

RMSNorm, rotary embeddings (half-split as in the reference LLaMA; linear and llama3 scaling), grouped-
query attention (optional q/k/v bias, Mistral's sliding window), SwiGLU MLP, optional tied embeddings.
Module names follow Hugging Face's, so a checkpoint's tensors load by name. It computes logits for
given tokens; it does not schedule, allocate blocks or sample, lay weights out for a GEMM (`gemm.py`), choose a
device's ops (`dispatch.py`) or make its weights (`weights.py`). The cache is one tensor per key/value:
[num_layers, num_slots, num_kv_heads, head_dim] with slot = block * block_size + offset (`batch.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvcentric.engine.model.batch import AttentionBatch, fresh_runs, gather_blocks
from kvcentric.engine.model.gemm import Weight, can_pack, linear, linear_add, pack_weight
from kvcentric.engine.model.ops import LayerOps
from kvcentric.model.config import ModelConfig


LayerHook = Callable[[int, torch.Tensor, torch.Tensor], None]
"""Called as hook(layer, keys, values) once a layer has written the KV of the new tokens to the cache;
keys/values are [new_tokens, num_kv_heads, head_dim] (rotary already applied to keys)."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused kernel, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotary frequencies, with linear or llama3 scaling applied (as Meta's LLaMA 3.1 defines it)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_context = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    if kind:
        raise ValueError(f"rope scaling {kind!r} is not supported (linear, llama3)")
    return inv_freq


class Rotary(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        if torch.get_default_device().type == "meta":  # `weights.empty_model`: shapes only (a meta arange
            # would import TorchDynamo); `compute_tables` fills them where the model runs
            with torch.device("cpu"):
                pairs = len(rope_inverse_frequencies(config))
            cos = sin = torch.empty(config.max_position, 2 * pairs)
        else:
            angles = self.angles()
            cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def angles(self) -> torch.Tensor:
        """[max_position, head_dim] rotation angles, in fp32 on the current default device."""
        angles = torch.outer(torch.arange(self.config.max_position, dtype=torch.float32),
                             rope_inverse_frequencies(self.config))
        return torch.cat([angles, angles], dim=-1)

    def compute_tables(self, device: torch.device, dtype: torch.dtype) -> None:
        """Fill cos and sin on `device` in `dtype` (a model built on the meta device has none): computed
        in fp32 on the CPU, so every device gets the same tables."""
        with torch.device("cpu"):
            angles = self.angles()
        self.cos = angles.cos().to(device, dtype)
        self.sin = angles.sin().to(device, dtype)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """x: [tokens, heads, head_dim], rotated by the batch's positions into a new tensor. The halves are
        computed apart (x1·cos - x2·sin, x2·cos + x1·sin), with no concatenated copy of x; the position
        tables are gathered once per batch and shared by every layer."""
        if batch.rotation is None:
            half = x.shape[-1] // 2
            batch.rotation = (self.cos[batch.positions, :half].unsqueeze(1).to(x.dtype),
                              self.sin[batch.positions, :half].unsqueeze(1).to(x.dtype))
        cos, sin = batch.rotation
        half = cos.shape[-1]
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        first, second = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=first)
        first.sub_(x2 * sin)
        torch.mul(x2, cos, out=second)
        second.add_(x1 * sin)
        return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding_window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        self.qkv: tuple[Weight, torch.Tensor | None] | None = None
        self.out: tuple[Weight, torch.Tensor | None] | None = None
        self.ops: LayerOps | None = None

    def fuse(self, pack: bool = False) -> None:
        """One q|k|v matmul instead of three (same numbers, bigger and faster GEMM); call after loading.
        `pack`: the weights go into oneDNN's layout (`pack_weight`), o_proj's too."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) if self.q_proj.bias is not None \
            else None
        self.qkv = (pack_weight(weight, pack), None if bias is None else bias.detach())
        del self.q_proj, self.k_proj, self.v_proj
        if pack and can_pack(self.o_proj.weight):
            bias = self.o_proj.bias
            self.out = (pack_weight(self.o_proj.weight, pack), None if bias is None else bias.detach())
            del self.o_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        return linear(x, *self.qkv).split(sizes, dim=-1)

    def output(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + o_proj(x)."""
        return residual + self.o_proj(x) if self.out is None else linear_add(x, *self.out, residual)

    def rotated(self, x: torch.Tensor, batch: AttentionBatch, rotary: Rotary,
                qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """q and k rotated (in one pass when q|k|v came from one GEMM, or is given), v: [tokens, heads, head_dim]
        each."""
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv is None:
            q, k, v = self.project(x)
            return (rotary(q.reshape(tokens, heads, self.head_dim), batch),
                    rotary(k.reshape(tokens, kv_heads, self.head_dim), batch),
                    v.reshape(tokens, kv_heads, self.head_dim))
        if qkv is None:
            qkv = linear(x, *self.qkv).view(tokens, heads + 2 * kv_heads, self.head_dim)
        qk = rotary(qkv[:, :heads + kv_heads], batch)
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]

    def stored(self, x: torch.Tensor, batch: AttentionBatch, rotary: Rotary, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q and k rotated, v ([tokens, heads, head_dim] each), k and v written to the batch's cache slots: in one
        launch with the fused ops (after the q|k|v GEMM), else rotary then two index copies."""
        qkv = None
        if self.ops is not None and self.qkv is not None:
            qkv = linear(x, *self.qkv).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            if self.ops.fits(qkv, k_cache, v_cache):
                return self.ops.rotate_store(qkv, self.num_heads, self.num_kv_heads, rotary.cos, rotary.sin,
                                             batch.positions, batch.write_slots, k_cache, v_cache)
        q, k, v = self.rotated(x, batch, rotary, qkv)
        k_cache.index_copy_(0, batch.write_slots, k)
        v_cache.index_copy_(0, batch.write_slots, v)
        return q, k, v

    def forward(self, x, batch: AttentionBatch, rotary: Rotary, k_cache, v_cache, residual):
        """residual + the attention output, and this step's k and v."""
        tokens = x.shape[0]
        q, k, v = self.stored(x, batch, rotary, k_cache, v_cache)
        gqa = self.num_heads != self.num_kv_heads
        padded = None
        rows = batch.padded
        if rows is not None:  # decode: one new token per sequence, one batched call
            if batch.kernels is not None:  # over the cache in place (CPU kernel)
                padded = batch.kernels.decode(q[batch.padded_start:], k_cache, v_cache, rows.blocks, rows.lengths,
                                              batch.block_size, self.sliding_window)
            if padded is None:
                if rows.mask is None:  # rows laid out for the kernels alone (CUDA graphs): SDPA cannot mask them
                    raise RuntimeError("the attention kernels declined decode rows that have no mask")
                keys = gather_blocks(k_cache, rows.blocks, batch.block_size)
                values = gather_blocks(v_cache, rows.blocks, batch.block_size)
                padded = F.scaled_dot_product_attention(q[batch.padded_start:].unsqueeze(2), keys, values,
                                                        attn_mask=rows.mask, enable_gqa=gqa).squeeze(2)
        if padded is not None and batch.padded_start == 0:
            out = padded
        else:  # prefill slices, and in a mixed step the decode rows after them
            out = torch.empty_like(q)
            if padded is not None:
                out[batch.padded_start:] = padded
            fresh = batch.fresh_rows()
            if fresh is not None and batch.kernels is not None and batch.kernels.prefill(q, k, v, out, *fresh):
                fresh = None  # every whole prompt computed by the kernel in one call (fresh: inside any window)
            for run in fresh_runs(batch.sequences) if fresh is not None else ():  # one length: one SDPA call
                start, end, length = run[0].start, run[-1].end, run[0].end - run[0].start
                attended = F.scaled_dot_product_attention(
                    self.heads_first(q[start:end], len(run), length), self.heads_first(k[start:end], len(run), length),
                    self.heads_first(v[start:end], len(run), length), is_causal=True)
                out[start:end] = attended.transpose(1, 2).reshape(end - start, self.num_heads, self.head_dim)
            for seq in batch.sequences:
                if seq.fresh:
                    continue
                keys = self.heads_first(k_cache[seq.context_slots], 1, seq.context_slots.shape[0])
                values = self.heads_first(v_cache[seq.context_slots], 1, seq.context_slots.shape[0])
                attended = F.scaled_dot_product_attention(  # 4-D: the fused kernels want a batch dim
                    q[seq.start:seq.end].transpose(0, 1)[None], keys, values, attn_mask=seq.mask,
                    is_causal=seq.causal)
                out[seq.start:seq.end] = attended[0].transpose(0, 1)
        return self.output(out.reshape(tokens, -1), residual), k, v

    def heads_first(self, x: torch.Tensor, count: int, length: int) -> torch.Tensor:
        """[count, heads, length, head_dim] from `count` runs of `length` rows of [rows, heads, head_dim],
        KV heads repeated to the query heads: the fused CPU kernels take only equal head counts (no GQA)."""
        x = x.view(count, length, x.shape[1], self.head_dim).transpose(1, 2)
        group = self.num_heads // x.shape[1]
        return x.repeat_interleave(group, dim=1) if group > 1 else x


MLP_ROWS = 512
"""A CPU MLP over more rows runs this many at a time: the gate|up output of 512 rows of `small` (5.8 MB) stays in
the cache for SwiGLU and the down projection, where 2048 rows (23 MB) went out to memory and back. The GEMMs
are as fast on 512 rows as on 2048, and 256 rows gained nothing more (docs/performance-notebook.md, "Fused layer
ops and oneDNN's blocked weights")."""


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        self.gate_up: Weight | None = None
        self.down: Weight | None = None
        self.ops: LayerOps | None = None
        self.look: Callable[[], None] | None = None
        """`LlamaModel.look`, called between the gate|up and the down projection."""

    def fuse(self, pack: bool = False) -> None:
        """One gate|up matmul instead of two; call after loading. `pack`: oneDNN's layout, down_proj's too."""
        self.gate_up = pack_weight(torch.cat([self.gate_proj.weight, self.up_proj.weight]), pack)
        del self.gate_proj, self.up_proj
        if pack and can_pack(self.down_proj.weight):
            self.down = pack_weight(self.down_proj.weight, pack)
            del self.down_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the MLP of x; on the CPU, MLP_ROWS rows at a time (see there)."""
        if x.shape[0] > MLP_ROWS and self.down is not None and x.device.type == "cpu":
            out = torch.empty_like(residual)
            for start in range(0, x.shape[0], MLP_ROWS):
                part = slice(start, start + MLP_ROWS)
                out[part] = self.compute(x[part], residual[part])
            return out
        return self.compute(x, residual)

    def compute(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return residual + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up)
        if self.look is not None:
            self.look()
        if self.ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            hidden = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate).mul_(up)
        return residual + self.down_proj(hidden) if self.down is None else linear_add(hidden, self.down, None,
                                                                                      residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

        self.look: Callable[[], None] | None = None
        """`LlamaModel.look`, called between the attention and the MLP."""

    def forward(self, x, batch, rotary, k_cache, v_cache):
        x, k, v = self.self_attn(self.input_layernorm(x), batch, rotary, k_cache, v_cache, x)
        if self.look is not None:
            self.look()
        return self.mlp(self.post_attention_layernorm(x), x), k, v


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Given its weight, the embedding skips its default init: on the meta device (`weights.empty_model`)
        # that init goes through torch's reference ops, whose first use imports TorchDynamo (and Triton),
        # seconds of an engine's start for a tensor that holds no values.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie()
        self.rotary = Rotary(config)
        self._look: Callable[[], None] | None = None

    @property
    def look(self) -> Callable[[], None] | None:
        """Called before each layer, between its attention and its MLP, and between the MLP's two projections
        (the lent cores' thread count, `ModelThread.refresh`): three looks a layer take a core freed mid-layer
        sooner, and give one back later, than one look a layer did (docs/performance.md)."""
        return self._look

    @look.setter
    def look(self, fn: Callable[[], None] | None) -> None:
        self._look = fn
        for layer in self.modules():  # a ModuleList, or a pipeline stage's ModuleDict of its own layers
            if isinstance(layer, DecoderLayer):
                layer.look = layer.mlp.look = fn

    def tie(self) -> None:
        """The output projection is the embedding table when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def fuse(self, pack: bool = False) -> LlamaModel:
        """Fuse q|k|v and gate|up projections of every layer (after weights are loaded); `pack`: the layers'
        projections in oneDNN's layout (fp32 on the CPU; elsewhere nothing changes)."""
        for layer in cast("list[DecoderLayer]", self.layers):
            layer.self_attn.fuse(pack)
            layer.mlp.fuse(pack)
        return self

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor, logit_rows: torch.Tensor, on_layer: LayerHook | None = None,
                before_layer: Callable[[int], None] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the new tokens through every layer, writing their KV; return fp32 logits of `logit_rows`.
        `before_layer(i)` runs before layer i, `on_layer(i, k, v)` after it; `out`: a [rows, vocab] fp32 tensor the
        logits are written to (the CUDA graphs' shared output) instead of a new one."""
        x = self.embed_tokens(token_ids)
        for index, layer in enumerate(self.layers):
            if self._look is not None:
                self._look()
            if before_layer is not None:
                before_layer(index)
            x, k, v = layer(x, batch, self.rotary, k_cache[index], v_cache[index])
            if on_layer is not None:
                on_layer(index, k, v)
        logits = self.lm_head(self.norm(x[logit_rows]))
        return logits.float() if out is None else out.copy_(logits)
