"""What a simulation measured: one record per request, load samples over time, and the summary the papers'
metrics define (Mooncake §2, §8.1: TTFT, TBT, SLO attainment, goodput counting only requests that
complete within both SLOs); it computes and writes results, it simulates nothing.

A request's TBT is its mean time between tokens after the first: (finish - first token) / (output - 1),
what its client sees, stalls included. It meets the TBT SLO when that mean is within it. The stricter
readings are reported too: `completed_within_slo_p90_gap` (at most 10% of its gaps over the SLO, i.e. its
P90 gap within it) and `completed_within_slo_worst_gap` (every gap within it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from kvcentric.core.sim.workload import SimRequest


@dataclasses.dataclass(slots=True)
class Record:
    request: SimRequest
    status: str = "pending"
    """completed, rejected_before_prefill, rejected_after_prefill."""
    reason: str = ""
    prefill_id: str = ""
    decode_id: str = ""
    predicted_ttft_s: float = 0.0
    predicted_prefill_s: float = 0.0
    planned_blocks: int = 0
    """Leading blocks the placement expected to reuse (local plus pulled)."""
    pull_source: str = ""
    cached_blocks: int = 0
    """Leading blocks actually reused when its prefill started."""
    pulled_blocks: int = 0
    prefill_start: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    max_gap_s: float = 0.0
    """The longest time between two of its tokens after the first (approximate: per decode segment)."""
    slow_gaps: int = 0
    """Its gaps between tokens longer than the TBT SLO."""

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.request.arrival_s

    @property
    def tbt_s(self) -> float:
        out = self.request.output_len
        return (self.finish - self.first_token) / (out - 1) if out > 1 else 0.0

    def row(self) -> dict:
        r = self.request
        row = {"id": r.request_id, "arrival_s": round(r.arrival_s, 4), "input_len": r.input_len,
               "output_len": r.output_len, "status": self.status, "prefill_id": self.prefill_id,
               "decode_id": self.decode_id, "predicted_ttft_s": round(self.predicted_ttft_s, 4),
               "cached_blocks": self.cached_blocks, "pulled_blocks": self.pulled_blocks}
        if self.reason:
            row["reason"] = self.reason
        if self.first_token >= 0:
            row["ttft_s"] = round(self.ttft_s, 4)
        if self.status == "completed":
            row["tbt_s"] = round(self.tbt_s, 5)
            row["max_gap_s"] = round(self.max_gap_s, 4)
            row["e2e_s"] = round(self.finish - r.arrival_s, 4)
        return row


@dataclasses.dataclass
class LoadSeries:
    """Mean load per pool sampled over time: prefill = queued seconds / TTFT_SLO, decode = step time / TBT_SLO."""

    t: list[float] = dataclasses.field(default_factory=list)
    prefill: list[float] = dataclasses.field(default_factory=list)
    decode: list[float] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    rejected: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: [round(v, 4) for v in getattr(self, k)] for k in ("t", "prefill", "decode", "accepted", "rejected")}


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(records: list[Record], ttft_slo_s: float, tbt_slo_s: float) -> dict:
    """The summary.json keys (plus a few more: per-SLO attainment, pulls, wasted prefill)."""
    done = [r for r in records if r.status == "completed"]
    ttft = np.array([r.ttft_s for r in done])
    tbt = np.array([r.tbt_s for r in done if r.request.output_len > 1])
    ttft_ok = [r.ttft_s <= ttft_slo_s for r in done]
    tbt_ok = [r.tbt_s <= tbt_slo_s for r in done]
    within = sum(a and b for a, b in zip(ttft_ok, tbt_ok))
    arrivals = [r.request.arrival_s for r in records]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    prefilled = [r for r in records if r.prefill_start >= 0]
    blocks = sum(len(r.request.hashes) for r in prefilled)
    wasted = [r for r in records if r.status == "rejected_after_prefill"]
    n = len(records)
    return {
        "requests": n, "completed": len(done), "completed_within_slo": within,
        "rejected_before_prefill": sum(r.status == "rejected_before_prefill" for r in records),
        "rejected_after_prefill": len(wasted),
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else 0.0,
        "ttft_p50_s": _percentile(ttft, 50), "ttft_p90_s": _percentile(ttft, 90), "ttft_p99_s": _percentile(ttft, 99),
        "tbt_mean_s": float(tbt.mean()) if len(tbt) else 0.0,
        "tbt_p50_s": _percentile(tbt, 50), "tbt_p90_s": _percentile(tbt, 90), "tbt_p99_s": _percentile(tbt, 99),
        "slo_attainment": within / n if n else 0.0,
        "ttft_slo_attainment": sum(ttft_ok) / n if n else 0.0,
        "tbt_slo_attainment": sum(tbt_ok) / n if n else 0.0,
        "goodput_rps": within / span if span > 0 else 0.0,
        "worst_gap_p90_s": _percentile(np.array([r.max_gap_s for r in done]), 90),
        "completed_within_slo_p90_gap": sum(ok and r.slow_gaps <= 0.1 * (r.request.output_len - 1)
                                            for ok, r in zip(ttft_ok, done)),
        "completed_within_slo_worst_gap": sum(ok and r.max_gap_s <= tbt_slo_s for ok, r in zip(ttft_ok, done)),
        "prefix_hit_ratio": sum(r.cached_blocks for r in prefilled) / blocks if blocks else 0.0,
        "pulls": sum(r.pulled_blocks > 0 for r in prefilled),
        "pulled_blocks": sum(r.pulled_blocks for r in prefilled),
        "wasted_prefill_requests": len(wasted),
        "rejected_share_by_priority": _rejected_by_priority(records),
        "ttft_prediction_abs_error_mean_s": float(np.mean([abs(r.predicted_ttft_s - r.ttft_s) for r in done]))
        if done else 0.0,
        "duration_s": span,
    }


def _rejected_by_priority(records: list[Record]) -> dict[str, float]:
    """Per priority class, the share of its requests rejected (before or after prefill)."""
    classes: dict[int, list[int]] = {}
    for record in records:
        counts = classes.setdefault(record.request.priority, [0, 0])
        counts[0] += 1
        counts[1] += record.status.startswith("rejected")
    return {str(p): round(rejected / total, 4) for p, (total, rejected) in sorted(classes.items())}


def write_results(out: Path, summary: dict, records: list[Record], series: LoadSeries) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "requests.jsonl", "w") as lines:
        for record in records:
            lines.write(json.dumps(record.row()) + "\n")
    (out / "load.json").write_text(json.dumps(series.to_dict()) + "\n")
