"""The LLaMA-family transformer in torch, reading and writing a paged KV cache.

RMSNorm, rotary position embeddings (half-split, as in the reference LLaMA), grouped-query attention
and a SwiGLU MLP. It computes logits for given tokens; it does not schedule, allocate blocks or sample.
The cache is one preallocated tensor per key/value: [num_layers, num_slots, num_kv_heads, head_dim],
where slot = block * block_size + offset, so callers address tokens by slot ids.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from kvcentric.model.config import ModelConfig

LayerHook = Callable[[int], None]
"""Called with the layer index right after that layer's KV for the new tokens is in the cache."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: "AttentionBatch", rotary: Rotary,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q = rotary(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), batch.positions)
        k = rotary(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), batch.positions)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        k_cache[batch.write_slots] = k
        v_cache[batch.write_slots] = v
        out = torch.empty_like(q)
        for seq in batch.sequences:
            keys = k_cache[seq.context_slots].transpose(0, 1)
            values = v_cache[seq.context_slots].transpose(0, 1)
            query = q[seq.start:seq.end].transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=seq.mask, enable_gqa=self.num_heads != self.num_kv_heads)
            out[seq.start:seq.end] = attended.transpose(0, 1)
        return self.o_proj(out.reshape(tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, batch, rotary, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), batch, rotary, k_cache, v_cache)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class SequenceSlice:
    """One sequence of a batch: its rows in the flat token batch and the cache slots it attends to."""

    def __init__(self, start: int, end: int, context_slots: torch.Tensor, first_position: int) -> None:
        self.start, self.end = start, end
        self.context_slots = context_slots
        new = end - start
        context = context_slots.shape[0]
        # Query i sits at position first_position + i and sees context positions 0..first_position + i.
        query_pos = torch.arange(first_position, first_position + new).unsqueeze(1)
        self.mask = torch.arange(context).unsqueeze(0) <= query_pos


class AttentionBatch:
    """Flattened tokens of several sequences with their positions and cache addressing."""

    def __init__(self, positions: torch.Tensor, write_slots: torch.Tensor,
                 sequences: list[SequenceSlice]) -> None:
        self.positions, self.write_slots, self.sequences = positions, write_slots, sequences


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.max_position, config.rope_theta)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor, logit_rows: torch.Tensor,
                on_layer: LayerHook | None = None) -> torch.Tensor:
        """Run the new tokens through every layer, writing their KV; return logits of `logit_rows`."""
        x = self.embed_tokens(token_ids)
        for index, layer in enumerate(self.layers):
            x = layer(x, batch, self.rotary, k_cache[index], v_cache[index])
            if on_layer is not None:
                on_layer(index)
        return self.lm_head(self.norm(x[logit_rows]))


def random_init(model: LlamaModel, seed: int, std: float = 0.02) -> LlamaModel:
    """Seeded random weights ("dummy" model): the same seed gives the same model in any process."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model
