"""The Conductor's time estimates: prefill execution, KV transfer over a link, decode step time, and the
decode load forecast of predictive early rejection. Pure: time is passed in; nothing here decides.

Mooncake §6.1: "EstimatePrefillExecutionTime" from an offline-fitted model of length and prefix hit
(`kvcentric.core.costmodel`); "EstimateKVCacheTransferTime" depends on the data size and "whether the
sending node is under congestion" (here: the bytes already queued on its egress link). §7.4: the decode
load at a future moment t assumes every request decodes for a uniform time t_d.
"""

from __future__ import annotations

import bisect
import math

from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import LoadReport


class Estimator:
    """Seconds from token counts, for requests whose prefix hashes cover `block_tokens` tokens each."""

    def __init__(self, cost: CostModel, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.cost = cost
        self.block_tokens = block_tokens

    def cached_tokens(self, n_tokens: int, prefix_blocks: int) -> int:
        """Tokens reused from `prefix_blocks` cached blocks; the last prompt token is always computed."""
        return max(0, min(prefix_blocks * self.block_tokens, n_tokens - 1))

    def t_prefill(self, n_tokens: int, prefix_blocks: int, cost: CostModel | None = None) -> float:
        """Seconds to prefill on an instance whose own model is `cost` (None: this estimator's)."""
        cached = self.cached_tokens(n_tokens, prefix_blocks)
        return (cost or self.cost).t_prefill(n_tokens - cached, cached)

    def block_bytes(self, blocks: int) -> int:
        return blocks * self.block_tokens * self.cost.kv_bytes_per_token

    def tbt(self, batch: float, kv_tokens: float, capacity_tokens: float = math.inf,
            cost: CostModel | None = None) -> float:
        """Decode step seconds for `batch` sequences holding `kv_tokens`; inf when they do not fit."""
        if kv_tokens > capacity_tokens:
            return math.inf
        return (cost or self.cost).t_decode(batch, kv_tokens)

    def report_queue_s(self, report: LoadReport, cost: CostModel | None = None, reported: bool = True) -> float:
        """Seconds of prefill work a load report says is waiting: its own estimate when it sends one (and
        `reported`), else the linear part of T_prefill over its queued tokens (no prefix or quadratic term)."""
        if reported and report.est_queue_s >= 0:
            return report.est_queue_s
        p0, p1, _, _ = (cost or self.cost).prefill
        requests = report.queued_requests + report.running
        return requests * p0 + report.queued_tokens * p1 if requests or report.queued_tokens else 0.0


class LinkTable:
    """Per-link KV bandwidth and the bytes queued on each sender's egress (FIFO, one link per sender)."""

    def __init__(self, default_bytes_per_s: float) -> None:
        if default_bytes_per_s <= 0:
            raise ValueError("link bandwidth must be positive")
        self.default = default_bytes_per_s
        self.bandwidth: dict[tuple[str, str], float] = {}
        self.busy_until: dict[str, float] = {}

    def bytes_per_s(self, source: str, target: str) -> float:
        return self.bandwidth.get((source, target), self.default)

    def set_bandwidth(self, source: str, target: str, bytes_per_s: float) -> None:
        """A measured or configured bandwidth for one directed link."""
        self.bandwidth[(source, target)] = bytes_per_s

    def t_transfer(self, source: str, target: str, nbytes: float, now: float) -> float:
        """Seconds until `nbytes` sent now from source reach target, behind what is queued at source."""
        backlog = max(0.0, self.busy_until.get(source, 0.0) - now)
        return backlog + nbytes / self.bytes_per_s(source, target)

    def reserve(self, source: str, target: str, nbytes: float, now: float) -> float:
        """Queue `nbytes` on the source's egress; returns when they will have arrived."""
        done = max(now, self.busy_until.get(source, 0.0)) + nbytes / self.bytes_per_s(source, target)
        self.busy_until[source] = done
        return done


class DecodeForecast:
    """Requests headed for, or decoding on, one decode instance, as predicted decode start times.

    Mooncake §7.4, system-level prediction: a request placed now joins decode when its prefill ends
    (now + predicted TTFT) and leaves t_d later. The batch at a moment t is the tracked requests with
    t - t_d < start <= t, plus the difference between the instance's last reported batch and what the
    tracking says it held then (requests we did not place, or that left early), fading out over t_d.
    """

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.tokens: list[int] = []
        self.ids: list[str] = []
        self.by_request: dict[str, float] = {}
        self.offset_batch = 0
        self.offset_tokens = 0
        self.offset_at = 0.0

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, request_id: str, start: float, tokens: int) -> None:
        self.remove(request_id)
        index = bisect.bisect_right(self.starts, start)
        self.starts.insert(index, start)
        self.tokens.insert(index, tokens)
        self.ids.insert(index, request_id)
        self.by_request[request_id] = start

    def remove(self, request_id: str) -> bool:
        start = self.by_request.pop(request_id, None)
        if start is None:
            return False
        index = bisect.bisect_left(self.starts, start)
        while self.ids[index] != request_id:
            index += 1
        del self.starts[index], self.tokens[index], self.ids[index]
        return True

    def expire(self, now: float, t_d: float) -> None:
        """Forget requests predicted to have finished (start + t_d before now)."""
        cut = bisect.bisect_left(self.starts, now - t_d)
        if cut:
            for request_id in self.ids[:cut]:
                del self.by_request[request_id]
            del self.starts[:cut], self.tokens[:cut], self.ids[:cut]

    def in_flight(self, now: float) -> tuple[int, int]:
        """(requests, prompt tokens) placed here whose decode has not started yet by prediction."""
        index = bisect.bisect_right(self.starts, now)
        return len(self.starts) - index, sum(self.tokens[index:])

    def tracked_at(self, t: float, t_d: float) -> tuple[int, int]:
        starts = self.starts
        if not starts or starts[-1] <= t - t_d or starts[0] > t:
            return 0, 0
        lo = bisect.bisect_right(starts, t - t_d)
        hi = bisect.bisect_right(starts, t)
        return hi - lo, sum(self.tokens[lo:hi])

    def reconcile(self, running: int, kv_tokens: int, now: float, t_d: float) -> None:
        """Anchor the forecast to a load report: remember what the tracking misses (or overcounts) now."""
        batch, tokens = self.tracked_at(now, t_d)
        self.offset_batch, self.offset_tokens, self.offset_at = running - batch, kv_tokens - tokens, now

    def at(self, t: float, t_d: float) -> tuple[float, float]:
        """Predicted (batch, kv tokens) at moment t."""
        batch: float
        tokens: float
        batch, tokens = self.tracked_at(t, t_d)
        if not (self.offset_batch or self.offset_tokens) or t_d <= 0:
            return batch, tokens
        fade = 1.0 - (t - self.offset_at) / t_d
        if fade <= 0.0:
            return batch, tokens
        batch, tokens = batch + fade * self.offset_batch, tokens + fade * self.offset_tokens
        return (batch if batch > 0.0 else 0.0), (tokens if tokens > 0.0 else 0.0)
