"""A linear layer's weight in the layouts the CPU's GEMMs want, and the call that runs x @ weightᵀ through the one
that fits: oneDNN's blocked layout (`pack_weight`) for many rows, the small GEMM's panels (`TwoLayouts`) for few,
torch's own op elsewhere; it holds no model and chooses no kernel (`dispatch.py`, `kernels/chosen.py`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvcentric.engine.model.ops import SmallGemm
from kvcentric.model.config import ModelConfig


SMALL_GEMM_ROWS = int(os.environ.get("KVC_SMALL_GEMM_ROWS", "128"))
"""A CPU linear layer over at most this many rows (a decode step's, a small mixed step's) runs through the small
GEMM (`TwoLayouts`; KVC_SMALL_GEMM_ROWS=0: never, and no second layout is made): past it oneDNN's GEMM runs at
the core's peak as well, and the second layout would buy nothing (docs/performance.md, "Decode's linear layers")."""


class TwoLayouts:
    """A linear layer's fp32 CPU weight in two layouts: oneDNN's (`pack_weight`) for a step of many rows, and the
    small GEMM's panels for one of at most `rows` (`SmallGemm`, `small_rows`). Twice the weight's memory."""

    def __init__(self, blocked: torch.Tensor, panels: torch.Tensor, out_features: int, gemm: SmallGemm,
                 rows: int = SMALL_GEMM_ROWS) -> None:
        self.blocked, self.panels, self.out_features, self.gemm = blocked, panels, out_features, gemm
        self.rows = rows

    def small(self, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The small GEMM's x @ weightᵀ (+ bias) (+ residual), or None where x has too many rows or is not one it
        takes."""
        if x.shape[0] > self.rows:
            return None
        return self.gemm.small_linear(x, self.panels, self.out_features, bias, residual)


Weight = torch.Tensor | TwoLayouts
"""What a fused projection holds: a torch weight (oneDNN's layout or plain), or both CPU layouts."""


def small_rows(gemm: SmallGemm, out_features: int, in_features: int) -> int:
    """Most rows the small GEMM runs for a weight of this shape: the engine's choice where the GEMM comes with one
    (`kernels/chosen.py`: only where it beats torch's GEMM on this CPU), else SMALL_GEMM_ROWS; never more."""
    chosen = getattr(gemm, "small_rows", None)
    return SMALL_GEMM_ROWS if chosen is None else min(SMALL_GEMM_ROWS, chosen(out_features, in_features))


def two_layouts(weight: Weight, gemm: SmallGemm) -> Weight:
    """`weight` with the small GEMM's panels beside it where the GEMM takes it and runs it for some rows (else as it
    is: no second layout)."""
    if isinstance(weight, TwoLayouts):
        return weight
    rows = small_rows(gemm, weight.shape[0], weight.shape[1])
    if rows <= 0:
        return weight
    plain = weight.to_dense() if weight.is_mkldnn else weight  # oneDNN's blocked layout gives the weight back whole
    panels = gemm.pack_panels(plain)
    return weight if panels is None else TwoLayouts(weight, panels, plain.shape[0], gemm, rows)


def projection_shapes(config: ModelConfig) -> list[tuple[int, int, bool]]:
    """(out_features, in_features, with a residual) of a layer's fused projections as `fuse` makes them: q|k|v, o,
    gate|up, down (the ones `TwoLayouts` may hold)."""
    heads, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return [(heads + 2 * kv, hidden, False), (hidden, heads, True), (2 * inner, hidden, False), (hidden, inner, True)]


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias; a weight packed by `pack_weight` runs through oneDNN's GEMM, a few rows over
    `TwoLayouts` through the small GEMM."""
    if isinstance(weight, TwoLayouts):
        out = weight.small(x, bias)
        if out is not None:
            return out
        weight = weight.blocked
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weightᵀ + bias; with a packed weight the sum is the GEMM's own post-op (no pass of its
    own over the result; the same fp32 sum)."""
    if isinstance(weight, TwoLayouts):
        out = weight.small(x, bias, residual)
        if out is not None:
            return out
        weight = weight.blocked
    if weight.is_mkldnn and residual.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    return residual + linear(x, weight, bias)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN takes fp32 weights on the CPU (where torch has it)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


PACK_ROWS = 32
"""The row count oneDNN is told to expect when it lays a weight out (`pack_weight`). Its blocked layout runs every
row count about as fast whatever the hint (docs/performance-notebook.md, "Fused layer ops and oneDNN's blocked
weights")."""


def pack_weight(weight: torch.Tensor, pack: bool) -> torch.Tensor:
    """`weight` in oneDNN's own blocked layout when `pack` (and possible), else as it is: oneDNN's fp32 GEMM
    runs faster than the default (MKL's), and faster still over its blocked layout (`_reorder_linear_weight`, what
    Inductor's freezing packs with) than over its plain one (`to_mkldnn`), with the same sums
    (docs/performance.md, "oneDNN for the CPU GEMM"). Where the reorder op is missing the plain layout is used."""
    weight = weight.detach()
    if not (pack and can_pack(weight)):
        return weight
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    try:
        return reorder(weight.contiguous(), PACK_ROWS) if reorder is not None else weight.to_mkldnn()
    except RuntimeError:
        return weight.to_mkldnn()
