"""The SLOs a request is held to: the absolute ones the operator set (`--ttft-slo-s`, `--tbt-slo-s`), or, where
none is set, SLOs relative to the deployment's own unloaded speed, as the papers set theirs (Mooncake §8.1,
DistServe): TTFT SLO = `ttft_factor` x the unloaded prefill time of the request's prompt, TBT SLO = `tbt_factor`
x the unloaded decode step (a batch of one, the prompt's context). Pure; it computes SLOs, it judges nothing.

"Unloaded" is read from the cost models the instances measured of themselves (`MeasuredCost`, a fit of each
prefill chunk and decode step they timed): the fastest trusted one of the pool, so a slow model on slow hardware
gets SLOs it can meet, and a lone request at an idle instance is never over its SLO by prediction. With no
trusted model yet there is no relative SLO (infinite): nothing is judged on a guess anyway.

A relative SLO is never tighter than its floor (`TTFT_FLOOR_S`, `TBT_FLOOR_S`: the absolute defaults of before):
10x the prefill of a 16-token prompt of a 24 M model is a few milliseconds, less than the hops every request takes
(gateway, bus, conductor) and than one step beside a burst, so without a floor a fast model refused short prompts
on an idle cluster. The floors keep what served before; the factors let a slow model on slow hardware serve.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from kvcentric.core.costmodel import CostModel

TTFT_FACTOR = 10.0
"""Relative TTFT SLO: this many times the unloaded prefill time of the prompt (the papers' 10x)."""
TBT_FACTOR = 5.0
"""Relative TBT SLO: this many times the unloaded decode step (the papers' 5x)."""
TTFT_FLOOR_S = 1.0
"""The least relative TTFT SLO, seconds (the absolute default before SLOs were relative)."""
TBT_FLOOR_S = 0.1
"""The least relative TBT SLO, seconds (likewise)."""
PACE_OF_SLO = 0.8
"""A decode instance that lends its core to a prefill during a burst starts its steps at most this share of its TBT
SLO apart (`kvcentric up --lend-pace-s`, the decode's own relative pace)."""
SHOWN_PROMPT_TOKENS = 256
"""The prompt length whose relative TTFT SLO /health and `kvcentric up` show as an example."""


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    """The SLOs one request is held to, in seconds (inf: none known, nothing judged against it)."""

    ttft_s: float
    tbt_s: float


@dataclasses.dataclass(frozen=True)
class SloPolicy:
    """Absolute SLOs where set (> 0), else relative ones from the unloaded speed of the fastest trusted model."""

    ttft_slo_s: float = 0.0
    """Absolute TTFT SLO, seconds; 0: relative."""
    tbt_slo_s: float = 0.0
    """Absolute TBT SLO, seconds; 0: relative."""
    ttft_factor: float = TTFT_FACTOR
    tbt_factor: float = TBT_FACTOR
    ttft_floor_s: float = TTFT_FLOOR_S
    """The least relative TTFT SLO."""
    tbt_floor_s: float = TBT_FLOOR_S
    """The least relative TBT SLO."""

    def __post_init__(self) -> None:
        if self.ttft_slo_s < 0 or self.tbt_slo_s < 0 or self.ttft_factor <= 0 or self.tbt_factor <= 0:
            raise ValueError("SLOs must be 0 (relative) or positive, factors positive")

    @property
    def relative(self) -> bool:
        """Whether either SLO is relative (it then depends on the instances' models)."""
        return not (self.ttft_slo_s and self.tbt_slo_s)

    def for_request(self, n_tokens: int, prefill_models: Iterable[CostModel],
                    decode_models: Iterable[CostModel]) -> Slo:
        """The SLOs of a request of `n_tokens` prompt tokens, given the trusted models of the alive instances."""
        return Slo(self.ttft_s(n_tokens, prefill_models), self.tbt_s(n_tokens, decode_models))

    def ttft_s(self, n_tokens: int, models: Iterable[CostModel]) -> float:
        if self.ttft_slo_s:
            return self.ttft_slo_s
        unloaded = unloaded_ttft_s(n_tokens, models)
        return max(self.ttft_floor_s, self.ttft_factor * unloaded) if unloaded > 0 else math.inf

    def tbt_s(self, n_tokens: int, models: Iterable[CostModel]) -> float:
        if self.tbt_slo_s:
            return self.tbt_slo_s
        unloaded = unloaded_tbt_s(n_tokens, models)
        return relative_tbt_s(self.tbt_factor, unloaded, self.tbt_floor_s) if unloaded > 0 else math.inf

    def describe(self, prefill_models: list[CostModel], decode_models: list[CostModel],
                 n_tokens: int = SHOWN_PROMPT_TOKENS) -> dict:
        """The SLOs in force, for /health: each absolute, or relative with its value for an `n_tokens` prompt
        now (None while no instance has a trusted model)."""
        slo = self.for_request(n_tokens, prefill_models, decode_models)

        def shown(absolute: float, factor: float, value: float) -> dict:
            if absolute:
                return {"mode": "absolute", "s": absolute}
            return {"mode": "relative", "factor": factor, "prompt_tokens": n_tokens,
                    "s": round(value, 6) if math.isfinite(value) else None}
        return {"ttft": shown(self.ttft_slo_s, self.ttft_factor, slo.ttft_s),
                "tbt": shown(self.tbt_slo_s, self.tbt_factor, slo.tbt_s)}


def relative_tbt_s(factor: float, unloaded_s: float, floor_s: float = TBT_FLOOR_S) -> float:
    """A relative TBT SLO: `factor` x the unloaded step, at least `floor_s` (the decode's double-check too)."""
    return max(floor_s, factor * unloaded_s)


def unloaded_ttft_s(n_tokens: int, models: Iterable[CostModel]) -> float:
    """The least prefill time of an uncached `n_tokens` prompt over `models` (0: no model)."""
    return min((model.t_prefill(n_tokens, 0) for model in models), default=0.0)


def unloaded_tbt_s(n_tokens: int, models: Iterable[CostModel]) -> float:
    """The least decode step of one sequence holding the `n_tokens` prompt over `models` (0: no model)."""
    return min((model.t_decode(1, n_tokens + 1) for model in models), default=0.0)


def summary(described: dict) -> str:
    """One line of what `SloPolicy.describe` gives: "TTFT 10x unloaded (0.3 s for 256 tokens), TBT 5x unloaded
    (50 ms)" or the absolute values."""
    def part(name: str, shown: dict, unit_ms: bool) -> str:
        value = shown.get("s")
        text = "" if value is None else (f"{value * 1000:.0f} ms" if unit_ms else f"{value:.3g} s")
        if shown.get("mode") == "absolute":
            return f"{name} {text}"
        if value is None:
            return f"{name} {shown['factor']:g}x unloaded (not measured yet)"
        tokens = f" for {shown['prompt_tokens']} tokens" if not unit_ms else ""
        return f"{name} {shown['factor']:g}x unloaded (~{text}{tokens})"
    return f"{part('TTFT', described['ttft'], False)}, {part('TBT', described['tbt'], True)}"
