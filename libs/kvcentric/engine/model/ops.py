"""The ops a device's kernels offer the model (`kernels/`: the CPU's in C++, the GPU's in Triton), as protocols:
a layer's small fused ops, a GEMM for few rows over a layout of its own, and attention over the paged cache; it
implements none of them and decides nothing about where they run (`dispatch.py`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerOps(Protocol):
    """Fused versions of a layer's small ops for a device (`kernels/fused.py`, the GPU's), each one launch."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotate_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def fits(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool: ...


class SmallGemm(Protocol):
    """A GEMM for few rows over weights in a layout of its own (`kernels.CpuLayerOps`, `kernels/gemm.cpp`)."""

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor | None: ...

    def small_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor | None: ...


class AttentionKernels(Protocol):
    """Attention kernels of the device (`engine/model/kernels`, the CPU's), each declining what it does not take."""

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor, block_size: int, window: int | None = None) -> torch.Tensor | None:
        """One query row per sequence over its block table's first `lengths` positions, read in place; None
        when declined."""

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> bool:
        """Causal attention of whole prompts (rows starts[s] .. + lengths[s]) over their own k and v, written into
        those rows of `out`; False when declined (nothing written)."""
