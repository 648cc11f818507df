"""The CPU kernels an engine runs, as KVC_KERNELS and the kernel choice allow (`choice.py`): each kernel used only
up to the row count where it beat torch's op on this CPU, torch's op beyond it.

KVC_KERNELS=auto (the default): the choice, timed at the first start on a CPU and read from its cache after.
KVC_KERNELS=on: every kernel wherever it takes the tensors (the small GEMM up to KVC_SMALL_GEMM_ROWS rows), as
before the choice, whatever its speed (the tests run so). KVC_KERNELS=off: torch's ops everywhere.

It wraps; it times nothing itself and computes nothing beyond the kernels' calls and torch's.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from kvcentric.engine.model import kernels
from kvcentric.engine.model.kernels.choice import Choice, Target, choose
from kvcentric.model.config import ModelConfig

log = logging.getLogger("kvcentric.kernels")

MODES = ("auto", "on", "off")


def mode() -> str:
    """KVC_KERNELS: auto, on or off (ValueError naming it otherwise)."""
    value = os.environ.get("KVC_KERNELS", "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"KVC_KERNELS={value!r}: give auto, on or off")
    return value


def cpu_kernels(config: ModelConfig, dtype: torch.dtype, block_size: int,
                onednn: bool = True) -> tuple[ChosenAttention | kernels.CpuAttention | None,
                                              ChosenOps | kernels.CpuLayerOps | None]:
    """The attention kernels and fused layer ops (fp32) an engine of this model runs on the CPU, each None where
    torch's ops run everywhere (KVC_KERNELS=off, no compiler, or slower at every row count timed)."""
    how = mode()
    attention = None if how == "off" else kernels.load()
    if attention is None:
        return None, None
    ops = kernels.CpuLayerOps(attention.path) if dtype == torch.float32 else None
    if how == "on":
        return attention, ops
    try:
        choice = choose(Target(config, dtype, block_size, onednn), attention, ops, kernels.cache_dir(),
                        kernels.cpu_signature())
    except (RuntimeError, ValueError, OSError) as error:  # a race that failed: the kernels run as they did before
        log.warning("kernel choice failed (%s: %s); every kernel runs wherever it takes the tensors",
                    type(error).__name__, error)
        return attention, ops
    log.info("%s", choice.summary())
    return ChosenAttention.of(attention, choice), None if ops is None else ChosenOps.of(ops, choice)


class ChosenAttention:
    """`ops.AttentionKernels` that decline beyond the chosen row counts: decode steps of more sequences, prompts
    of more tokens (the engine then runs SDPA)."""

    def __init__(self, attention: kernels.CpuAttention, decode_rows: int, prefill_rows: int) -> None:
        self.attention, self.decode_rows, self.prefill_rows = attention, decode_rows, prefill_rows
        self.path = attention.path

    @classmethod
    def of(cls, attention: kernels.CpuAttention, choice: Choice) -> ChosenAttention | None:
        decode, prefill = choice.rows("decode_attention"), choice.rows("prefill_attention")
        return cls(attention, decode, prefill) if decode or prefill else None

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor, block_size: int, window: int | None = None) -> torch.Tensor | None:
        if q.shape[0] > self.decode_rows:
            return None
        return self.attention.decode(q, k_cache, v_cache, tables, lengths, block_size, window)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> bool:
        if lengths.numel() and int(lengths.max()) > self.prefill_rows:
            return False
        return self.attention.prefill(q, k, v, out, starts, lengths)


class ChosenOps:
    """`ops.LayerOps` and `ops.SmallGemm` that run each kernel up to its chosen rows and torch's op beyond
    (`small_rows`: the GEMM's limit per weight shape, read once as the weights are laid out)."""

    def __init__(self, ops: kernels.CpuLayerOps, choice: Choice) -> None:
        self.ops, self.choice = ops, choice
        self.norm_rows, self.swiglu_rows = choice.rows("rms_norm"), choice.rows("silu_mul")
        self.rotary_rows = choice.rows("rotate_store")

    @classmethod
    def of(cls, ops: kernels.CpuLayerOps, choice: Choice) -> ChosenOps | None:
        chosen = cls(ops, choice)
        return chosen if any(choice.limits.get(site.kernel) for site in choice.sites
                             if site.kernel not in ("decode_attention", "prefill_attention")) else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[0] <= self.norm_rows:
            return self.ops.rms_norm(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[0] <= self.swiglu_rows:
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def fits(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return qkv.shape[0] <= self.rotary_rows and self.ops.fits(qkv, k_cache, v_cache)

    def rotate_store(self, qkv, heads, kv_heads, cos, sin, positions, slots, k_cache, v_cache):
        return self.ops.rotate_store(qkv, heads, kv_heads, cos, sin, positions, slots, k_cache, v_cache)

    def small_rows(self, out_features: int, in_features: int) -> int:
        return self.choice.gemm_rows(out_features, in_features)

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        return self.ops.pack_panels(weight)

    def small_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.ops.small_linear(x, panels, out_features, bias, residual)
