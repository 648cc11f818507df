"""The GPU kernels checked once on the device an engine starts on, against torch's ops, at the model's shapes:
where Triton cannot compile them for that device (an old architecture, a Triton without a feature they use) or
they disagree, the engine says why and runs torch's ops, eagerly, instead of failing its first step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcentric.engine.model.kernels.fused import FusedOps
from kvcentric.engine.model.kernels.paged import PagedAttention
from kvcentric.engine.model.batch import gather_blocks
from kvcentric.model.config import ModelConfig

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def self_check(config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int) -> str | None:
    """None when the paged decode (whole and split) and the fused ops agree with torch's on a small case of the
    model's shapes; else what failed."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    tolerance = TOLERANCE.get(dtype, 3e-2)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    lengths = torch.tensor([3, 3 * block_size - 1], device=device)  # within the 3 blocks of each table
    blocks = 4
    tables = torch.tensor([[1, 0, 2], [3, 2, 0]], device=device)
    k_cache, v_cache = draw(blocks * block_size, kv_heads, dim), draw(blocks * block_size, kv_heads, dim)
    q = draw(2, heads, dim)
    keys, values = (gather_blocks(cache.float(), tables, block_size) for cache in (k_cache, v_cache))
    mask = torch.arange(keys.shape[2], device=device)[None] < lengths[:, None]
    expected = F.scaled_dot_product_attention(q.float().unsqueeze(2), keys, values, attn_mask=mask[:, None, None],
                                              enable_gqa=True).squeeze(2)
    for splits in (1, 2):
        out = PagedAttention(splits).decode(q, k_cache, v_cache, tables, lengths, block_size)
        if out is None or not torch.allclose(out.float(), expected, atol=tolerance, rtol=0):
            return f"paged decode attention ({splits} split) disagrees with SDPA"
    x, weight = draw(2, config.hidden_size), draw(config.hidden_size)
    normalized = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * weight
    if not torch.allclose(FusedOps.rms_norm(x, weight, 1e-5).float(), normalized.float(), atol=tolerance,
                          rtol=tolerance):
        return "fused RMSNorm disagrees with torch's"
    gate_up = draw(2, 2 * 64)
    if not torch.allclose(FusedOps.silu_mul(gate_up).float(), (F.silu(gate_up[:, :64]) * gate_up[:, 64:]).float(),
                          atol=tolerance, rtol=tolerance):
        return "fused SwiGLU disagrees with torch's"
    qkv = draw(2, heads + 2 * kv_heads, dim)
    cache_k, cache_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    table = torch.ones(8, dim, device=device, dtype=dtype)  # cos 1, sin 0: rotation by nothing
    _, rotated_k, _ = FusedOps.rotate_store(qkv, heads, kv_heads, table, torch.zeros_like(table),
                                            torch.tensor([0, 1], device=device), torch.tensor([1, 3], device=device),
                                            cache_k, cache_v)  # slots inside the 4 blocks whatever the block size
    if not (torch.equal(rotated_k, qkv[:, heads:heads + kv_heads]) and torch.equal(cache_k[3], rotated_k[1])
            and torch.equal(cache_v[1], qkv[0, heads + kv_heads:])):
        return "fused rotary and cache write disagree with torch's"
    return None
