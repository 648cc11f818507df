"""LayerKV's SLO-aware scheduler (§3.1, eqs. 1–3 and Algorithm 1) and its free-block forecast (§3.1.1, eq. 5).

From each decoding request's time spent decoding, tokens generated and predicted tokens still to come, the
longest prefill that keeps every one of them within the TPOT SLO (eq. 1); prompts from the queue are admitted
in order while their predicted prefill times (eq. 3) sum within it (eq. 2); the forecast of free device blocks
over the next stages (eq. 5) names the requests whose retained layers must also leave the device, most recent
first. Pure arithmetic on values passed in; it allocates and moves nothing.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Decoding:
    """A request in its decoding phase, as the scheduler sees it."""
    elapsed_s: float
    """Time since its decoding began, waits included (t_i)."""
    generated: int
    """Tokens generated so far (n_i)."""
    remaining: int
    """Tokens predicted still to come (m_i), at least 1."""


def request_slack_s(request: Decoding, tpot_slo_s: float, tpot_s: float) -> float:
    """Eq. 1 for one request: the prefill time that may be inserted before its TPOT over its whole output
    exceeds the SLO, its remaining tokens taking the current TPOT each:
    SLO · (n + m) − t − TPOT · m."""
    remaining = max(1, request.remaining)
    return tpot_slo_s * (request.generated + remaining) - request.elapsed_s - tpot_s * remaining


def prefill_budget_s(decoding: list[Decoding], tpot_slo_s: float, tpot_s: float) -> float:
    """Eq. 1: the largest prefill time every decoding request can absorb (infinite with none decoding)."""
    return min((request_slack_s(r, tpot_slo_s, tpot_s) for r in decoding), default=math.inf)


@dataclasses.dataclass(frozen=True)
class PrefillCost:
    """Eq. 3: T_prefill(s) = α · (2·P·s + 2·L·h·s²) / F, with α the correction profiling fits."""
    params: float
    num_layers: int
    hidden: int
    flops: float
    alpha: float = 1.0

    def theoretical_s(self, seqlen: int, cached: int = 0) -> float:
        """Without α; `cached`: tokens before these whose KV is there already (a later prefill chunk)."""
        attention = 2 * self.num_layers * self.hidden * seqlen * (seqlen + cached)
        return (2 * self.params * seqlen + attention) / self.flops

    def seconds(self, seqlen: int, cached: int = 0) -> float:
        return self.alpha * self.theoretical_s(seqlen, cached)

    def refit(self, seqlen: int, measured_s: float, cached: int = 0, weight: float = 0.2) -> PrefillCost:
        """α moved toward what one measured prefill (or chunk) says (an exponential average)."""
        observed = measured_s / self.theoretical_s(seqlen, cached)
        return dataclasses.replace(self, alpha=(1 - weight) * self.alpha + weight * observed)


def admitted_prefills(prefill_s: list[float], budget_s: float) -> int:
    """Eq. 2: how many prompts from the head of the queue fit: the largest k with Σ_{j≤k} T_j ≤ budget."""
    total = 0.0
    for count, seconds in enumerate(prefill_s):
        total += seconds
        if total > budget_s:
            return count
    return len(prefill_s)


@dataclasses.dataclass(frozen=True)
class Admission:
    budget_s: float
    admitted: int
    prefill_s: list[float]


def schedule_prefills(queue_seqlens: list[int], decoding: list[Decoding], tpot_slo_s: float, tpot_s: float,
                      cost: PrefillCost) -> Admission:
    """Algorithm 1: the budget from the decoding requests (eq. 1), each queued prompt's predicted prefill
    (eq. 3), and how many of them are admitted in order (eq. 2). No SLO (0): every prompt."""
    times = [cost.seconds(seqlen) for seqlen in queue_seqlens]
    if tpot_slo_s <= 0:
        return Admission(math.inf, len(times), times)
    budget = prefill_budget_s(decoding, tpot_slo_s, tpot_s)
    return Admission(budget, admitted_prefills(times, budget), times)


@dataclasses.dataclass(frozen=True)
class Holding:
    """A decoding request as the forecast sees it."""
    key: str
    remaining: int
    """Tokens predicted still to come (the median of its predicted range)."""
    device_layer_blocks: int
    """Layer blocks it holds on the device (freed when it ends)."""
    growth_layer_blocks: int
    """Layer blocks one more block of its takes on the device."""


def forecast_free(free_now: int, holdings: list[Holding], stages: int, stage_tokens: int,
                  prefill_layer_blocks: int = 0) -> list[int]:
    """Eq. 5: F_{t+1} = F_t + R_t − A_t over `stages` stages of `stage_tokens` decode steps (a block's worth,
    so each running request takes one more block per stage, conservatively); R_t: what requests predicted to
    end within stage t free; A_t: their growth, plus the prefill planned now in the first stage."""
    free = [free_now]
    for stage in range(stages):
        alive = [h for h in holdings if h.remaining > stage * stage_tokens]
        released = sum(h.device_layer_blocks + h.growth_layer_blocks for h in alive
                       if h.remaining <= (stage + 1) * stage_tokens)
        allocated = sum(h.growth_layer_blocks for h in alive) + (prefill_layer_blocks if stage == 0 else 0)
        free.append(free[-1] + released - allocated)
    return free


def offload_victims(forecast: list[int], threshold: int, newest_first: list[Holding]) -> list[str]:
    """§3.1.1: when the forecast dips below `threshold` free layer blocks, the requests whose device layers
    go to the host, most recent first, until the deficit is covered (or none is left)."""
    deficit = threshold - min(forecast)
    victims = []
    for holding in newest_first:
        if deficit <= 0:
            break
        if holding.device_layer_blocks > 0:
            victims.append(holding.key)
            deficit -= holding.device_layer_blocks
    return victims
