"""Which layers of a request's KV stay in device blocks (LayerKV §3.1.1–3.1.2): the fewest that hide the
offload behind the prefill (eq. 4), spread evenly over the depth. Arithmetic only; it moves nothing."""

from __future__ import annotations

import math


def retained_layers(num_layers: int, keep: int, phase: int = 0) -> list[int]:
    """`keep` layer indices spread evenly over `num_layers`, the last one always kept (§3.1.2: of 8 layers,
    keeping 4 keeps 1, 3, 5, 7); `phase` shifts them down by that many (mod the spacing) so that requests
    can take turns on the layers, which balances the per-layer free blocks."""
    if not 0 <= keep <= num_layers:
        raise ValueError(f"keep must be 0..{num_layers}, got {keep}")
    if keep == 0:
        return []
    spacing = num_layers // keep
    shift = phase % spacing if spacing > 1 else 0
    return [(index + 1) * num_layers // keep - 1 - shift for index in range(keep)]


def offloaded_layers(num_layers: int, kept: list[int]) -> list[int]:
    kept_set = set(kept)
    return [layer for layer in range(num_layers) if layer not in kept_set]


def layer_offload_s(seqlen: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, bandwidth_bps: float,
                    beta: float = 1.0) -> float:
    """Eq. 4, one layer: seconds to move one layer's keys and values of `seqlen` tokens over the link
    (`beta`: the empirical correction)."""
    return beta * 2 * seqlen * num_kv_heads * head_dim * dtype_bytes / bandwidth_bps


def min_retained_layers(num_layers: int, prefill_s: float, seqlen: int, num_kv_heads: int, head_dim: int,
                        dtype_bytes: int, bandwidth_bps: float, beta: float = 1.0) -> int:
    """Eq. 4: the least x with T_offload(L - x) <= T_prefill, so the offload of the other layers hides behind
    the prompt's compute: 0 for a long prompt (every layer may leave), up to L for a short one."""
    if bandwidth_bps <= 0:
        return num_layers
    per_layer = layer_offload_s(seqlen, num_kv_heads, head_dim, dtype_bytes, bandwidth_bps, beta)
    if per_layer <= 0:
        return 0
    hidden = math.floor(prefill_s / per_layer + 1e-9)
    return max(0, num_layers - hidden)
