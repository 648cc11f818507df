"""Prefill placement policies, chosen by name: random, load_balance, cache_aware (Mooncake §6.1),
kvcentric (Algorithm 1 with cache load balancing, §6.2) and llumnix (prefixMissTokens +
allPrefillsTokensNum). Each returns the prefill instance it picks and its predicted TTFT; none of them
chooses the decode instance, rejects, or changes any state. A policy reads only what it is given: each
candidate's `view.PrefillView` (its queue, load, cost, correction and the prompt's blocks it holds), built by the
Conductor for this one decision.

Every policy predicts TTFT = [T_transfer +] T_queue + T_prefill, so all can be held to the same SLO.
An instance reuses the prefix blocks it holds locally; only `kvcentric` also pulls blocks from the
instance holding the longest prefix (hot-spot replication).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Literal, Protocol, get_args

from kvcentric.core.protocol import ScheduleRequest
from kvcentric.core.scheduling.estimators import Estimator, LinkTable
from kvcentric.core.scheduling.view import BlockHolder, PrefillView


@dataclasses.dataclass(slots=True)
class PrefillChoice:
    instance: PrefillView
    ttft_s: float
    """Predicted time to first token: transfer + queue + prefill."""
    prefill_s: float
    """Predicted prefill execution time (what the instance's queue grows by)."""
    prefix_blocks: int
    """Leading blocks the instance will not compute (held locally, or pulled)."""
    source: PrefillView | BlockHolder | None = None
    """Instance to pull the blocks [local prefix, prefix_blocks) from, when pulling (a prefill instance, or a decode
    instance keeping a broken push's KV)."""
    local_blocks: int = 0
    """Leading blocks the instance holds itself."""
    decode_prefix_source: PrefillView | None = None
    """PrfaaS §3.3: the local-cluster instance the decode instance takes the prompt's cached prefix from
    (a remote prefill then ships only the KV after it), or None."""
    decode_prefix_tokens: int = 0

    @property
    def pull_blocks(self) -> int:
        return self.prefix_blocks - self.local_blocks if self.source is not None else 0


def best_holder(candidates: Sequence[PrefillView], pullable: bool = False) -> tuple[PrefillView | None, int]:
    """FindBestPrefixMatch over a pool: the candidate holding the longest prefix of the prompt and its length in
    blocks (None, 0 when none holds any). `pullable`: count only the blocks each holds now (blocks it is only
    expected to hold cannot be pulled from it yet)."""
    source, best = None, 0
    for candidate in candidates:
        prefix = candidate.held_blocks if pullable else candidate.prefix_blocks
        if prefix > best:
            source, best = candidate, prefix
    return source, best


class PlacementPolicy(Protocol):
    name: str

    def choose(self, request: ScheduleRequest, candidates: Sequence[PrefillView], now: float) -> PrefillChoice:
        """Pick one of `candidates` (non-empty) for `request`: each is a prefill instance or group as the
        Conductor sees it for this decision, with the blocks of this prompt it holds."""


class _Policy:
    name = ""

    def __init__(self, estimator: Estimator) -> None:
        self.estimator = estimator

    def local(self, request: ScheduleRequest, instance: PrefillView) -> PrefillChoice:
        """The choice of `instance` reusing only its own prefix."""
        prefix = instance.prefix_blocks
        prefill_s = self.estimator.t_prefill(request.n_tokens, prefix, instance.cost)
        return PrefillChoice(instance, instance.queue_s + prefill_s, prefill_s, prefix, None, prefix)


class RandomPolicy(_Policy):
    """Any instance, uniformly (§6.2's random baseline); seeded, so runs repeat."""

    name = "random"

    def __init__(self, estimator: Estimator, seed: int = 0) -> None:
        super().__init__(estimator)
        self.rng = random.Random(seed)

    def choose(self, request, candidates, now):
        return self.local(request, candidates[self.rng.randrange(len(candidates))])


class LoadBalancePolicy(_Policy):
    """The instance with the least queued prefill time (§6.2's load-balancing baseline)."""

    name = "load_balance"

    def choose(self, request, candidates, now):
        return self.local(request, min(candidates, key=lambda s: s.queue_s))


class CacheAwarePolicy(_Policy):
    """Least T_queue + T_prefill(len, local prefix): Algorithm 1 without the transfer branch (§6.1)."""

    name = "cache_aware"

    def choose(self, request, candidates, now):
        estimator, n = self.estimator, request.n_tokens
        memo: dict[object, float] = {}
        best, best_ttft = candidates[0], math.inf
        for instance in candidates:
            prefix, cost = instance.prefix_blocks, instance.cost
            key = prefix if cost is None else (id(cost), prefix)
            prefill_s = memo.get(key)
            if prefill_s is None:
                prefill_s = memo[key] = estimator.t_prefill(n, prefix, cost)
            ttft = (instance.queue_s + prefill_s) * instance.correction
            if ttft < best_ttft:
                best, best_ttft = instance, ttft
        return self.local(request, best)


class KVCentricPolicy(_Policy):
    """Mooncake Algorithm 1: where the best prefix anywhere exceeds an instance's own prefix by more
    than `kvcache_balancing_threshold` times, that instance's TTFT is T_transfer(best holder ->
    instance) + T_queue + T_prefill(len, best) and it would pull the blocks; otherwise T_queue +
    T_prefill(len, prefix). The least TTFT wins (§6.2: hot spots get replicated as a side effect)."""

    name = "kvcentric"

    def __init__(self, estimator: Estimator, links: LinkTable, threshold: float = 2.0) -> None:
        super().__init__(estimator)
        if threshold < 1:
            raise ValueError(f"kvcache_balancing_threshold must be >= 1, got {threshold}")
        self.links, self.threshold = links, threshold

    def choose(self, request, candidates, now):
        estimator, n, threshold = self.estimator, request.n_tokens, self.threshold
        source, best_prefix = best_holder(candidates, pullable=True)
        memo: dict[object, float] = {}
        best, best_ttft, best_score, best_pull = candidates[0], math.inf, math.inf, False
        for instance in candidates:  # the hot loop of the conductor: kept flat on purpose
            prefix, cost = instance.prefix_blocks, instance.cost
            pull = best_prefix > prefix * threshold
            reused = best_prefix if pull else prefix
            key = reused if cost is None else (id(cost), reused)  # an instance with its own model: its own entry
            prefill_s = memo.get(key)
            if prefill_s is None:
                prefill_s = memo[key] = estimator.t_prefill(n, reused, cost)
            ttft = instance.queue_s + prefill_s
            if pull:
                assert source is not None  # best_prefix > 0, so some instance holds it
                nbytes = estimator.block_bytes(best_prefix - prefix)
                ttft += self.links.t_transfer(source.instance_id, instance.instance_id, nbytes, now)
            score = ttft * instance.correction  # ranked on the corrected prediction, the raw one returned
            if score < best_score:
                best, best_ttft, best_score, best_pull = instance, ttft, score, pull
        prefix = best.prefix_blocks
        reused = best_prefix if best_pull else prefix
        key = reused if best.cost is None else (id(best.cost), reused)
        return PrefillChoice(best, best_ttft, memo[key], reused, source if best_pull else None, prefix)


class LlumnixPolicy(_Policy):
    """Least prefixMissTokens + allPrefillsTokensNum (uncached tokens of this request plus tokens
    waiting for prefill there), queued prefill time as the tiebreak (Llumnix cache-aware scheduling)."""

    name = "llumnix"

    def choose(self, request, candidates, now):
        n, cached = request.n_tokens, self.estimator.cached_tokens

        def metric(instance: PrefillView) -> tuple[float, float]:
            miss = n - cached(n, instance.prefix_blocks)
            return miss + instance.load_tokens, instance.queue_s

        return self.local(request, min(candidates, key=metric))


class KVCacheHitLenPolicy(_Policy):
    """Most prefixHitTokens (Llumnix's kvCacheHitLen metric: the longest cached prefix wins), least queued
    prefill time among equals."""

    name = "kv_cache_hit_len"

    def choose(self, request, candidates, now):
        n, cached = request.n_tokens, self.estimator.cached_tokens

        def metric(instance: PrefillView) -> tuple[float, float]:
            return -cached(n, instance.prefix_blocks), instance.queue_s

        return self.local(request, min(candidates, key=metric))


PlacementName = Literal["random", "load_balance", "cache_aware", "kvcentric", "llumnix", "kv_cache_hit_len"]
"""The placement policies, by the name `--policy` takes."""
PLACEMENT_POLICIES: tuple[str, ...] = get_args(PlacementName)
ESTIMATOR_ONLY = {policy.name: policy for policy in (LoadBalancePolicy, CacheAwarePolicy, LlumnixPolicy,
                                                     KVCacheHitLenPolicy)}
"""The policies built from the estimator alone."""


def make_policy(name: str, estimator: Estimator, links: LinkTable, threshold: float = 2.0,
                seed: int = 0) -> PlacementPolicy:
    """The placement policy called `name` (one of PLACEMENT_POLICIES)."""
    if name == RandomPolicy.name:
        return RandomPolicy(estimator, seed)
    if name == KVCentricPolicy.name:
        return KVCentricPolicy(estimator, links, threshold)
    if name not in ESTIMATOR_ONLY:
        raise ValueError(f"unknown placement policy {name!r}; choose {', '.join(PLACEMENT_POLICIES)}")
    return ESTIMATOR_ONLY[name](estimator)
