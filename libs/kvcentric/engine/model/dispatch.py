"""Which ops a model's modules run through: a device's fused ops (`ops.LayerOps`) on every norm, rotary and SwiGLU,
and the small GEMM's layout beside the fused projections where it has one; it computes nothing itself.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from kvcentric.engine.model.gemm import SMALL_GEMM_ROWS, two_layouts
from kvcentric.engine.model.llama import MLP, Attention, RMSNorm
from kvcentric.engine.model.ops import LayerOps, SmallGemm


def use_ops(model: nn.Module, ops: LayerOps | None) -> None:
    """Every norm, rotary with cache write, and SwiGLU activation of `model` (a whole model or a pipeline stage's)
    through `ops` (None: torch's ops); with ops that have a small GEMM (`SmallGemm`, the CPU's), the fused
    projections get its layout beside theirs (`TwoLayouts`) where it runs for some rows (`small_rows`)."""
    gemm = cast(SmallGemm, ops) if hasattr(ops, "small_linear") and SMALL_GEMM_ROWS > 0 else None
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.ops = ops
        if gemm is not None and isinstance(module, Attention):
            module.qkv = None if module.qkv is None else (two_layouts(module.qkv[0], gemm), module.qkv[1])
            module.out = None if module.out is None else (two_layouts(module.out[0], gemm), module.out[1])
        if gemm is not None and isinstance(module, MLP):
            module.gate_up = None if module.gate_up is None else two_layouts(module.gate_up, gemm)
            module.down = None if module.down is None else two_layouts(module.down, gemm)
