"""SLOs relative to unloaded latency (Mooncake §2, §8.1): the TTFT and TBT thresholds as multiples of the P90
TTFT and P90 TBT that a run at the lowest rate measured (the paper's end-to-end experiments use TTFT_P90 = 10×
and TBT_P90 = 5×); it turns a reference summary into thresholds and reads no clock and runs nothing.

The paper defines the multiple against "a single request running under the same conditions without
interference" (§2) and sets the thresholds "by multiplying the lowest observed RPS values by factors of 10 and
5" (§8.1), then normalises every TTFT and TBT by its threshold so that 1.0 is the limit. We take the P90s of
a reference run at a rate low enough that requests hardly overlap (`summary.json` of `kvcentric sim` or
`kvcentric bench replay`); the same reference serves every deployment compared, so they face one SLO.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

TTFT_FACTOR = 10.0
"""Mooncake §2, §8.1: TTFT_P90 = 10× the unloaded value."""
TBT_FACTOR = 5.0
"""Mooncake §2, §8.1: TBT_P90 = 5× the unloaded value."""


@dataclasses.dataclass(frozen=True)
class Slos:
    ttft_s: float
    tbt_s: float
    unloaded_ttft_s: float = 0.0
    """The reference's P90 TTFT (0: the SLOs are fixed, not relative)."""
    unloaded_tbt_s: float = 0.0
    ttft_factor: float = 0.0
    tbt_factor: float = 0.0

    def to_dict(self) -> dict:
        return {k: round(v, 6) for k, v in dataclasses.asdict(self).items()}


def relative_slos(reference: Mapping, ttft_factor: float = TTFT_FACTOR, tbt_factor: float = TBT_FACTOR) -> Slos:
    """Thresholds `ttft_factor` × and `tbt_factor` × the reference summary's `ttft_p90_s` and `tbt_p90_s`."""
    if ttft_factor <= 0 or tbt_factor <= 0:
        raise ValueError(f"SLO factors must be positive, got {ttft_factor} and {tbt_factor}")
    ttft, tbt = float(reference.get("ttft_p90_s", 0.0)), float(reference.get("tbt_p90_s", 0.0))
    if ttft <= 0 or tbt <= 0:
        raise ValueError(f"the reference run has no positive P90 TTFT and TBT (got {ttft} and {tbt}): "
                         "did any request complete with more than one output token?")
    return Slos(ttft_factor * ttft, tbt_factor * tbt, ttft, tbt, ttft_factor, tbt_factor)


def load_reference(path: str | Path) -> dict:
    """The summary.json at `path`, or in the folder `path`."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    with open(path) as handle:
        summary = json.load(handle)
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: not a summary.json (expected a JSON object)")
    return summary


def normalised_p90s(summary: Mapping, slos: Slos) -> dict:
    """P90 TTFT and P90 TBT divided by their thresholds (1.0 is the limit), and whether both are within."""
    ttft = summary["ttft_p90_s"] / slos.ttft_s
    tbt = summary["tbt_p90_s"] / slos.tbt_s
    return {"ttft_p90_normalised": ttft, "tbt_p90_normalised": tbt,
            "p90_slos_met": bool(summary["completed"]) and ttft <= 1.0 and tbt <= 1.0}
